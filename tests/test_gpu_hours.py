"""GPU-hours that follow a run's real shape: world size integrated over time, by site, with cost.

On a real elastic run (2 -> 1 -> 2 workers) the same is checked by tests/test_elastic.py."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from tidal.testing.runs import prepared_store
from tidal.tracking.usage import Point, charged_seconds, scaling, usage


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


def test_tidal_runs_shows_gpu_hours_cloud_share_and_cost(tmp_path):
    from mlflow.entities import Metric, Param

    from tidal.tracking.runs import list_runs, run_records

    uri = prepared_store(tmp_path / "mlflow.db")
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
