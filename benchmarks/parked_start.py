"""What parking costs a waiting job when its turn comes, against a driver that waited.

    python -m benchmarks.parked_start [--pairs 4]     # writes a section of docs/benchmarks.md

A Ray head on this machine with the cluster's admission and one worker slot. A job holds the slot
(a few hundred steps); a second job, submitted through the Jobs API right after, waits. Each round
runs both kinds, in alternating order, each on a fresh head:
- driver: `TIDAL_PARK_AFTER_S=-1` (never park): the waiting job's driver stays on the head;
- parked: `TIDAL_PARK_AFTER_S=1`: its driver parks and ends; once admitted, the admission actor
  submits its driver again (admission/parking.py).
The figure: seconds from the first job's end (its Ray job's end time) to the waiting job's first
step (its rank 0's loss trace). What the difference buys: docs/benchmarks.md, "Head memory per
queued job".
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

import yaml

from benchmarks.common import ROOT, median, paired_rounds, pairs_main, read_trace
from tidal.admission.queue_doc import load_queue
from tidal.launch.jobs import connect, submit
from tidal.spec.job import JobSpec
from tidal.testing.heads import ray_head
from tidal.testing.processes import wait_for
from tidal.testing.runs import prepared_store

SECTION = "A parked job's start against a waiting driver's"
BLOCKER_STEPS = 400


def job_spec(tmp: Path, name: str, steps: int) -> JobSpec:
    return JobSpec(
        name=name,
        model={"n_layer": 2, "n_head": 2, "d_model": 64, "vocab_size": 64, "seq_len": 16},
        train={"steps": steps, "micro_batch": 4, "global_batch": 8, "lr": 1e-2, "log_every": 1},
        scaling={"min_workers": 1, "max_workers": 1, "cpus_per_worker": 1},
        checkpoint={"every_steps": 100, "keep": 2, "storage": str(tmp / "runs")},
        tracking={"uri": prepared_store(tmp / f"{name}.db"), "experiment": "bench"},
        worker_env={"TIDAL_LOSS_TRACE": str(tmp / f"{name}.trace")},
    )


def one(tmp: Path, park: bool) -> float:
    """Seconds from the blocker's end to the waiting job's first step."""
    quotas, queue = tmp / "quotas.yaml", str(tmp / "queue.json")
    quotas.write_text(yaml.safe_dump({"unit": "workers", "capacity": 1}))
    env = {"TIDAL_QUOTAS": str(quotas), "TIDAL_QUEUE": queue, "TIDAL_PARK_AFTER_S": "1" if park else "-1"}
    (tmp / "head").mkdir()
    with ray_head(tmp / "head", 2, env) as head:
        blocker = submit(job_spec(tmp, "blocker", BLOCKER_STEPS), head.address, working_dir=str(ROOT),
                         submission_id=f"blocker-{secrets.token_hex(3)}")
        wait_for("the blocker's first step", lambda: read_trace(tmp / "blocker.trace"), timeout=300)
        waiting = submit(job_spec(tmp, "waiting", 20), head.address, working_dir=str(ROOT),
                         submission_id=f"waiting-{secrets.token_hex(3)}")
        if park:
            wait_for("the waiting job parked", lambda: (e := load_queue(queue).get(waiting.submission_id))
                     and e.successor, timeout=120)
        if blocker.wait(timeout=600) != "SUCCEEDED":
            raise RuntimeError(f"the blocker failed:\n{blocker.logs()[-3000:]}")
        if park and not (tmp / "waiting.trace").exists() and not load_queue(queue).get(waiting.submission_id):
            raise RuntimeError("the waiting job left the queue without starting")
        ended = connect(head.address).get_job_info(blocker.submission_id).end_time / 1000
        first = wait_for("the waiting job's first step", lambda: read_trace(tmp / "waiting.trace"), timeout=300)
        if waiting.wait(timeout=300) != "SUCCEEDED":
            raise RuntimeError(f"the waiting job failed:\n{waiting.logs()[-3000:]}")
        return first[0]["ts"] - ended


def run(pairs: int, tmp: Path) -> list[dict[str, float]]:
    def measure(i: int, kind: str) -> float:
        folder = tmp / f"{i}-{kind}"
        folder.mkdir()
        return one(folder, park=kind == "parked")

    return paired_rounds(pairs, ("driver", "parked"), measure, lambda r: {"extra": r["parked"] - r["driver"]},
                         lambda i, r: f"round {i + 1}: waiting driver {r['driver']:.1f} s, parked {r['parked']:.1f} s "
                         f"({r['extra']:+.1f} s)")


def report(rounds: list[dict[str, float]], pairs: int) -> str:
    rows = "\n".join(f"| {i + 1} | {r['driver']:.1f} s | {r['parked']:.1f} s | {r['extra']:+.1f} s | "
                     f"{r['parked'] / r['driver']:.2f} |" for i, r in enumerate(rounds))
    return f"""Command: `python -m benchmarks.parked_start --pairs {pairs}` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, CPU only)

Work: a head with the cluster's admission and one worker slot; a blocker (1 worker, GPT d64 L2, {BLOCKER_STEPS} steps)
holds it while a second job (20 steps) waits. Seconds from the blocker's end to the waiting job's first step, with
its driver waiting on the head (`TIDAL_PARK_AFTER_S=-1`) and parked (`TIDAL_PARK_AFTER_S=1`: its driver ended,
and the admission actor submits a new one once the job is admitted). Each kind on a fresh head, the order
alternating by round.

| round | waiting driver | parked | parked - driver | parked / driver |
|---|---|---|---|---|
{rows}

Medians: waiting driver **{median([r['driver'] for r in rounds]):.1f} s**, parked **{median([r['parked'] for r in rounds]):.1f} s**,
the difference **{median([r['extra'] for r in rounds]):+.1f} s**.
"""


def main() -> None:
    pairs_main(__doc__, SECTION, "tidal-parked-", run, report)


if __name__ == "__main__":
    main()
