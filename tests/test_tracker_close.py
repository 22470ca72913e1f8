"""A tracker actor that can never start (its constructor ends its process: pyarrow aborting in C++ on
a store it cannot reach did so) is restarted by Ray without end; the driver's close must not wait on
it for good. It gives up on the actor and ends the MLflow run itself, from the job's event log."""

from __future__ import annotations

import threading
import time

import pytest

from tests.conftest import tiny_spec
from tidal.launch.console_pump import ConsolePump
from tidal.launch.trainer import _close_tracker
from tidal.lease import Lease

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]


def test_a_tracker_that_never_starts_does_not_hold_the_drivers_end(tmp_path, monkeypatch):
    import mlflow
    import ray

    from tidal.tracking import actor as tracking_actor

    # defined here: Ray pickles a test module's classes by reference, and workers cannot import it
    class NeverStarts(tracking_actor.TrackerActor):
        def __init__(self, *args, **kwargs) -> None:
            import os

            os._exit(1)

    monkeypatch.setattr(tracking_actor, "PING_TIMEOUT_S", 5.0)  # this one never answers: the wait is all the test pays
    spec = tiny_spec(tmp_path, name="tracker-never-starts", **{"tracking.flush_timeout_s": 1})
    lease = Lease(spec.checkpoint.storage, spec.name)
    lease.acquire()
    tracker = ray.remote(max_restarts=-1, max_task_retries=-1)(NeverStarts).remote()
    pump = ConsolePump(tracker).start()
    out: dict = {}
    closing = threading.Thread(target=lambda: out.setdefault(
        "closed", _close_tracker(spec, tracker, True, time.time(), pump, lease)), daemon=True)
    closing.start()
    closing.join(timeout=240)  # a bound on a wait that had none, not a speed claim
    lease.release()
    assert not closing.is_alive(), "the driver's end waited for good on a tracker Ray restarts without end"
    (run_id, _, left), _ = out["closed"]
    assert run_id and left == 0
    mlflow.set_tracking_uri(spec.tracking.uri)
    assert mlflow.get_run(run_id).info.status == "FINISHED", "the driver ended the run the tracker could not"
