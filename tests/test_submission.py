"""What a submission carries and how a failed start reads (fast: no Ray cluster): each submission's
package is its own (issue #52), a job that failed before its entrypoint ran says why, and a
credential in the spec or the forwarded environment is refused before anything is sent (#47)."""

from __future__ import annotations

import io
import zipfile

import pytest

from tests.conftest import tiny_spec
from tidal.launch.jobs import ALWAYS_EXCLUDE, submit
from tidal.launch.submission import SUBMISSION_MARKER, JobState, package_working_dir, start_failure
from tidal.redact import RedactingStream, install
from tidal.spec.secrets import SubmissionCarriesSecret, credential_problems

PASSWORD = "s3cr3t-pa55word"


@pytest.fixture(autouse=True)
def _no_redaction_left():
    """install() redacts every log record this process makes from then on: put logging back after each test."""
    import logging

    factory = logging.getLogRecordFactory()
    yield
    logging.setLogRecordFactory(factory)


# port 1 answers nothing: reaching the cluster would fail with a ClusterError, not a refusal
NOWHERE = "http://127.0.0.1:1"


def test_each_submission_of_an_unchanged_folder_is_a_package_of_its_own(tmp_path):
    """Ray names an uploaded package by its bytes' hash: two packages of one folder must differ, or
    the second submission reuses a package the cluster may already have deleted (ray#36703)."""
    import hashlib

    project = tmp_path / "project"
    (project / "pkg").mkdir(parents=True)
    (project / "pkg" / "model.py").write_text("x = 1\n")
    (project / "empty").mkdir()
    (project / ".gitignore").write_text("data/\n")
    (project / "data").mkdir()
    (project / "data" / "big.bin").write_bytes(b"0" * 1000)
    (project / "tidal-runs").mkdir()
    (project / "tidal-runs" / "ckpt.pt").write_bytes(b"1")
    out1, out2 = tmp_path / "a", tmp_path / "b"
    out1.mkdir()
    out2.mkdir()
    first, second = package_working_dir(project, ALWAYS_EXCLUDE, out1), package_working_dir(project, ALWAYS_EXCLUDE, out2)
    assert hashlib.sha1(first.read_bytes()).digest() != hashlib.sha1(second.read_bytes()).digest()
    names = set(zipfile.ZipFile(first).namelist())
    assert {"pkg/model.py", ".gitignore", SUBMISSION_MARKER} <= names and "empty/" in names
    assert not [n for n in names if n.startswith(("data", "tidal-runs"))], names


@pytest.mark.parametrize("state, kind, message, shown", [
    ("FAILED", "RUNTIME_ENV_SETUP_FAILURE",
     "runtime_env setup failed: Failed to download runtime_env file package gcs://_ray_pkg_ab.zip from the GCS",
     "runtime_env setup failed: Failed to download runtime_env file package gcs://_ray_pkg_ab.zip from the GCS"),
    ("FAILED", "JOB_SUPERVISOR_ACTOR_UNSCHEDULABLE", "cannot place the supervisor", "cannot place the supervisor"),
    # Ray's message quotes the runtime env: a URI's password never shows
    ("FAILED", "RUNTIME_ENV_SETUP_FAILURE", f"setup of http://u:{PASSWORD}@mlflow:5000 failed",
     "setup of http://u:***@mlflow:5000 failed"),
    ("FAILED", "JOB_ENTRYPOINT_COMMAND_ERROR", "exit code 1", None),  # its own output says why
    ("SUCCEEDED", None, "Job finished successfully.", None),
    ("RUNNING", None, None, None),
])
def test_a_job_that_failed_before_its_entrypoint_ran_says_why(state, kind, message, shown):
    from ray.job_submission import JobErrorType

    error_type = JobErrorType(kind) if kind else None
    assert start_failure(state, error_type, message) == shown
    job_state = JobState(state, shown)
    assert job_state == state and job_state.reason == shown  # compares as the plain state does


def spec_data(tmp_path, **overrides):
    return tiny_spec(tmp_path, **overrides).model_dump(mode="json")


@pytest.mark.parametrize("where, overrides", [
    ("tracking.uri", {"tracking.uri": f"http://alice:{PASSWORD}@mlflow.example:5000"}),
    ("checkpoint.storage", {"checkpoint.storage": f"s3://AKIAEXAMPLE:{PASSWORD}@bucket/runs"}),
    ("checkpoint.storage", {"checkpoint.storage": f"s3://bucket/runs?X-Amz-Signature={PASSWORD}"}),
    ("worker_env.DATABASE_URL", {"worker_env": {"DATABASE_URL": f"postgresql://app:{PASSWORD}@db/app"}}),
    ("data.source", {"data.source": f"https://hub.example/data.txt?token={PASSWORD}", "model.vocab_size": 256}),
])
def test_a_spec_holding_a_credential_is_named_with_how_to_reference_it(tmp_path, where, overrides):
    problems = credential_problems(spec_data(tmp_path, **overrides), {}, ())
    assert [w for w, _ in problems] == [where]
    assert all(PASSWORD not in how for _, how in problems)


