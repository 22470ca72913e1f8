"""A run id read from the job's storage is reopened only when MLflow says the run is this job's:
anyone who can write the storage can plant another team's run id there (#65)."""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from tests.conftest import tiny_spec
from tidal.tracking.writer import RunWriter, SweepWriter


def test_a_planted_run_id_is_left_alone_and_the_job_starts_its_own_run(tmp_path, mlflow_uri, capsys):
    c = MlflowClient(mlflow_uri)
    other = tiny_spec(tmp_path / "a", name="their-job", **{"tracking.uri": mlflow_uri, "tracking.experiment": "theirs"})
    theirs = RunWriter(other).start(None)
    c.set_terminated(theirs)
    spec = tiny_spec(tmp_path / "b", name="reopen-mine", **{"tracking.uri": mlflow_uri})

    ours = RunWriter(spec).start(theirs)  # their id, as a planted tidal-job.json would name it
    assert ours != theirs
    assert c.get_run(theirs).info.status == "FINISHED", "their run is not reopened"
    assert "is not this job's" in capsys.readouterr().out
    assert c.get_run(ours).data.tags["tidal.job"] == "reopen-mine"
    assert RunWriter(spec).start(ours) == ours, "the job's own run is reopened"

    # The same job name in another experiment is another job's run too.
    twin = tiny_spec(tmp_path / "c", name="reopen-mine", **{"tracking.uri": mlflow_uri, "tracking.experiment": "twin"})
    assert RunWriter(twin).start(ours) != ours


def test_a_sweep_reopens_only_its_own_parent_run(tmp_path, mlflow_uri):
    base = tiny_spec(tmp_path, name="reopen-sweeper", **{"tracking.uri": mlflow_uri})
    parent = SweepWriter(base).open({"trials": 2}, None)
    assert SweepWriter(base).open({"trials": 2}, parent) == parent
    job_run = RunWriter(base).start(None)  # a job's run, not a sweep's parent
    assert SweepWriter(base).open({"trials": 2}, job_run) not in (job_run, parent)
