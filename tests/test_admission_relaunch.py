"""After a head restart the queue's jobs start again by themselves (admission/relaunch.py): the
restarted admission actor finds the queue saved on another head, and submits each listed job's
driver again through the Jobs API unless it checked in (it survived), oldest first, under the
job's key so it keeps its place and size. Against a real head killed and started again with
Redis: tests/test_head_restart.py."""

from __future__ import annotations

import inspect
import logging
import time

import pytest
import yaml
from ray.job_submission import JobDetails, JobStatus, JobSubmissionClient, JobType

from tidal.admission.actor import Admitter
from tidal.admission.naming import QUEUE_JOB_VAR, job_key
from tidal.admission.parking import Cancelled, successor_id
from tidal.admission.queue_doc import DamagedQueue, Entry, load_queue, parse_queue
from tidal.admission.quotas import Quotas
from tidal.admission.registration import checked_registration
from tidal.admission.relaunch import (
    ATTEMPTS,
    RELAUNCH_GRACE_S,
    RELAUNCHED_VAR,
    RETRY_S,
    WAIT_VAR,
    JobsApi,
    resubmission,
)
from tidal.errors import TidalError

OLD, NEW = "a1" * 28, "b2" * 28  # two heads' node ids


def registration(job: str, lo: int, hi: int, submission: str = "", token: str = "") -> dict:
    """What a driver sends (admission/seat.py)."""
    return {"job": job, "name": job, "team": None, "priority": "normal", "min_workers": lo, "max_workers": hi,
            "cpus_per_worker": 1, "gpus_per_worker": 0, "token": token or f"tok-{job}",
            "submission": submission or job}


@pytest.fixture
def lost_head(tmp_path):
    """A queue saved by admission on head OLD: `big` RUNNING at 2 of 2 slots, `next` and
    `later` QUEUED behind it."""
    quotas = tmp_path / "quotas.yaml"
    quotas.write_text(yaml.safe_dump({"capacity": 2, "min_resize_interval_s": 0}))
    where = str(tmp_path / "q.json")
    a = Admitter(str(quotas), where, background=False, head=OLD)
    for job in ("big", "next", "later"):
        a.submit(registration(job, 2, 2))
    a.tick()
    assert [load_queue(where).get(j).state for j in ("big", "next", "later")] == ["RUNNING", "QUEUED", "QUEUED"]
    return str(quotas), where


class Recorder:
    """Stands in for the Jobs API's submit (a real head: tests/test_head_restart.py)."""

    def __init__(self, fail: dict[str, int] | None = None) -> None:
        self.sent: list[str] = []
        self.fail = dict(fail or {})  # job -> how many of its submissions fail

    def __call__(self, entry: Entry) -> str:
        if self.fail.get(entry.job, 0):
            self.fail[entry.job] -= 1
            raise ConnectionError("the Jobs API is not up yet")
        self.sent.append(entry.job)
        return f"{entry.job}-again"


def test_a_queue_saved_on_a_lost_head_starts_its_jobs_again_oldest_first_after_the_grace(lost_head):
    quotas, where = lost_head
    sent = Recorder()
    a = Admitter(quotas, where, background=False, head=NEW, relauncher=sent)
    a.status("later")  # its driver survived the head (it ran elsewhere) and checked in
    a.tick(time.time())
    assert sent.sent == [], "nothing before the grace: a surviving driver checks in by then"
    a.tick(time.time() + RELAUNCH_GRACE_S)
    assert sent.sent == ["big", "next"], "every job whose driver is gone, in submission order; none twice"
    a.tick(time.time() + 2 * RELAUNCH_GRACE_S)
    assert sent.sent == ["big", "next"]
    saved = load_queue(where)
    assert saved.head == NEW
    assert saved.get("big").submission == "big-again" and "started again after the head restarted" in \
        saved.get("big").reason
    # The relaunched driver registers under the job's key (QUEUE_JOB_VAR) with its new id: the job
    # keeps its size and state, and the new driver holds the seat.
    status = a.submit(registration("big", 2, 2, submission="big-again", token="new-driver"))
    assert (status["state"], status["workers"]) == ("RUNNING", 2)
    assert a.finished("big", "new-driver")


