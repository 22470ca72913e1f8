"""A memory snapshot is a resume point only once every step up to it is in the job's event log: rank 0
writes its events in the background, and a snapshot that became complete while they still waited in
rank 0's process lost them with it (nothing trains those steps again, so MLflow never had them).
Persistent checkpoints always waited for the log (worker/loop.py `_save`); snapshots did not."""

from __future__ import annotations

import threading

import psutil
import pytest

import tidal
from tests.memory_jobs import assert_undisturbed_losses, memory_spec, resumes
from tidal import test_hooks
from tidal.testing.processes import kill
from tidal.testing.runs import StepHolds

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]


def test_rank_0_killed_while_its_event_log_lags_loses_no_step(tmp_path, capfd):
    holds = StepHolds(13)
    # each event of steps 1-13 waits 0.5 s before its write: at step 13 the log is several steps behind
    spec = holds.spec(memory_spec(tmp_path, "mem-events", **{test_hooks.EVENT_WRITE_DELAY: "0.5:13"}))

    def kill_rank_0() -> None:
        holds.wait(13)
        kill(psutil.Process(holds.pid(13)))
        holds.release(13)

    killer = threading.Thread(target=kill_rank_0, daemon=True)
    killer.start()
    result = tidal.run(spec)
    killer.join(timeout=5)
    out = capfd.readouterr().out

    assert result.error is None, result.error
    assert len(resumes(out)) == 1, out[-3000:]
    assert_undisturbed_losses(tmp_path, spec, result)  # every step logged exactly once, the undisturbed losses
