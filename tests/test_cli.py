"""The CLI as a user runs it (`python -m tidal ...` in a subprocess): versions, exit codes, JSON output.

No Ray instance: what needs one is in test_jobs.py and test_cli_e2e.py (slow)."""

from __future__ import annotations

import json
from importlib.metadata import version

import pytest

import tidal
from tests.conftest import ROOT
from tests.helpers import tidal_cli, tidal_main
from tidal.cli import main
from tidal.testing.runs import prepared_store


def test_version_names_tidal_and_the_stack_it_runs_on():
    code, out, err = tidal_main("--version")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == f"tidal {tidal.__version__}"
    for name in ("ray", "deepspeed", "mlflow"):
        assert f"{name} {version(name)}" in lines


@pytest.mark.parametrize(
    "args, expected",
    [
        (["run"], "the following arguments are required: SPEC"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["runs", "compare", "only-one-run"], "usage: tidal runs compare RUN_ID RUN_ID"),
        (["runs", "delete"], "unknown runs action 'delete'"),
        (["run", "jobs/quickstart.yaml", "--set", "train.steps"], "--set: 'train.steps' is not of the form"),
    ],
)
def test_bad_usage_exits_2(args, expected):
    code, _, err = tidal_main(*args)
    assert code == 2, err
    assert expected in err and "Traceback" not in err


def test_a_process_exits_2_on_bad_usage_with_the_message_only():
    """What the in-process tests check, once as a user's shell sees it: the exit status of `python -m tidal`."""
    proc = tidal_cli("frobnicate")
    assert proc.returncode == 2, proc.stderr
    assert "invalid choice: 'frobnicate'" in proc.stderr and "Traceback" not in proc.stderr


def test_invalid_spec_exits_2_before_anything_starts(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("train: {stpes: 10}\n")
    code, out, err = tidal_main("run", str(path))
    assert code == 2
    assert "train.stpes: unknown key; did you mean 'steps'?" in err
    assert "Ray" not in out and "Traceback" not in err


@pytest.mark.parametrize(
    "args, expected",
    [
        # port 1 answers nothing: the cluster cannot be reached
        (["list", "--address", "http://127.0.0.1:1"], "cannot reach the Ray dashboard at http://127.0.0.1:1"),
        (["runs", "--uri", "sqlite:////nonexistent/mlflow.db"], "no MLflow store at sqlite:////nonexistent/mlflow.db"),
    ],
)
def test_a_command_that_fails_exits_1(args, expected):
    code, _, err = tidal_main(*args)
    assert code == 1, err
    assert expected in err and "Traceback" not in err


def test_help_documents_the_exit_codes():
    code, out, _ = tidal_main("--help")
    assert code == 0
    codes = out.split("exit codes:")[1]
    assert all(f"\n  {code} " in codes for code in ("0", "1", "2", "130"))


# --- --output json ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory) -> tuple[str, dict[str, str]]:
    """A SQLite store holding two Tidal-shaped runs (what tracking/writer.py logs) and one other run.

    Returns (tracking URI, job name -> run id)."""
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    tmp = tmp_path_factory.mktemp("mlflow")
    uri = prepared_store(tmp / "mlflow.db")
    client = MlflowClient(uri)
    exp = client.create_experiment("tidal", artifact_location=str(tmp / "artifacts"))
    ids = {}
    for job, lr, loss in (("short", "0.003", 1.25), ("diverged", "0.1", float("nan"))):
        run = client.create_run(exp, run_name=job, tags={"tidal.job": job})
        params = {"train.steps": "10", "train.global_batch": "32", "model.seq_len": "64",
                  "scaling.gpus_per_worker": "0", "train.lr": lr}
        metrics = {"loss": loss, "tokens_per_s": 5000.0, "mfu": 0.01, "world_size": 2.0, "tokens_seen": 10 * 32 * 64}
        client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in params.items()],
                         metrics=[Metric(k, v, 0, 10) for k, v in metrics.items()])
        client.set_terminated(run.info.run_id, "FINISHED")
        ids[job] = run.info.run_id
    client.create_run(exp, run_name="not-tidal")  # no tidal.job tag: not listed
    return uri, ids


