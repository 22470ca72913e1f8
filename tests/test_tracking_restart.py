"""Losing the tracker costs nothing: SIGKILL of the tracker actor's process (found through Ray's
state API) in the middle of a real run; Ray restarts it, it recovers from the job's event log,
training never notices, and MLflow holds every step once with the very losses rank 0 computed
(its loss trace, written by the worker beside the tracker's path)."""

from __future__ import annotations

import os
import signal
import threading

import pytest

import tidal
from tests.conftest import free_port, metric_history, tiny_spec
from tests.helpers import wait_for_step
from tidal.testing.chaos import traced
from tidal.testing.processes import wait_for
from tidal.worker.metrics import LOSS_TRACE_ENV

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_with_state_api():
    """A local Ray instance with its dashboard: the state API (`ray.util.state`) is served there."""
    import ray

    ctx = ray.init(address="local", num_cpus=2, include_dashboard=True, dashboard_port=free_port(),
                   logging_level="WARNING")
    yield f"http://{ctx.dashboard_url}"  # named: another Ray instance on this machine must not be asked
    ray.shutdown()


def tracker_pid(state_api: str, other_than: int | None = None, timeout: float = 120) -> int:
    """The process id of the job's live TrackerActor (a new one after a kill)."""
    from ray.util.state import list_actors

    def live() -> int | None:
        actors = list_actors(address=state_api, filters=[("class_name", "=", "TrackerActor"), ("state", "=", "ALIVE")])
        return next((a.pid for a in actors if a.pid and a.pid != other_than), None)

    return wait_for("a live TrackerActor" + (f" other than pid {other_than}" if other_than else ""), live, timeout)


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): recovery from the event log is unit-tested (test_tracking_ledger)
def test_killing_the_tracker_mid_run_loses_and_duplicates_nothing(tmp_path, ray_with_state_api):
    spec = tiny_spec(tmp_path, name="tracker-killed", **{"train.steps": 300, "checkpoint.every_steps": 100},
                     worker_env={LOSS_TRACE_ENV: str(tmp_path / "losses.trace")})
    out: dict = {}
    job = threading.Thread(target=lambda: out.setdefault("result", tidal.run(spec)), daemon=True)
    job.start()
    wait_for_step(spec, 30)
    first = tracker_pid(ray_with_state_api)
    os.kill(first, signal.SIGKILL)
    second = tracker_pid(ray_with_state_api, other_than=first)  # Ray brought it back
    reached = wait_for_step(spec, 120)  # ...and it sends again, from where the dead one stopped
    assert reached < 300, "the second kill should land mid-run too"
    os.kill(second, signal.SIGKILL)
    job.join(timeout=600)
    assert "result" in out, "tidal.run did not return"
    killed = out["result"]
    assert killed.error is None

    loss = metric_history(spec, killed.mlflow_run_id, "loss")  # fails on a step logged twice
    assert sorted(loss) == list(range(1, 301)), "every step present"
    computed = traced(spec)  # what rank 0 computed, each step once (training never restarted)
    assert [s for s, _ in computed] == list(range(1, 301))
    assert loss == dict(computed), "MLflow holds exactly the losses training computed"
    assert killed.final_loss == loss[300]
    assert sorted(metric_history(spec, killed.mlflow_run_id, "checkpoint_bytes")) == [100, 200, 300]
    assert metric_history(spec, killed.mlflow_run_id, "restarts")[300] == 0, "training itself never restarted"