def test_an_actor_that_dies_before_the_relaunches_leaves_them_to_its_next_life(lost_head):
    quotas, where = lost_head
    Admitter(quotas, where, background=False, head=NEW, relauncher=Recorder())  # dies within the grace
    assert load_queue(where).head == OLD, "the new head is not recorded before the relaunches are done"
    sent = Recorder()
    again = Admitter(quotas, where, background=False, head=NEW, relauncher=sent)
    again.tick(time.time() + RELAUNCH_GRACE_S)
    assert sent.sent == ["big", "next", "later"]
    assert load_queue(where).head == NEW


def test_a_restart_on_the_same_head_or_a_queue_without_one_starts_nothing(lost_head):
    quotas, where = lost_head
    sent = Recorder()
    a = Admitter(quotas, where, background=False, head=OLD, relauncher=sent)  # only the actor restarted
    a.tick(time.time() + RELAUNCH_GRACE_S)
    fresh = Admitter(quotas, str(where) + ".new", background=False, head=NEW, relauncher=sent)
    fresh.tick(time.time() + RELAUNCH_GRACE_S)
    assert sent.sent == []


def test_a_relaunch_that_fails_is_tried_again_then_left_to_its_lease_and_said(lost_head, caplog):
    quotas, where = lost_head
    sent = Recorder(fail={"big": ATTEMPTS, "next": 1})  # `big` fails every attempt; `next` once, then starts
    a = Admitter(quotas, where, background=False, head=NEW, relauncher=sent)
    with caplog.at_level(logging.WARNING, logger="tidal"):
        start = time.time() + RELAUNCH_GRACE_S
        a.tick(start + 1)  # too soon for a retry
        for i in range(ATTEMPTS + 1):
            a.tick(start + i * RETRY_S)
        a.tick(start + ATTEMPTS * RETRY_S + 5)  # past the lease the actor's start gave every job
    assert sent.sent == ["later", "next"]
    assert load_queue(where).get("big") is None, "left to its lease once its attempts ran out (past the lease here)"
    assert not a.relaunches.pending
    assert "job big could not be started again after the head restart" in caplog.text
    assert "submit it again" in caplog.text


def test_the_resubmission_keeps_the_jobs_record_and_takes_its_place():
    """What is sent is the job's own record (its entrypoint, package and metadata) plus the
    job's key and the lease wait; `submit_job` of the installed Ray accepts every argument."""
    info = JobDetails(type=JobType.SUBMISSION, entrypoint="tidal run jobs/x.yaml", submission_id="x-1",
                      status=JobStatus.RUNNING, metadata={"team": "a"},
                      runtime_env={"working_dir": "gcs://_ray_pkg_abc.zip", "env_vars": {"A": "1"}})
    entry = Entry("x-1", "x", "default", "normal", 1, 1, 0.0, submission="x-1")
    new = successor_id(entry.submission)
    args = resubmission(info, entry, new)
    assert args["runtime_env"] == {"working_dir": "gcs://_ray_pkg_abc.zip",
                                   "env_vars": {"A": "1", QUEUE_JOB_VAR: "x-1", WAIT_VAR: "1",
                                                RELAUNCHED_VAR: "1"}}
    assert (args["entrypoint"], args["metadata"]) == ("tidal run jobs/x.yaml", {"team": "a"})
    assert new == "x-1-p", "the id the first one follows (launch/chain.py)"
    inspect.signature(JobSubmissionClient.submit_job).bind(None, **args)
    assert job_key("x", {QUEUE_JOB_VAR: "x-1", "RAY_JOB_CONFIG_JSON_ENV_VAR": '{"metadata": '
                         '{"job_submission_id": "x-1-h1"}}'}) == "x-1", "the relaunched driver takes the job's key"


def test_a_head_or_submission_id_read_from_storage_is_checked():
    good = {"version": 1, "jobs": [], "notice": "", "head": NEW}
    assert parse_queue(good, "q").head == NEW
    with pytest.raises(DamagedQueue, match="names a head"):
        parse_queue({**good, "head": "../../x"}, "q")
    job = {"job": "a", "name": "a", "team": "t", "priority": "p", "min_workers": 1, "max_workers": 1,
           "submitted_at": 0.0, "submission": "a b; rm -rf /"}
    with pytest.raises(DamagedQueue, match="not a Ray submission id"):
        parse_queue({**good, "jobs": [job]}, "q")
    with pytest.raises(TidalError, match="not a Ray Jobs submission id"):
        checked_registration(registration("a", 1, 1, submission="../x"), Quotas())


