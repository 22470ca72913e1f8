"""Goodput with no fault: the quickstart job (jobs/quickstart.yaml: 2 workers, ZeRO-2, checkpoints and
logging as shipped) run as a user runs it, and its platform goodput account (docs/reliability.md).
The claim: productive time is at least 95% of the wall time after start-up (the wall time less the
queue, start-up and restore buckets: from the first step to the job's end, its last save and
teardown included). Every run is reported, with its buckets.

    python -m benchmarks.goodput_clean [--runs 1] [--steps 120] [--no-doc]

The account adds no work to a training step (the tracker builds it from events rank 0 already
writes, plus one event per worker group), so there is no switch to turn it off and no on/off pair
to time: its only cost in the workers is one event per group and two clock reads per evaluation.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import ray

from benchmarks import goodput_check
from benchmarks.common import ROOT, history, update_doc
from tidal.goodput.account import BUCKETS
from tidal.spec.job import JobSpec
from tidal.spec.load import load_spec
from tidal.testing.runs import prepared_store

SECTION = "Goodput with no fault: the quickstart job"
CLAIM = 0.95


def run_once(tmp: Path, steps: int, i: int) -> dict[str, float]:
    import tidal

    spec = load_spec(ROOT / "jobs" / "quickstart.yaml", [
        f"name=goodput-clean-{i}", f"train.steps={steps}", f"checkpoint.storage={tmp / 'runs'}",
        f"tracking.uri={prepared_store(tmp / f'mlflow-{i}.db')}"])
    t0 = time.time()
    result = tidal.run(spec)
    wall = time.time() - t0
    g = goodput_check.ledger(spec.tracking.uri, result.mlflow_run_id)
    after = g["goodput_wall_s"] - g["goodput_queue_s"] - g["goodput_startup_s"] - g["goodput_restore_s"]
    return {**g, "bench_wall_s": wall, "after_start_s": after, "productive_after": g["goodput_productive_s"] / after,
            **_slowest(spec, result.mlflow_run_id)}


def _slowest(spec: JobSpec, run_id: str) -> dict[str, float]:
    """Which rank was the slowest at the sampled log steps, and by how much (the straggler wait's
    source): `slowest_rank0_share`, the share of log steps where rank 0 was; `median_ratio`, the
    median of the slowest rank's busy time over the median rank's."""
    ranks = [v for v, _ in history(spec, run_id, "straggler_rank").values()]
    ratios = sorted(v for v, _ in history(spec, run_id, "straggler_ratio").values())
    return {"slowest_rank0_share": ranks.count(0.0) / len(ranks) if ranks else math.nan,
            "median_ratio": ratios[len(ratios) // 2] if ratios else math.nan}


SHOWN = ("productive", "queue", "startup", "restore", "checkpoint_stall", "post_save_slowdown", "other")


def _rest(r: dict[str, float]) -> str:
    """The buckets the table has no column for (straggler wait, data wait, evaluation...), where not ~0."""
    rest = [(r.get(f"goodput_{b}_s", 0.0), b) for b in BUCKETS if b not in SHOWN]
    return ", ".join(f"{b.replace('_', ' ')} {v:.2f} s" for v, b in sorted(rest, reverse=True) if v > 0.05) or "none"


def report(runs: list[dict[str, float]], command: str) -> str:
    lines = [f"Command: `{command}` ({time.strftime('%Y-%m-%d')}, 2-core CPU machine shared with other work; "
             "one local Ray instance)", "",
             "| run | wall (account / benchmark) | start-up (queue + start-up + restore) | wall after start-up | "
             "productive / wall after start-up | checkpoint stall | post-save slowdown | other (logging, teardown) | "
             "goodput of the whole wall | every other bucket over 0.05 s | slowest rank: rank 0's share of log steps, "
             "median slowest / median busy time |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(runs, start=1):
        start = r["goodput_queue_s"] + r["goodput_startup_s"] + r["goodput_restore_s"]
        lines.append(f"| {i} | {r['goodput_wall_s']:.1f} s / {r['bench_wall_s']:.1f} s | {start:.1f} s | "
                     f"{r['after_start_s']:.1f} s | **{r['productive_after']:.1%}** (claim >= {CLAIM:.0%}) | "
                     f"{r['goodput_checkpoint_stall_s']:.2f} s | {r['goodput_post_save_slowdown_s']:.2f} s | "
                     f"{r['goodput_other_s']:.2f} s | {r['goodput']:.1%} | {_rest(r)} | "
                     f"{r['slowest_rank0_share']:.0%}, {r['median_ratio']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--no-doc", action="store_true", help="print the report only")
    args = ap.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        with tempfile.TemporaryDirectory() as d:
            runs = [run_once(Path(d), args.steps, i) for i in range(args.runs)]
    finally:
        ray.shutdown()
    text = report(runs, f"python -m benchmarks.goodput_clean --runs {args.runs} --steps {args.steps}")
    print(text)
    if not args.no_doc:
        update_doc(SECTION, text)


if __name__ == "__main__":
    main()
