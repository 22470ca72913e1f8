"""A worker frozen mid-run: the watchdog turns the hang into a restart.

A worker killed mid-run resuming exactly (losses equal to an undisturbed run's) is
tests/test_eval.py's first test (with evaluation on), and, mid-write, tests/test_async_checkpoint.py."""

from __future__ import annotations

import contextlib
import signal
import threading

import psutil
import pytest

import tidal
from tests.conftest import metric_history, tiny_spec
from tests.helpers import kill, our_processes, wait_for_step

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]

LONG = {"train.steps": 60, "train.global_batch": 64, "checkpoint.every_steps": 10}


def test_stuck_worker_is_restarted_by_the_watchdog(tmp_path):
    """A worker frozen mid-run (SIGSTOP) leaves its peer waiting in a collective: the watchdog ends
    that wait, Ray restarts the group from the last checkpoint, and the job finishes."""
    spec = tiny_spec(tmp_path, name="frozen", **LONG, **{"failure.step_timeout_s": 5})
    frozen: list = []

    def freeze_a_worker() -> None:
        wait_for_step(spec, 25)
        victim = our_processes("RayTrainWorker")[-1]
        frozen.append(victim)
        kill(victim, signal.SIGSTOP)

    threading.Thread(target=freeze_a_worker, daemon=True).start()
    try:
        result = tidal.run(spec)
    finally:
        for p in frozen:  # whatever Ray did not clean up: wake and end the process we froze
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGCONT)
                p.kill()
    assert frozen, "no worker was frozen"
    assert sorted(metric_history(spec, result.mlflow_run_id, "loss")) == list(range(1, 61))
    assert metric_history(spec, result.mlflow_run_id, "restarts")[60] >= 1
