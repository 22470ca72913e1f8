"""Where a job stores and tracks: the spec's value, else the cluster's environment, else the
laptop defaults; a submitted job never keeps anything inside Ray's working-dir cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidal.errors import SpecError
from tidal.spec.job import JobSpec

CLUSTER = {"TIDAL_STORAGE": "s3://team-bucket/tidal", "MLFLOW_TRACKING_URI": "http://head:5000",
           "MLFLOW_EXPERIMENT_NAME": "team-a"}


def test_the_cluster_environment_fills_what_the_spec_leaves(tmp_path):
    spec = JobSpec(name="j").resolved(tmp_path, environ=CLUSTER)
    assert spec.checkpoint.storage == "s3://team-bucket/tidal"
    assert spec.tracking.uri == "http://head:5000"
    assert spec.tracking.experiment == "team-a"


def test_the_spec_wins_over_the_environment(tmp_path):
    spec = JobSpec(name="j", checkpoint={"storage": "/mnt/nfs/runs"},
                   tracking={"uri": "http://other:5000", "experiment": "mine"}).resolved(tmp_path, environ=CLUSTER)
    assert (spec.checkpoint.storage, spec.tracking.uri, spec.tracking.experiment) == (
        "/mnt/nfs/runs", "http://other:5000", "mine")


def test_a_laptop_without_settings_keeps_local_defaults(tmp_path):
    spec = JobSpec(name="j").resolved(tmp_path, environ={})
    assert spec.checkpoint.storage == str(tmp_path / "tidal-runs")
    assert spec.tracking.uri == f"sqlite:///{tmp_path}/mlflow.db"
    assert spec.tracking.experiment == "tidal"


def ray_working_dir(tmp_path: Path) -> Path:
    d = tmp_path / "session_x" / "runtime_resources" / "working_dir_files" / "_ray_pkg_abc"
    d.mkdir(parents=True)
    return d


def test_a_submitted_job_puts_relative_storage_under_the_clusters(tmp_path):
    spec = JobSpec(name="j", checkpoint={"storage": "./tidal-runs"})
    resolved = spec.resolved(ray_working_dir(tmp_path), environ=CLUSTER)
    assert resolved.checkpoint.storage == "s3://team-bucket/tidal/tidal-runs"


def test_a_submitted_job_without_cluster_settings_is_refused_naming_both_fields(tmp_path):
    with pytest.raises(SpecError) as e:
        JobSpec(name="j").resolved(ray_working_dir(tmp_path), environ={})
    text = str(e.value)
    assert "checkpoint.storage" in text and "TIDAL_STORAGE" in text
    assert "tracking.uri" in text and "MLFLOW_TRACKING_URI" in text


def test_a_submitted_job_with_absolute_places_needs_nothing_from_the_cluster(tmp_path):
    spec = JobSpec(name="j", checkpoint={"storage": str(tmp_path / "shared")},
                   tracking={"uri": f"sqlite:///{tmp_path}/m.db"})
    resolved = spec.resolved(ray_working_dir(tmp_path), environ={})
    assert resolved.checkpoint.storage == str(tmp_path / "shared")


def test_a_relative_cluster_storage_is_refused(tmp_path):
    with pytest.raises(SpecError) as e:
        JobSpec(name="j", checkpoint={"storage": "./runs"}).resolved(ray_working_dir(tmp_path),
                                                                    environ={**CLUSTER, "TIDAL_STORAGE": "runs"})
    assert "TIDAL_STORAGE 'runs' is relative" in str(e.value)


def test_submit_forwards_only_settings_that_mean_the_same_on_the_cluster(capsys):
    from tidal.launch.submission import forwarded_env

    laptop = {"MLFLOW_TRACKING_URI": "http://mlflow.team:5000", "TIDAL_STORAGE": "s3://team/tidal",
              "MLFLOW_EXPERIMENT_NAME": "mine", "HOME": "/home/me"}
    assert forwarded_env(laptop) == {k: v for k, v in laptop.items() if k != "HOME"}
    local = {"MLFLOW_TRACKING_URI": "http://127.0.0.1:5000", "TIDAL_STORAGE": "./runs"}
    assert forwarded_env(local) == {}
    assert "MLFLOW_TRACKING_URI=http://127.0.0.1:5000" in capsys.readouterr().err
    assert forwarded_env({"MLFLOW_TRACKING_URI": "sqlite:///mlflow.db"}) == {}
