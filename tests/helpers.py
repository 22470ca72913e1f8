"""Test helpers that touch real processes: find Ray workers we started, wait on MLflow progress,
register checkpoints with Ray Train's own checkpoint manager."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil
from mlflow.tracking import MlflowClient

from tidal.spec.job import JobSpec
from tidal.storage import RunDir, checkpoint_dir_name


def our_processes(fragment: str, root: int | None = None) -> list[psutil.Process]:
    """Descendants of `root` (default: this test process) whose command line contains `fragment`."""
    procs = psutil.Process(root or os.getpid()).children(recursive=True)
    out = []
    for p in procs:
        try:
            if fragment in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            continue
    return out


def job_run_id(spec: JobSpec, timeout: float = 120) -> str:
    """The MLflow run id a running job recorded in its run folder (local or object storage)."""
    run = RunDir(spec.checkpoint.storage, spec.name)
    deadline = time.time() + timeout
    while time.time() < deadline:
        job = run.read_json("tidal-job.json")
        if job and job.get("mlflow_run_id"):
            return job["mlflow_run_id"]
        time.sleep(0.1)
    raise TimeoutError(f"{run.path}/tidal-job.json never appeared")


def wait_for_step(spec: JobSpec, step: int, timeout: float = 180) -> int:
    """Block until MLflow shows `step` logged for the job; returns the highest step seen."""
    run_id = job_run_id(spec, timeout)
    client = MlflowClient(spec.tracking.uri)
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            seen = max((m.step for m in client.get_metric_history(run_id, "loss")), default=0)
        except Exception:  # noqa: BLE001 - the store may be mid-creation
            seen = 0
        if seen >= step:
            return seen
        time.sleep(0.05)
    raise TimeoutError(f"job {spec.name} never reached step {step}")


def kill(proc: psutil.Process, sig: int = signal.SIGKILL) -> None:
    proc.send_signal(sig)


def run_killing_a_worker(spec: JobSpec, after_step: int) -> tuple[Any, bool]:
    """`tidal.run(spec)` while a thread SIGKILLs one Ray Train worker once MLflow shows `after_step`;
    returns (the run's result, whether a worker was killed)."""
    import tidal

    killed: list[int] = []

    def kill_one() -> None:
        wait_for_step(spec, after_step)
        workers = our_processes("RayTrainWorker")
        if workers:
            killed.append(workers[-1].pid)
            kill(workers[-1])

    killer = threading.Thread(target=kill_one, daemon=True)
    killer.start()
    result = tidal.run(spec)
    killer.join(timeout=5)
    return result, bool(killed)


def ray_registers(run: RunDir, keep: int) -> Callable[[int], None]:
    """Ray Train's own checkpoint manager over the run folder, as its controller runs it (no Ray
    instance needed): registering a step writes Ray's snapshot and deletes what num_to_keep drops,
    and fails, as in the controller, if a checkpoint it registered has vanished."""
    from ray.train import Checkpoint, CheckpointConfig
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
    from ray.train.v2._internal.execution.storage import StorageContext
    from ray.train.v2._internal.execution.training_report import _TrainingReport

    root, name = run.path.rsplit("/", 1)
    manager = CheckpointManager(CheckpointConfig(num_to_keep=keep), StorageContext(root, name, run.fs))

    def register(step: int) -> None:
        async def in_controller() -> None:  # it notifies its listeners on the controller's event loop
            checkpoint = Checkpoint(f"{run.path}/{checkpoint_dir_name(step)}", filesystem=run.fs)
            manager.register_checkpoint(_TrainingReport(checkpoint, {"step": step}, validation=False))

        asyncio.run(in_controller())

    return register