def test_a_relaunched_driver_replaying_restart_resumes_instead(tmp_path, monkeypatch, capsys):
    """`ray job submit -- tidal run job.yaml --restart`, relaunched after a head restart from its
    record: the replayed --restart would set the job's folder aside again and start over at step
    0 in a new MLflow run. The relaunched driver resumes from what the job trained since."""
    from tests.conftest import tiny_spec
    from tidal.launch import trainer
    from tidal.storage import RunDir

    class Reached(Exception):
        pass

    def resume_point(*_a, **_k):
        raise Reached

    spec = tiny_spec(tmp_path, name="restarted")
    RunDir(spec.checkpoint.storage, spec.name).write_json("tidal-job.json", {"mlflow_run_id": "r"})
    monkeypatch.setattr(trainer, "find_resume_point", resume_point)
    monkeypatch.setenv(RELAUNCHED_VAR, "1")
    with pytest.raises(Reached):
        trainer.run(spec, restart=True)
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["restarted", "restarted.lease"], "nothing set aside"
    assert RunDir(spec.checkpoint.storage, spec.name).read_json("tidal-job.json") == {"mlflow_run_id": "r"}
    assert "--restart applied to its first start only" in capsys.readouterr().out
    monkeypatch.delenv(RELAUNCHED_VAR)
    with pytest.raises(Reached):
        trainer.run(spec, restart=True)  # a first start's --restart still sets the folder aside
    assert any(".replaced-" in p.name for p in (tmp_path / "runs").iterdir())


class Jobs:
    """The Jobs API's records, as the admission actor's client reads and writes them."""

    def __init__(self, **states: str) -> None:
        self.jobs = {sid: JobDetails(type=JobType.SUBMISSION, entrypoint="tidal run x.yaml", submission_id=sid,
                                     status=JobStatus(state), runtime_env={}) for sid, state in states.items()}
        self.submitted: list[str] = []

    def get_job_info(self, sid: str) -> JobDetails:
        if sid not in self.jobs:
            raise RuntimeError(f"Request failed with status code 404: job {sid} does not exist")
        return self.jobs[sid]

    def submit_job(self, submission_id: str, **job) -> str:
        if submission_id in self.jobs:
            raise RuntimeError(f"Job with submission_id {submission_id} already exists")
        self.submitted.append(submission_id)
        self.jobs[submission_id] = JobDetails(type=JobType.SUBMISSION, submission_id=submission_id,
                                              status=JobStatus.PENDING, **job)
        return submission_id

    def stop_job(self, sid: str) -> bool:
        self.jobs[sid].status = JobStatus.STOPPED
        return True

    def get_job_status(self, sid: str) -> JobStatus:
        return self.get_job_info(sid).status

    def get_job_logs(self, sid: str) -> str:
        return ""


def test_a_relaunch_goes_on_under_the_id_the_first_one_follows_once_and_not_after_a_stop():
    api = JobsApi.__new__(JobsApi)
    api.client = Jobs(**{"x-1": "RUNNING"})  # the lost head's record still says RUNNING
    entry = Entry("x-1", "x", "default", "normal", 1, 1, 0.0, submission="x-1")
    assert api.relaunch(entry) == successor_id("x-1") == "x-1-p"
    assert api.client.jobs["x-1"].status == JobStatus.STOPPED
    # An actor that died before saving the relaunch: its next life finds it, and submits nothing.
    assert api.relaunch(entry) == "x-1-p" and api.client.submitted == ["x-1-p"]
    # A job the user stopped while the head was away is not started again.
    api.client = Jobs(**{"y-1": "STOPPED"})
    with pytest.raises(Cancelled):
        api.relaunch(Entry("y-1", "y", "default", "normal", 1, 1, 0.0, submission="y-1"))
    assert api.client.submitted == []


def test_the_first_id_follows_a_job_through_any_number_of_relaunches_and_parks():
    from tidal.launch.chain import walk

    ids = ["x"]
    for _ in range(40):  # a job that waited or lost its head 40 times (32 links was the limit)
        ids.append(successor_id(ids[-1]))
    jobs = Jobs(**{sid: "SUCCEEDED" for sid in ids[:-1]}, **{ids[-1]: "RUNNING"})
    links = walk(jobs, "x")
    assert (links[-1].submission_id, links[-1].state, len(links)) == (ids[-1], "RUNNING", 41)
    longest = "j" * 126 + "-p"  # at the Jobs API's length limit: its own successor id, not a loop
    assert successor_id(longest) == longest
    assert walk(Jobs(**{longest: "SUCCEEDED"}), longest)[-1].state == "SUCCEEDED"