def test_runs_json_lists_tidal_runs_as_numbers(mlflow_store, capsys):
    """In this process (`main`, as `tidal` calls it): a subprocess would import MLflow again for
    seconds; the process-level behaviour (exit codes, no traceback) is shown by the tests above."""
    from tidal.tracking.runs import RECORD_FIELDS

    uri, ids = mlflow_store
    assert main(["runs", "--uri", uri, "--output", "json"]) == 0
    records = {r["job"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(records) == {"short", "diverged"}
    short = records["short"]
    assert list(short) == list(RECORD_FIELDS)
    assert (short["run_id"], short["status"], short["step"], short["steps"]) == (ids["short"], "FINISHED", 10, 10)
    assert (short["loss"], short["tokens_per_s"], short["world_size"], short["gpu_hours"]) == (1.25, 5000.0, 2, 0.0)
    assert records["diverged"]["loss"] is None  # NaN is not JSON


def test_runs_compare_json_names_the_differing_params(mlflow_store, capsys):
    uri, ids = mlflow_store
    assert main(["runs", "compare", ids["short"], ids["diverged"], "--uri", uri, "--output", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["differing_params"] == ["train.lr"]
    assert [r["params"]["train.lr"] for r in doc["runs"]] == ["0.003", "0.1"]
    assert doc["runs"][0]["metrics"]["loss"] == 1.25 and doc["runs"][1]["metrics"]["loss"] is None


def test_list_and_status_json_hold_every_field(monkeypatch, capsys):
    """Without a cluster: Ray Jobs' answers stubbed. A job before its first progress line has nulls."""
    from tidal.launch import jobs

    rows = [{"id": "raysubmit_1", "name": "quickstart", "status": "SHRUNK", "team": "vision", "priority": "low",
             "start_time": 1, "step": 5, "steps": 10, "loss": 2.5, "tokens_per_s": 100.0, "world_size": 2},
            {"id": "raysubmit_2", "name": "queued", "status": "PENDING", "start_time": 2}]
    monkeypatch.setattr(jobs, "list_jobs", lambda address: rows)
    assert main(["list", "--output", "json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed[0] == rows[0]
    assert listed[1] == {**rows[1], "team": None, "priority": None, "step": None, "steps": None, "loss": None,
                         "tokens_per_s": None, "world_size": None}

    monkeypatch.setattr(jobs, "connect", lambda address: type("Client", (), {"get_address": lambda self: "http://h:8265"})())
    monkeypatch.setattr(jobs.Job, "status", lambda self: "PENDING")
    monkeypatch.setattr(jobs.Job, "logs", lambda self: "")
    assert main(["status", "raysubmit_2", "--output", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"id": "raysubmit_2", "status": "PENDING", "reason": None, "step": None, "steps": None,
                                                  "loss": None, "tokens_per_s": None, "world_size": None}


def test_cluster_status_record():
    from tidal.cluster.status import NodeLine, status_record

    nodes = [NodeLine("n-cloud", "cloud", "10.0.0.2", 8.0, 8.0, 32.0, 32.0),
             NodeLine("n-onprem", "onprem", "10.0.0.1", 4.0, 1.0, 16.0, 10.0)]
    autoscaler = {"autoscaler_report": {"pending_launches": {"gpu-cloud": 2}, "pending_nodes": [["10.0.0.9", "gpu-cloud", "setting-up"]]},
                  "load_metrics_report": {"pg_demand": [[{"GPU": 1.0, "node:__internal_head__": 0.001}, 3]]}}
    workers = [("02000000", "n-onprem"), ("02000000", "n-onprem"), ("02000000", "n-gone")]
    record = status_record(nodes, autoscaler, workers)
    json.dumps(record)  # plain data
    assert record["nodes"][1] == {"node_id": "n-onprem", "site": "onprem", "ip": "10.0.0.1", "gpus_total": 4.0,
                                  "gpus_used": 3.0, "cpus_total": 16.0, "cpus_used": 6.0}
    assert record["autoscaler"]["pending_launches"] == {"gpu-cloud": 2}
    assert record["autoscaler"]["pending_nodes"] == [{"ip": "10.0.0.9", "node_type": "gpu-cloud", "state": "setting-up"}]
    assert record["autoscaler"]["pg_demand"] == [{"shape": {"GPU": 1.0}, "count": 3}]
    assert record["workers"] == [{"job_id": "02000000", "node_id": "n-gone", "site": "unknown", "workers": 1},
                                 {"job_id": "02000000", "node_id": "n-onprem", "site": "onprem", "workers": 2}]
    assert status_record(nodes, {}, [])["autoscaler"] is None


# --- submit follows the job -----------------------------------------------------------------------


class FakeJob:
    """What `tidal.launch.jobs.submit` returns, without a cluster: prints `chunks`, ends in `state`."""

    submission_id, address = "raysubmit_x", "http://head:8265"

    def __init__(self, chunks: list[str], state: str, interrupted: bool = False) -> None:
        self.chunks, self.state, self.interrupted, self.stopped = chunks, state, interrupted, False

    def follow(self):
        yield from self.chunks
        if self.interrupted:
            raise KeyboardInterrupt

    def wait(self) -> str:
        return self.state

    def stop(self) -> bool:
        self.stopped = True
        return True


def submit_with(monkeypatch, job: FakeJob, *flags: str) -> int:
    from tidal.launch import jobs

    monkeypatch.setattr(jobs, "submit", lambda spec, address, working_dir: job)
    return main(["submit", str(ROOT / "jobs/quickstart.yaml"), "--address", job.address, *flags])


@pytest.mark.parametrize("state, code", [("SUCCEEDED", 0), ("FAILED", 1), ("STOPPED", 1)])
@pytest.mark.parametrize("flags", [[], ["--follow"]])  # --follow is the default, still accepted
def test_submit_follows_the_job_and_exits_by_its_outcome(monkeypatch, capsys, state, code, flags):
    assert submit_with(monkeypatch, FakeJob(["[tidal] step 1/120\n"], state), *flags) == code
    out = capsys.readouterr().out
    assert "[tidal] step 1/120" in out and out.rstrip().endswith(f"job raysubmit_x {state}")


def test_submit_no_wait_returns_once_submitted(monkeypatch, capsys):
    assert submit_with(monkeypatch, FakeJob(["[tidal] step 1/120\n"], "FAILED"), "--no-wait") == 0
    out = capsys.readouterr().out
    assert "submitted 'quickstart' as raysubmit_x" in out and "step 1/120" not in out


def test_ctrl_c_while_following_leaves_the_job_running(monkeypatch, capsys):
    job = FakeJob(["[tidal] step 1/120\n"], "RUNNING", interrupted=True)
    assert submit_with(monkeypatch, job) == 130
    err = capsys.readouterr().err
    assert not job.stopped and "keeps running" in err
    assert "tidal stop raysubmit_x --address http://head:8265" in err
    assert "tidal logs raysubmit_x --follow --address http://head:8265" in err


def test_tidal_run_counts_the_job_from_its_process_start(monkeypatch, capsys):
    """`tidal run`'s goodput account starts when the command did: its interpreter's start and imports (23 s on a
    loaded machine) are the job's start-up, not outside its wall time, as the benchmarks' clocks see them."""
    import time

    import psutil

    from tidal.launch import trainer

    seen: dict[str, float | None] = {}

    def run(spec, restart=False, wait=False, began=None):
        seen["began"] = began
        return type("Result", (), {"summary": lambda self: "done"})()

    monkeypatch.setattr(trainer, "run", run)
    assert main(["run", str(ROOT / "jobs/quickstart.yaml")]) == 0
    assert seen["began"] == psutil.Process().create_time() < time.time() - 1.0  # pytest's own start, long ago
