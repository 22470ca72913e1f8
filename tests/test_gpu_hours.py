"""GPU-hours that follow a run's real shape: world size integrated over time, by site, with cost."""

from __future__ import annotations

import threading
import time

import psutil
import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import metric_history, tiny_spec
from tests.helpers import our_processes, wait_for_step
from tests.test_elastic import (
    add_worker_node,
    cluster,
    finished,
    run_in_background,
    wait_for_world_size,
)
from tidal.tracking.usage import Point, charged_seconds, scaling, usage

__all__ = ["cluster"]  # the multi-node fixture of test_elastic, shared


class LiveWorkers:
    """Integrates the number of live Ray Train worker processes over time, by sampling."""

    def __init__(self, every_s: float = 0.1) -> None:
        self.every_s, self.worker_s = every_s, 0.0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        last = time.monotonic()
        while not self.stopped.wait(self.every_s):
            n = 0
            for p in our_processes("RayTrainWorker"):
                try:
                    n += p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                except psutil.Error:
                    continue
            now = time.monotonic()
            self.worker_s += n * (now - last)
            last = now

    def stop(self) -> float:
        self.stopped.set()
        self.thread.join()
        return self.worker_s / 3600


def test_an_elastic_series_pays_for_each_interval_at_its_world_size():
    # 2 workers for 100 s (up 10 s before their first point), 1 worker for 50 s after a
    # 20 s gap with no group, then 2 again for 30 s.
    pts = [Point(1000, 2, uptime=10), Point(1100, 2, uptime=110),
           Point(1135, 1, uptime=15), Point(1170, 1, uptime=50),
           Point(1180, 2, uptime=5), Point(1210, 2, uptime=35)]
    assert charged_seconds(pts) == [10, 100, 15, 35, 5, 30]
    u = usage(pts, devices_per_worker=0)  # a CPU job counts worker-hours
    assert u["gpu_hours"] == pytest.approx((2 * 110 + 1 * 50 + 2 * 35) / 3600)
    assert u["gpu_hours_cloud"] == 0 and "cost" not in u
    assert usage(pts, devices_per_worker=8)["gpu_hours"] == pytest.approx(8 * u["gpu_hours"])


def test_time_between_launches_is_not_charged_and_cloud_and_cost_follow_placement():
    day = 86400
    pts = [Point(0, 2, cloud=0, cost_per_hour=6.0, uptime=60), Point(60, 2, cloud=0, cost_per_hour=6.0, uptime=120),
           Point(day, 2, cloud=1, cost_per_hour=10.0, uptime=30)]  # relaunched a day later, one worker on cloud
    u = usage(pts, devices_per_worker=1)
    assert u["gpu_hours"] == pytest.approx((2 * 60 + 2 * 60 + 2 * 30) / 3600)
    assert u["gpu_hours_cloud"] == pytest.approx(30 / 3600)
    assert u["cost"] == pytest.approx((6 * 120 + 10 * 30) / 3600)


def test_scaling_efficiency_against_the_smallest_world_and_a_reference():
    pts = [Point(1, 1, per_worker=1000), Point(2, 1, per_worker=1000), Point(3, 2, per_worker=900),
           Point(4, 2, per_worker=850), Point(5, 2, per_worker=880)]
    s = scaling(pts, reference_per_worker=1100)
    assert s["scaling_efficiency"] == pytest.approx(0.88) and s["scaling_smallest_world_size"] == 1
    assert s["scaling_efficiency_vs_reference"] == pytest.approx(880 / 1100)
    assert scaling([]) == {}


@pytest.mark.slow
def test_an_elastic_run_2_1_2_counts_the_worker_hours_it_really_used(cluster, tmp_path):
    """Workers 2 -> 1 -> 2 (a node lost, then back): gpu_hours (worker-hours on CPU) is the
    integral of world size over time in the logged series; the live worker processes, sampled
    here, are printed beside it (they also count Ray's worker start-up and tear-down)."""
    nodes = list(cluster.worker_nodes)
    while len(nodes) < 2:
        nodes.append(add_worker_node(cluster))
    spec = tiny_spec(tmp_path, name="elastic-hours", **{
        "train.steps": 800, "train.global_batch": 64, "checkpoint.every_steps": 20,
        "scaling.min_workers": 1, "scaling.max_workers": 2, "scaling.elastic_check_s": 2,
    })
    live = LiveWorkers()
    t, out = run_in_background(spec)
    wait_for_step(spec, 30)
    wait_for_world_size(spec, 2)
    cluster.remove_node(nodes[-1])
    wait_for_world_size(spec, 1)
    add_worker_node(cluster)
    result = finished(t, out)
    sampled_hours = live.stop()

    run = MlflowClient(spec.tracking.uri).get_run(result.mlflow_run_id)
    world = metric_history(spec, result.mlflow_run_id, "world_size")
    sizes = [world[s] for s in sorted(world)]
    assert [a for a, b in zip(sizes, [*sizes[1:], None], strict=True) if a != b][-3:] == [2, 1, 2], "ran 2 -> 1 -> 2"
    gpu_hours = run.data.metrics["gpu_hours"]
    # The integral of world size over time, from the raw series in MLflow: each logged world size
    # holds back to the previous point, or to its worker group's start if that came later.
    c = MlflowClient(spec.tracking.uri)
    up = {m.step: m.value for m in c.get_metric_history(result.mlflow_run_id, "uptime_s")}
    series = sorted((m.timestamp / 1000, m.value, up[m.step]) for m in c.get_metric_history(result.mlflow_run_id, "world_size"))
    integral, prev = 0.0, None
    for t, w, uptime in series:
        start = t - uptime if prev is None else max(prev, t - uptime)
        integral += w * (t - start)
        prev = t
    naive = run.data.metrics["world_size"] * (run.info.end_time - run.info.start_time) / 1000
    print(f"[gpu-hours] gpu_hours {gpu_hours * 3600:.1f} worker-s; integral of the series {integral:.1f}; live worker "
          f"processes sampled {sampled_hours * 3600:.1f}; final world x wall {naive:.1f}")
    assert gpu_hours * 3600 == pytest.approx(integral, rel=0.05)
    assert gpu_hours * 3600 < 0.95 * naive, "not the final world size times the wall time"
    assert run.data.metrics["gpu_hours_cloud"] == 0, "no node here is labelled cloud"


def test_tidal_runs_shows_gpu_hours_cloud_share_and_cost(tmp_path):
    from mlflow.entities import Metric, Param

    from tidal.tracking.runs import list_runs, run_records

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    c = MlflowClient(uri)
    exp = c.create_experiment("tidal", artifact_location=str(tmp_path / "artifacts"))
    run = c.create_run(exp, run_name="burst", tags={"tidal.job": "burst"})
    metrics = {"world_size": 2.0, "gpu_hours": 3.5, "gpu_hours_cloud": 1.25, "cost": 41.0, "scaling_efficiency": 0.9}
    c.log_batch(run.info.run_id, params=[Param("scaling.gpus_per_worker", "8")],
                metrics=[Metric(k, v, 0, 10) for k, v in metrics.items()])
    record = run_records(uri)[0]
    assert (record["gpu_hours"], record["gpu_hours_cloud"], record["cost"], record["scaling_efficiency"]) == (
        3.5, 1.25, 41.0, 0.9)
    row = list_runs(uri)[0]
    assert (row["GPU-hours"], row["cloud"], row["cost"]) == ("3.50", "1.25", "41.00")
