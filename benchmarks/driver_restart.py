"""What a killed driver costs against what a killed worker costs, on one elastic job.

    python -m benchmarks.driver_restart [--pairs 4]     # writes a section of docs/benchmarks.md

A Ray cluster of a head and two 1-CPU worker nodes (`ray.cluster_utils.Cluster`, in a Ray temp
folder of its own so that no other Ray instance on the machine is joined), one elastic job (1-2
workers) run by a `tidal run` process. Each round kills a training worker (Ray Train restarts
the worker group) and the driver (SIGKILL of `tidal run`, then the same command again, as a
user or Ray Jobs would), in alternating order; each recovery is the seconds from the kill to the
first step of the next life, read from the loss trace rank 0 writes (TIDAL_LOSS_TRACE). The
baseline is the worker kill: a driver kill costs a new controller and tracker too, and before
Tidal released a killed launch's reservation (tidal/launch/trainer.py `release_reservation`) it
also waited out Ray's 180 s reservation expiry.
"""

from __future__ import annotations

import os
import tempfile

# Before Ray is imported: this cluster's address file goes in a folder of its own.
os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="tidal-drv-"))
os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")  # this process never becomes a Ray driver

import time
from pathlib import Path

from benchmarks.common import Job, median, paired_rounds, pairs_main, write_spec
from tidal.spec.job import JobSpec
from tidal.testing.clusters import raylet_cluster
from tidal.testing.processes import kill, our_processes

SECTION = "Recovery: a killed driver against a killed worker"


def job_spec(tmp: Path) -> JobSpec:
    return JobSpec(
        name="driver-restart",
        model={"n_layer": 2, "n_head": 2, "d_model": 64, "vocab_size": 64, "seq_len": 16},
        train={"steps": 100_000, "micro_batch": 4, "global_batch": 16, "lr": 1e-2, "log_every": 1},
        scaling={"min_workers": 1, "max_workers": 2, "elastic_check_s": 10},
        checkpoint={"every_steps": 20, "keep": 2, "storage": str(tmp / "runs")},
        tracking={"uri": f"sqlite:///{tmp}/mlflow.db", "experiment": "bench"},
        worker_env={"TIDAL_LOSS_TRACE": str(tmp / "loss.trace")},
    )


def kill_worker(job: Job) -> float:
    workers = our_processes("RayTrainWorker")
    if not workers:
        raise RuntimeError("no training worker to kill")
    seen, t = job.steps_done(), time.time()
    kill(workers[0])
    return job.new_life_after(seen) - t


def kill_driver(job: Job) -> float:
    seen, t = job.steps_done(), time.time()
    job.restart()
    return job.new_life_after(seen) - t


def run(pairs: int, tmp: Path) -> list[dict[str, float]]:
    with raylet_cluster(workers=2, connect=False) as cluster:
        spec = job_spec(tmp)
        job = Job(write_spec(spec, tmp / "job.yaml"), cluster.address, tmp / "loss.trace", tmp / "driver.log")
        job.start()
        def measure(i: int, kind: str) -> float:
            job.wait_steps(job.steps_done() + 40)  # past a checkpoint, at full speed again
            return kill_worker(job) if kind == "worker" else kill_driver(job)

        try:
            return paired_rounds(pairs, ("worker", "driver"), measure, lambda r: {"ratio": r["driver"] / r["worker"]},
                                 lambda i, r: f"round {i + 1}: worker killed -> first step {r['worker']:.1f} s, driver "
                                 f"killed -> first step {r['driver']:.1f} s: ratio {r['ratio']:.2f}")
        finally:
            job.stop()


def report(rounds: list[dict[str, float]], pairs: int) -> str:
    rows = "\n".join(f"| {i + 1} | {r['worker']:.1f} s | {r['driver']:.1f} s | {r['ratio']:.2f} |"
                     for i, r in enumerate(rounds))
    return f"""Command: `python -m benchmarks.driver_restart --pairs {pairs}` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, CPU only)

Work: one elastic job (1-2 workers, GPT d64 L2, ZeRO-2, a checkpoint every 20 steps, local storage) on a Ray
cluster of a head and two 1-CPU worker nodes; each round kills a training worker and the `tidal run` process
(then runs it again), in alternating order; seconds from the kill to the first step of the next life.

| round | worker killed | driver killed, run again | driver / worker |
|---|---|---|---|
{rows}

Medians: worker **{median([r['worker'] for r in rounds]):.1f} s**, driver **{median([r['driver'] for r in rounds]):.1f} s**,
ratio **{median([r['ratio'] for r in rounds]):.2f}**.
"""


def main() -> None:
    pairs_main(__doc__, SECTION, "tidal-drv-run-", run, report)


if __name__ == "__main__":
    main()
