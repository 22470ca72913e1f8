"""`tidal status/list` and `Job.progress()` read the structured progress a job keeps in its MLflow
run, not its console: reworded progress lines change nothing. No Ray: the Jobs API's answers are
stubbed (a cluster's HTTP API), MLflow is a real SQLite store."""

from __future__ import annotations

import json

from tests.conftest import tiny_spec
from tidal.cli import main
from tidal.launch import jobs
from tidal.output import print_record
from tidal.storage import RunDir
from tidal.testing.processes import free_port
from tidal.tracking.buffer import MetricsBuffer
from tidal.tracking.console import Console
from tidal.tracking.emitter import Emitter
from tidal.tracking.ledger import Ledger
from tidal.tracking.reader import safe_run_url
from tidal.tracking.writer import RunWriter


class Reworded(Console):
    def _metrics(self, e):
        return f"Schritt {e.step} von {self.total}: Verlust={e.values['loss']}"


def test_progress_survives_a_reworded_console(tmp_path, mlflow_uri, capsys, monkeypatch):
    spec = tiny_spec(tmp_path, name="reworded", **{"train.steps": 40, "tracking.uri": mlflow_uri})
    run_id = RunWriter(spec).start(None)
    print_record({"name": spec.name, "tracking_uri": spec.tracking.uri, "experiment": "tests",
                  "mlflow_run_id": run_id, "storage": spec.checkpoint.storage})
    run = RunDir(spec.checkpoint.storage, spec.name)
    ledger = Ledger(MetricsBuffer(run.fs, run.path), run, RunWriter(spec), run_id, subscribers=[Reworded(40)])
    events = Emitter(spec.checkpoint.storage, spec.name)
    for step in (10, 20, 30):
        events.metrics({"step": step, "loss": 4.0 - step / 10, "tokens_per_s": 1234.5, "samples_per_s": 3.0,
                        "mfu": 0.2, "world_size": 2})
    events.drain()
    ledger.poll()
    assert ledger.flush() == 0
    logs = capsys.readouterr().out
    assert "Schritt 30 von 40" in logs and "[tidal] step" not in logs

    want = {"step": 30, "steps": 40, "loss": 1.0, "tokens_per_s": 1234.5, "world_size": 2}
    monkeypatch.setattr(jobs.Job, "logs", lambda self: logs)
    monkeypatch.setattr(jobs.Job, "status", lambda self: "RUNNING")
    assert jobs.Job("raysubmit_1", "http://h:8265").progress() == want

    class Info:
        submission_id, metadata, start_time, runtime_env = "raysubmit_1", {"tidal.job": spec.name}, 1, None
        status = type("S", (), {"value": "RUNNING"})()

    class Client:
        def list_jobs(self):
            return [Info()]

        def get_job_logs(self, sid):
            return logs

        def get_address(self):
            return "http://h:8265"

    monkeypatch.setattr(jobs, "connect", lambda address=None: Client())
    assert main(["list", "--address", "http://h:8265", "--output", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"id": "raysubmit_1", "name": spec.name, "status": "RUNNING",
                                                    "team": None, "priority": None, "start_time": 1, **want}]
    assert main(["status", "raysubmit_1", "--address", "http://h:8265"]) == 0
    assert "step 30/40" in capsys.readouterr().out


class StreamingClient:
    """The Jobs API's answers for a job that printed "abc": the websocket stream breaks after "ab"."""

    def __init__(self) -> None:
        self.tailed = False

    async def tail_job_logs(self, sid):
        self.tailed = True
        yield "a"
        yield "b"
        raise RuntimeError("connection closed before the job ended")

    def get_job_status(self, sid):
        return type("S", (), {"value": "SUCCEEDED"})()

    def get_job_logs(self, sid):
        return "abc"

    def get_job_info(self, sid):  # no other job: Ray 2.60's client says so with a 404
        raise RuntimeError(f"Request failed with status code 404: Job {sid} does not exist.")


def test_follow_streams_and_polls_where_it_cannot(monkeypatch):
    import asyncio

    client = StreamingClient()
    monkeypatch.setattr(jobs, "connect", lambda address=None: client)
    job = jobs.Job("raysubmit_1", "http://h:8265")
    assert list(job.follow(poll_s=0)) == ["a", "b", "c"] and client.tailed, "streamed, then polled from where it broke"

    async def in_a_notebook():  # a running event loop, as in a Jupyter kernel
        return list(job.follow(poll_s=0))

    client.tailed = False
    assert asyncio.run(in_a_notebook()) == ["abc"] and not client.tailed


class LingeringClient(StreamingClient):
    """Ray's stream stays open after the job ended (Ray 2.60 closed it 5-7 s later): here, until the
    follower lets go."""

    async def tail_job_logs(self, sid):
        import asyncio

        self.tailed = True
        yield "a"
        yield "b"
        await asyncio.Event().wait()


def test_follow_ends_with_the_job_not_with_rays_stream(monkeypatch):
    import threading

    client = LingeringClient()
    monkeypatch.setattr(jobs, "connect", lambda address=None: client)
    got: list[str] = []
    follower = threading.Thread(target=lambda: got.extend(jobs.Job("raysubmit_1", "http://h:8265").follow(poll_s=0.05)),
                                daemon=True)
    follower.start()
    follower.join(30)
    assert not follower.is_alive(), "follow waited for Ray to close the stream of a job that had ended"
    assert got == ["a", "b", "c"] and client.tailed, "streamed, then the rest read once the job had ended"


def test_a_runs_link_names_its_store_and_is_the_servers_address_once_the_server_is_gone(tmp_path):
    """The end summary's link (built by the tracker at the job's end): a local store's `mlflow ui` command;
    for a server that no longer answers, its address, without failing the finished job."""
    spec = tiny_spec(tmp_path, name="link")
    assert safe_run_url(spec, "abc") == (f"mlflow ui --backend-store-uri {spec.tracking.uri}   "
                                         "(then open http://127.0.0.1:5000, run abc)")
    gone = tiny_spec(tmp_path, name="link", **{"tracking.uri": f"http://127.0.0.1:{free_port()}"})
    assert safe_run_url(gone, "abc") == gone.tracking.uri
