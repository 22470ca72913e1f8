"""A worker killed mid-run: the job finishes and its losses match an undisturbed run's."""

from __future__ import annotations

import threading

import pytest
import tidal

from tests.conftest import metric_history, tiny_spec
from tests.helpers import kill, our_processes, wait_for_step

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]

LONG = {"train.steps": 60, "train.global_batch": 64, "checkpoint.every_steps": 10}


def test_killed_worker_resumes_exactly(tmp_path):
    reference = tiny_spec(tmp_path, name="undisturbed", **LONG)
    expected = metric_history(reference, tidal.run(reference).mlflow_run_id, "loss")

    spec = tiny_spec(tmp_path, name="killed", **LONG)
    killed: list[int] = []

    def kill_rank_worker() -> None:
        wait_for_step(spec, 25)  # past the checkpoint at step 20
        workers = our_processes("RayTrainWorker")
        assert workers, "no Ray Train worker process found"
        victim = workers[-1]
        killed.append(victim.pid)
        kill(victim)

    killer = threading.Thread(target=kill_rank_worker, daemon=True)
    killer.start()
    result = tidal.run(spec)
    killer.join(timeout=5)

    assert killed, "the worker was never killed"
    got = metric_history(spec, result.mlflow_run_id, "loss")
    assert sorted(got) == list(range(1, 61)), "every step logged exactly once"
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-6), step
    restarts = metric_history(spec, result.mlflow_run_id, "restarts")
    assert max(restarts.values()) >= 1 and restarts[60] >= 1
