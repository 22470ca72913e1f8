"""Warm spares on real Ray: after a worker is killed, the restarted group's workers run in processes
that were started, and had imported torch and TorchDynamo, before the kill (tidal/worker/spares.py);
with failure.warm_spares: 0, in processes started after it. Each worker says how it started from
inside itself (TIDAL_SPARES_TRACE)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import ray

import tidal
from tests.slow_step import slow_env
from tidal.testing.chaos import chaos_spec
from tidal.testing.processes import kill, our_processes, wait_for
from tidal.testing.runs import metric_history, wait_for_step
from tidal.testing.spares import warm_spares as ready_spares
from tidal.worker.spares import TRACE_ENV, wanted

pytestmark = pytest.mark.slow
STEPS = 200  # slow (0.4 s a step) until the kill, then at full speed


@pytest.fixture(scope="module")
def tidal_local_ray():
    """A local instance started as `tidal run` starts one (its setup hook included), not the suite's shared one."""
    from tidal.launch.connect import local_ray_options

    ray.init(address="local", num_cpus=2, logging_level="WARNING", **local_ray_options(False, {}))
    yield
    ray.shutdown()


def _run_killed_once(tmp: Path, warm_spares: int) -> tuple[float, list[dict]]:
    """The job, one worker SIGKILLed once the job has trained 10 steps and (with spares) its node's
    spares are warm; its steps slowed until then (tests/slow_step.py), so that the kill lands
    before the end on any machine. The kill time and each worker's start, as it told them."""
    slow = tmp / f"slow{warm_spares}"
    slow.touch()
    spec = chaos_spec(tmp, f"spares{warm_spares}", STEPS, 5).with_overrides({
        "failure.warm_spares": warm_spares, "train.step_fn": "tests.slow_step:step",
        "worker_env": {TRACE_ENV: str(tmp / f"trace{warm_spares}"), **slow_env(0.05, slow)}})
    killed: list[float] = []
    errors: list[BaseException] = []

    def inject() -> None:
        try:
            wait_for_step(spec, 10, timeout=300)
            if warm_spares != 0:
                job = ray.get_runtime_context().get_job_id()
                wait_for("warm spares with torch imported", lambda: ready_spares(job, warm_spares), 300, every=0.1)
            workers = wait_for("training workers", lambda: our_processes("RayTrainWorker"), 60)
            killed.append(time.time())
            kill(workers[-1])
        except BaseException as e:  # noqa: BLE001 - said by the test, not lost in a thread
            errors.append(e)
        finally:
            slow.unlink()

    injector = threading.Thread(target=inject, daemon=True)
    injector.start()
    result = tidal.run(spec)
    injector.join(timeout=10)
    assert not errors and killed, f"the kill did not land: {errors}"
    assert sorted(metric_history(spec, result.mlflow_run_id, "loss")) == list(range(1, STEPS + 1)), \
        "every step logged once"
    lines = Path(spec.worker_env[TRACE_ENV]).read_text().splitlines()
    return killed[0], [r for r in map(json.loads, lines) if "pid" in r]


def test_without_spares_the_group_restarts_in_new_processes(tmp_path, tidal_local_ray):
    """failure.warm_spares: 0: what the spares replace, so the test below cannot pass by accident. First:
    spares outlive a fit in the same driver, and this one must find none."""
    kill_time, starts = _run_killed_once(tmp_path, 0)
    after = [s for s in starts if s["train_started"] > kill_time]
    assert len(after) == 2, f"the restarted group's two workers: {starts}"
    assert all(not s["warm"] and s["process_started"] > kill_time for s in after), after


def test_a_killed_workers_group_restarts_in_warm_spares(tmp_path, tidal_local_ray):
    # The count is set: by default a node whose CPUs the workers take keeps none (spares.wanted).
    kill_time, starts = _run_killed_once(tmp_path, wanted(2, None, idle_cpus=1))
    after = [s for s in starts if s["train_started"] > kill_time]
    assert len(after) == 2, f"the restarted group's two workers: {starts}"
    for s in after:
        assert s["process_started"] < kill_time, f"pid {s['pid']} was started after the kill, not a spare: {s}"
        assert s["preloaded_at"] is not None and s["preloaded_at"] < kill_time, f"imported torch after the kill: {s}"
        assert s["torch_before"], f"torch and TorchDynamo not imported when its train function began: {s}"
