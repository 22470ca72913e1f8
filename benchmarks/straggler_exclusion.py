"""A 2-worker elastic job with one node slowed for the whole run (its busy time per micro-batch
`--slow` times the other's), with failure.straggler_exclude off and on, in alternating pairs on a
fresh local multi-node cluster each run (`ray.cluster_utils.Cluster`, one raylet per 1-CPU node):
time from `tidal.run` to its end and the job's tokens per second over that time, every pair reported.

    python -m benchmarks.straggler_exclusion [--pairs 4] [--slow 2] [--steps 1500] [--no-doc]

The step's work is a sleep (tests/slow_step.py on every rank, tests/straggler_model.py's extra
sleep on the slow node's), so the figures hold on a loaded machine better than a compute-bound job's.
What to expect: at a fixed global batch the remaining worker does the whole batch, so dropping a
2x straggler from 2 workers saves nothing per step (2 micro-batches of 2t against 4 of t) and costs
a restart; it pays from a larger slowdown or group (N workers, slowdown s: s against N/(N-1)).
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")  # see benchmarks/node_loss.py

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import tidal
from benchmarks.common import in_turn, update_doc
from tidal.spec.job import JobSpec
from tidal.testing.clusters import raylet_cluster

STEP_S = 0.02  # every rank's sleep per micro-batch (tests/slow_step.py)
AFTER_S = 10.0  # failure.straggler_exclude_after_s when on


def run_once(exclude: bool, slow: float, steps: int, tmp: Path) -> tuple[float, float]:
    """(seconds from tidal.run to its end, tokens per second over them)."""
    spec = JobSpec(
        name=f"straggler-{'on' if exclude else 'off'}",
        model={"builder": "tests.straggler_model:build", "vocab_size": 64, "seq_len": 16},
        train={"steps": steps, "micro_batch": 4, "global_batch": 16, "lr": 1e-2, "log_every": 10,
               "step_fn": "tests.slow_step:step"},
        scaling={"min_workers": 1, "max_workers": 2, "elastic_check_s": 10},
        checkpoint={"every_steps": 100, "storage": str(tmp / "runs")},
        failure={"straggler_exclude": exclude, "straggler_exclude_after_s": AFTER_S, "straggler_avoid_s": 86400},
        worker_env={"TIDAL_TEST_STEP_S": str(STEP_S), "TIDAL_TEST_SLOW_S": str(STEP_S * (slow - 1)),
                    "TIDAL_TEST_SLOW_RESOURCE": "slow_node"},
        tracking={"uri": f"sqlite:///{tmp}/mlflow.db", "experiment": "bench"},
    )
    with raylet_cluster() as cluster:
        cluster.add_node(num_cpus=1, resources={"slow_node": 1})
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        t0 = time.time()
        tidal.run(spec)
        wall = time.time() - t0
    return wall, steps * spec.train.global_batch * spec.model.seq_len / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=4, help="alternating pairs, each reported (at least 4)")
    ap.add_argument("--slow", type=float, default=2.0, help="the slow node's busy time over the other's")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--no-doc", action="store_true", help="print the report only")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.* for the workers' imports
    rows = []
    with tempfile.TemporaryDirectory(prefix="straggler-") as d:
        for i in range(args.pairs):
            order = in_turn(i, False, True)
            got = {on: run_once(on, args.slow, args.steps, Path(d) / f"{i}-{on}") for on in order}
            rows.append((got[False], got[True]))
            print(f"pair {i + 1}: off {got[False][0]:.1f} s {got[False][1]:,.0f} tok/s | "
                  f"on {got[True][0]:.1f} s {got[True][1]:,.0f} tok/s", flush=True)
    ratio = statistics.median(on[0] / off[0] for off, on in rows)
    lines = "\n".join(f"| {i + 1} | {off[0]:.1f} | {on[0]:.1f} | {on[0] / off[0]:.3f} | {off[1]:,.0f} | {on[1]:,.0f} |"
                      for i, (off, on) in enumerate(rows))
    body = f"""Command: `python -m benchmarks.straggler_exclusion --pairs {args.pairs} --slow {args.slow:g} --steps {args.steps}` ({time.strftime('%Y-%m-%d')}, 2-core CPU machine)

Time to finish with `failure.straggler_exclude` on over off: median **{ratio:.3f}** ({args.pairs} alternating pairs;
one of 2 nodes {args.slow:g}x slower for the whole run, taken out after {AFTER_S:g} s when on).

| pair | off (s) | on (s) | on/off | off tok/s | on tok/s |
|---|---|---|---|---|---|
{lines}
"""
    print(body)
    if not args.no_doc:
        update_doc("Straggler exclusion: a 2-worker job with one slow node", body)


if __name__ == "__main__":
    main()
