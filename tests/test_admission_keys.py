"""A job's key in the cluster's queue (admission/naming.py): a job is its name under its storage,
so two `tidal run`s of one name on two storages never share one seat."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import tiny_spec
from tidal.admission.naming import QUEUE_JOB_VAR, job_key
from tidal.admission.seat import Seat


def test_two_jobs_of_one_name_on_two_storages_take_two_seats(tmp_path: Path, monkeypatch):
    monkeypatch.delenv(QUEUE_JOB_VAR, raising=False)
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    team_a = tiny_spec(tmp_path / "a", name="llama").resolved()
    team_b = tiny_spec(tmp_path / "b", name="llama").resolved()
    a, b = Seat(team_a), Seat(team_b)
    assert a.job != b.job and a.job.startswith("llama:") and b.job.startswith("llama:")
    assert Seat(team_a).job == a.job, "the same job keeps its key (its second start is the lease's to refuse)"
    assert a.registration["name"] == "llama"


def test_a_submitted_or_relaunched_job_keeps_the_id_it_was_given():
    config = '{"metadata": {"job_submission_id": "raysubmit_1"}}'
    assert job_key("llama", {"RAY_JOB_CONFIG_JSON_ENV_VAR": config}, storage="s3://b/runs") == "raysubmit_1"
    assert job_key("llama", {QUEUE_JOB_VAR: "raysubmit_1", "RAY_JOB_CONFIG_JSON_ENV_VAR": config},
                   storage="s3://b/runs") == "raysubmit_1"
