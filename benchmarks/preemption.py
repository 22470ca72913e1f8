"""An urgent job on a full cluster: how soon it trains, and what the job it preempts loses.

    python -m benchmarks.preemption [--pairs 4]     # writes a section of docs/benchmarks.md

A Ray head with 4 one-CPU worker slots, token auth and a quota file (the cluster's admission,
tidal/admission/actor.py). Each pair runs, in alternating order:
- idle: a high-priority 2-worker job submitted to the empty cluster (the baseline);
- full: a low-priority elastic job (1-4 workers) fills the cluster, then the same high-priority
  job is submitted: admission shrinks the low job to 2 at its next log step (a checkpoint), and
  grows it back to 4 when the high job ends.
Reported: seconds from the high job's `tidal run` to its first step, in both (the ratio full/idle
is the cost of making room), and the low job's lost time per resize: the gap between its last
step before the resize and its first step after, less one step (what it would have spent
training). Steps trained twice are counted from the loss trace (the promise: none).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import Job, median, paired_rounds, pairs_main, write_spec
from tidal.spec.job import JobSpec
from tidal.testing.heads import ray_head
from tidal.testing.processes import wait_for

SECTION = "Preemption by shrinking: an urgent job on a full cluster"
QUOTAS = {"unit": "workers", "min_resize_interval_s": 5, "priorities": ["low", "normal", "high"]}


def job_spec(tmp: Path, name: str, lo: int, hi: int, steps: int, priority: str) -> JobSpec:
    folder = tmp / name
    folder.mkdir(parents=True, exist_ok=True)
    return JobSpec(
        name=name,
        model={"n_layer": 2, "n_head": 2, "d_model": 64, "vocab_size": 64, "seq_len": 16},
        train={"steps": steps, "micro_batch": 2, "global_batch": 24, "lr": 1e-2, "log_every": 1},
        scaling={"min_workers": lo, "max_workers": hi, "cpus_per_worker": 1},
        scheduling={"priority": priority},
        checkpoint={"every_steps": 25, "keep": 2, "storage": str(folder / "runs")},
        tracking={"uri": f"sqlite:///{folder}/mlflow.db", "experiment": "bench"},
        worker_env={"TIDAL_LOSS_TRACE": str(folder / "loss.trace")},
    )


def launch(spec: JobSpec, tmp: Path, gcs: str) -> tuple[Job, float]:
    folder = tmp / spec.name
    job = Job(write_spec(spec, folder / "job.yaml"), gcs, folder / "loss.trace", folder / "driver.log")
    t = time.time()
    job.start()
    return job, t


def first_step_after(job: Job, t: float, timeout_s: float = 300) -> float:
    return wait_for(f"the job's first step (see {job.log})", job.records, timeout_s)[0]["ts"] - t


def wait_done(job: Job, timeout_s: float = 900) -> None:
    assert job.proc is not None
    if job.proc.wait(timeout=timeout_s):
        raise RuntimeError(f"job failed; see {job.log}: {job.log.read_text()[-3000:]}")


def resize_gaps(records: list[dict[str, Any]]) -> tuple[list[float], int]:
    """(seconds lost at each change of world size, steps trained more than once)."""
    by_step = sorted({r["step"]: r for r in records}.values(), key=lambda r: r["step"])
    steps = [b["ts"] - a["ts"] for a, b in zip(by_step, by_step[1:], strict=False) if a["world"] == b["world"]]
    step_s = median(steps) if steps else 0.0
    gaps = [b["ts"] - a["ts"] - step_s for a, b in zip(by_step, by_step[1:], strict=False) if a["world"] != b["world"]]
    return gaps, len(records) - len({r["step"] for r in records})


def idle_round(tmp: Path, gcs: str, i: int) -> float:
    high, t = launch(job_spec(tmp, f"idle-high-{i}", 2, 2, 20, "high"), tmp, gcs)
    first = first_step_after(high, t)
    wait_done(high)
    return first


def full_round(tmp: Path, gcs: str, i: int) -> dict[str, Any]:
    low, _ = launch(job_spec(tmp, f"low-{i}", 1, 4, 400, "low"), tmp, gcs)
    wait_for(f"the low job training at 4 workers (see {low.log})",
             lambda: any(r["world"] == 4 for r in low.records()[-1:]) and len(low.records()) >= 30, 300, every=0.5)
    high, t = launch(job_spec(tmp, f"full-high-{i}", 2, 2, 20, "high"), tmp, gcs)
    first = first_step_after(high, t)
    wait_done(high)
    wait_done(low)
    gaps, twice = resize_gaps(low.records())
    worlds = [r["world"] for r in low.records()]
    changes = [w for j, w in enumerate(worlds) if j == 0 or worlds[j - 1] != w]
    return {"first": first, "gaps": gaps, "twice": twice, "worlds": changes}


def run(pairs: int, tmp: Path) -> list[dict[str, Any]]:
    (tmp / "quotas.yaml").write_text(yaml.safe_dump(QUOTAS))
    env = {"TIDAL_QUOTAS": str(tmp / "quotas.yaml"), "TIDAL_QUEUE": str(tmp / "queue.json")}
    os.environ.update(env)  # the drivers (`tidal run` on this machine) read the cluster's quota file
    with ray_head(tmp, 4, env) as head:
        return paired_rounds(
            pairs, ("idle", "full"),
            lambda i, kind: idle_round(tmp, head.gcs, i) if kind == "idle" else full_round(tmp, head.gcs, i),
            lambda r: {"ratio": r["first"] / r["idle"]},
            lambda i, r: f"pair {i + 1}: first step idle {r['idle']:.1f} s, full {r['first']:.1f} s (ratio "
            f"{r['ratio']:.2f}); low job's worlds {r['worlds']}, lost per resize "
            f"{', '.join(f'{g:.1f}' for g in r['gaps'])} s, steps trained twice {r['twice']}")


def report(rounds: list[dict[str, Any]], pairs: int) -> str:
    rows = "\n".join(
        f"| {i + 1} | {r['idle']:.1f} s | {r['first']:.1f} s | {r['ratio']:.2f} | {' → '.join(map(str, r['worlds']))} | "
        f"{', '.join(f'{g:.1f}' for g in r['gaps'])} s | {r['twice']} |" for i, r in enumerate(rounds))
    gaps = [g for r in rounds for g in r["gaps"]]
    return f"""Command: `python -m benchmarks.preemption --pairs {pairs}` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, CPU only)

Work: a Ray head with 4 one-CPU worker slots, token auth and a quota file; GPT d64 L2, ZeRO-2, global batch
24, a log step every step. High job: 2 workers, priority high, 20 steps. Low job: 1-4 workers, priority low,
400 steps, filling the cluster before the high job is submitted. Each pair runs the idle and the full case in
alternating order; "first step" is from the high job's `tidal run` to its first step.

| pair | first step, idle cluster | first step, full cluster | full / idle | low job's world sizes | low job's lost time per resize | steps trained twice |
|---|---|---|---|---|---|---|
{rows}

Medians: first step on a full cluster **{median([r['first'] for r in rounds]):.1f} s** (goal: under 30 s) against
{median([r['idle'] for r in rounds]):.1f} s idle, ratio **{median([r['ratio'] for r in rounds]):.2f}**; the low job lost
**{median(gaps):.1f} s** per resize (median of {len(gaps)}), and trained no step twice where the last column says 0.
"""


def main() -> None:
    pairs_main(__doc__, SECTION, "tidal-preempt-", run, report)


if __name__ == "__main__":
    main()