def test_the_laptops_forwarded_settings_holding_a_credential_are_named(tmp_path):
    env = {"MLFLOW_TRACKING_URI": f"https://alice:{PASSWORD}@mlflow.example", "TIDAL_STORAGE": "s3://bucket/runs",
           "MLFLOW_EXPERIMENT_NAME": "x"}
    problems = credential_problems(spec_data(tmp_path), env, ("MLFLOW_TRACKING_URI", "TIDAL_STORAGE", "MLFLOW_EXPERIMENT_NAME"))
    assert [w for w, _ in problems] == ["$MLFLOW_TRACKING_URI (this machine's environment)"]
    assert "MLFLOW_TRACKING_PASSWORD" in problems[0][1]


def test_references_and_plain_settings_are_no_credential(tmp_path):
    data = spec_data(tmp_path, **{"env": {"HF_TOKEN": "env:NODE_HF", "DB_PASSWORD": "file:/etc/tidal/secrets/db"},
                                  "worker_env": {"TOKENIZERS_PARALLELISM": "false"},
                                  "tracking.uri": "http://mlflow.example:5000", "checkpoint.storage": "s3://bucket/runs"})
    assert credential_problems(data, {"MLFLOW_TRACKING_URI": "http://mlflow:5000"}, ("MLFLOW_TRACKING_URI",)) == []


def test_submit_refuses_a_credential_before_reaching_the_cluster(tmp_path, monkeypatch, capsys):
    """Today's code sent it: the spec base64-encoded in the entrypoint, the laptop's
    MLFLOW_TRACKING_URI verbatim in the runtime_env, for every token holder to read."""
    from tidal.cli import main

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"https://alice:{PASSWORD}@mlflow.example")
    with pytest.raises(SubmissionCarriesSecret) as e:
        submit(tiny_spec(tmp_path), NOWHERE, tmp_path)
    assert "MLFLOW_TRACKING_URI" in str(e.value) and PASSWORD not in str(e.value)
    monkeypatch.delenv("MLFLOW_TRACKING_URI")

    spec = tiny_spec(tmp_path, **{"checkpoint.storage": f"s3://AKIAEXAMPLE:{PASSWORD}@bucket/runs"})
    path = tmp_path / "job.yaml"
    import yaml

    path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    assert main(["submit", str(path), "--address", NOWHERE]) != 0
    err = capsys.readouterr().err
    assert "checkpoint.storage holds a credential" in err and "TIDAL_STORAGE" in err and PASSWORD not in err
    assert "cannot reach" not in err  # refused before any connection


def test_a_workers_own_secret_values_are_masked_in_what_it_prints(monkeypatch):
    """A secret's value exists only on the workers (resolved there from a reference): the lines a
    worker prints, which Ray copies to the job's log, mask it whatever its name."""
    import sys

    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    install(["value-of-a-secret-0123"])
    print("the model saw value-of-a-secret-0123 at step 3")
    install(["another-secret-value"])  # a second resolve adds to the same stream
    print("and another-secret-value")
    assert isinstance(sys.stdout, RedactingStream)
    assert out.getvalue() == "the model saw *** at step 3\nand ***\n"


def test_a_workers_own_secret_values_are_masked_in_its_log_records():
    """Ray Train's workers send every print to the root logger too (its worker log files)."""
    import logging

    root, seen = logging.getLogger(), io.StringIO()
    handler = logging.StreamHandler(seen)
    root.addHandler(handler)
    try:
        install(["value-of-a-secret-4567"])
        root.warning("printed: %s", "value-of-a-secret-4567")
        assert seen.getvalue() == "printed: ***\n"
    finally:
        root.removeHandler(handler)


def test_a_secret_is_masked_in_records_of_any_logger_reaching_a_handler_added_later():
    """Libraries add their handlers when they start (Ray Train's worker log file, a user's own
    logging setup), after a worker resolved its secrets, and log through loggers of their own."""
    import logging

    install(["value-of-a-secret-8901"])
    seen = io.StringIO()
    handler = logging.StreamHandler(seen)
    library = logging.getLogger("some.library")
    library.addHandler(handler)
    try:
        library.warning("connected with %s", "value-of-a-secret-8901")
        logging.getLogger("some.library.child").error("token=value-of-a-secret-8901")
        assert seen.getvalue() == "connected with ***\ntoken=***\n"
    finally:
        library.removeHandler(handler)


