"""Test helpers that touch real processes: find Ray workers we started, wait on MLflow progress,
register checkpoints with Ray Train's own checkpoint manager."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from tidal.spec.job import JobSpec
from tidal.storage import RunDir, checkpoint_dir_name
from tidal.testing.processes import kill as kill
from tidal.testing.processes import our_processes as our_processes
from tidal.testing.runs import job_run_id as job_run_id
from tidal.testing.runs import wait_for_step as wait_for_step


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
