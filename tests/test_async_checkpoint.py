"""Asynchronous checkpoints are exact: a worker killed while a checkpoint is still being written in
the background resumes from the previous complete one, with an undisturbed run's losses."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import tidal
from tests.conftest import metric_history, tiny_spec
from tests.golden import reference_losses
from tests.helpers import kill, our_processes
from tidal.storage import STATE_FILE, RunDir, check_complete, checkpoint_dir_name
from tidal.testing.processes import wait_for
from tidal.worker.checkpoint.snapshot import WRITE_DELAY_ENV

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]

LONG = {"train.steps": 40, "train.global_batch": 64, "checkpoint.every_steps": 10}


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): a save that died, then a resize, runs in test_attempts
def test_worker_killed_during_a_background_write_resumes_from_the_previous_checkpoint(tmp_path, capfd):
    # the undisturbed run's losses, stored (tests/golden.py regenerates them)
    expected = reference_losses("async-checkpoint-undisturbed", tiny_spec(tmp_path, name="undisturbed", **LONG))

    # Step 20's background writes pause 3 s between a rank's data files and its manifest, as slow
    # storage would: the kill lands while checkpoint 20's files are there and its manifests are not.
    spec = tiny_spec(tmp_path, name="killed-mid-write", **LONG, worker_env={WRITE_DELAY_ENV: "3:20"})
    run = RunDir(spec.checkpoint.storage, spec.name)
    seen: dict[str, object] = {}

    def kill_during_write() -> None:
        half_written = f"{run.path}/{checkpoint_dir_name(20)}"
        wait_for("checkpoint 20's state file", (Path(half_written) / STATE_FILE).exists, 240, every=0.02)
        seen["problem"] = check_complete(run.fs, half_written)[0]
        seen["previous"] = check_complete(run.fs, f"{run.path}/{checkpoint_dir_name(10)}")[0]
        workers = our_processes("RayTrainWorker")
        if workers:
            kill(workers[-1])
            seen["killed"] = True

    killer = threading.Thread(target=kill_during_write, daemon=True)
    killer.start()
    result = tidal.run(spec)
    killer.join(timeout=5)
    out = capfd.readouterr().out

    assert seen.get("killed"), "no worker was killed"
    assert seen["problem"] is not None, "checkpoint 20 counted as complete before its write ended"
    assert seen["previous"] is None, "checkpoint 10 was complete when the worker died"
    assert f"resumed from {checkpoint_dir_name(10)} at step 10" in out
    got = metric_history(spec, result.mlflow_run_id, "loss")
    assert sorted(got) == list(range(1, 41)), "every step logged exactly once"
    for step in expected:  # stored on another machine maybe: float tolerance (tests/golden.py)
        assert got[step] == pytest.approx(expected[step], rel=1e-4), step
    # The checkpoint written again after the restart, and every later one, is complete.
    for step in (10, 20, 30, 40):
        assert check_complete(run.fs, f"{run.path}/{checkpoint_dir_name(step)}")[0] is None, step


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): synchronous saves are unit-tested (test_watchdog_phases, test_plan)
def test_synchronous_mode_still_writes_complete_checkpoints(tmp_path):
    """`checkpoint.async_upload: false`: the same write, with training waiting for it."""
    spec = tiny_spec(tmp_path, name="sync", **{"train.steps": 8, "checkpoint.every_steps": 4,
                                               "checkpoint.async_upload": False})
    result = tidal.run(spec)
    run = RunDir(spec.checkpoint.storage, spec.name)
    assert [p.rsplit("/", 1)[-1] for p in run.checkpoints()] == [checkpoint_dir_name(8), checkpoint_dir_name(4)]
    assert all(check_complete(run.fs, p)[0] is None for p in run.checkpoints())
    assert sorted(metric_history(spec, result.mlflow_run_id, "loss")) == list(range(1, 9))