def test_ray_trains_config_holds_no_credential_and_the_workers_get_the_whole_spec(tmp_path):
    """Ray Train's state API shows train_loop_config to every token holder: a credential the driver
    resolved into the spec (the cluster's own MLFLOW_TRACKING_URI holding one) goes by reference."""
    from tidal.spec.secrets import SPEC_REF, carried_spec, with_carried_spec

    store: dict[str, object] = {}

    def put(value: object) -> str:
        store["ref"] = value
        return "ref"

    plain = spec_data(tmp_path)
    assert carried_spec(plain, put) == {"spec": plain} and not store  # nothing to hide: as before
    secret = spec_data(tmp_path, **{"tracking.uri": f"http://alice:{PASSWORD}@mlflow.example:5000"})
    config = carried_spec(secret, put)
    assert PASSWORD not in repr({k: v for k, v in config.items() if k != SPEC_REF}) and config[SPEC_REF] == "ref"
    assert config["spec"]["tracking"]["uri"] == "http://alice:***@mlflow.example:5000"
    assert with_carried_spec({**config, "lease": 1}, store.__getitem__) == {**config, "spec": secret, "lease": 1}


@pytest.mark.parametrize("error, again", [
    ("Request failed with status code 500: No available agent to submit job, please try again later..", True),
    ("('Connection aborted.', RemoteDisconnected('Remote end closed connection without response'))", True),
    ("Request failed with status code 400: Job with submission_id x already exists", False),
    ("Request failed with status code 401: Unauthorized", False),
])
def test_submit_tries_again_only_where_nothing_or_the_same_job_was_accepted(error, again):
    from tidal.jobs_api import retry_submission

    assert retry_submission(error) is again


def test_a_starting_heads_refusal_is_retried_with_a_growing_pause_and_said_once(monkeypatch):
    """Ray's Jobs API says to try again while the head's job agent registers: submit does, for a
    bounded time, with a pause that grows, saying so once. (A head answering that refusal on cue
    cannot be made here: its window is a race; this is the decision against Ray's own words.)"""
    from tidal import jobs_api as jobs

    refusal = "Request failed with status code 500: No available agent to submit job, please try again later."

    class StartingHead:
        calls = 0

        def submit_job(self, **job):
            StartingHead.calls += 1
            if StartingHead.calls <= 4:
                raise RuntimeError(refusal)
            return job["submission_id"]

    pauses: list[float] = []
    lines: list[str] = []
    monkeypatch.setattr(jobs, "_pause", pauses.append)
    jobs.submit_accepted(StartingHead(), 120, say=lines.append, entrypoint="true", submission_id="s1")
    assert StartingHead.calls == 5
    assert pauses == [1.0, 2.0, 4.0, 8.0]
    assert len(lines) == 1 and "still starting" in lines[0] and "120s" in lines[0]

    class NeverReady:
        def submit_job(self, **job):
            raise RuntimeError(refusal)

    monkeypatch.setattr(jobs.time, "time", iter(range(0, 1000, 50)).__next__)
    with pytest.raises(RuntimeError, match="No available agent"):
        jobs.submit_accepted(NeverReady(), 120, say=lines.append, entrypoint="true", submission_id="s2")


def test_tidal_queue_asks_a_starting_head_again_instead_of_failing(monkeypatch, capsys):
    """`tidal queue --address` reads the queue through a job on the head: a head whose job agent is
    not up yet refuses that job as it refuses a `tidal submit`, and it is tried again the same way."""
    import json

    from tidal import jobs_api
    from tidal.admission.view import MARK, remote_queue

    class StartingHead:
        calls = 0

        def submit_job(self, **job):
            StartingHead.calls += 1
            if StartingHead.calls == 1:
                raise RuntimeError("Request failed with status code 500: No available agent to submit job, "
                                   "please try again later.")

        def get_job_status(self, sid):
            return type("Status", (), {"value": "SUCCEEDED"})()

        def get_job_logs(self, sid):
            return "hello\n" + MARK + json.dumps({"version": 1, "jobs": []}) + "\n"

        def stop_job(self, sid):
            pass

        def delete_job(self, sid):
            pass

    monkeypatch.setattr(jobs_api, "_pause", lambda s: None)
    queue = remote_queue(StartingHead())
    assert StartingHead.calls == 2 and queue.entries == ()
    assert "still starting" in capsys.readouterr().err
