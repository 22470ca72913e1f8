"""A transient MLflow error while a job's run is reopened must not split the job into two runs.

A real `mlflow server` on 127.0.0.1 behind a fault-injecting proxy (http.server forwarding every
request, answering 503 to the first N `runs/update` calls while armed), driving the real tracker,
ledger and writer: the tracker restarted while the server fails keeps the job's run, and the
job ends with one run holding every step once."""

from __future__ import annotations

import http.server
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from tests.conftest import metric_history, mlflow_server, tiny_spec
from tests.ledger_fakes import emit
from tidal.storage import JOB_FILE, RunDir
from tidal.tracking.tracker import Tracker
from tidal.tracking.writer import RunWriter, run_is_gone

pytestmark = pytest.mark.slow


class FaultyProxy(http.server.ThreadingHTTPServer):
    """Forwards to `upstream`; answers 503 to the next `fail` requests whose path has `match`."""

    def __init__(self, upstream: str) -> None:
        self.upstream, self.fail, self.match, self.failed = upstream, 0, "runs/update", []
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), Handler)

    def should_fail(self, path: str) -> bool:
        with self.lock:
            if self.fail > 0 and self.match in path:
                self.fail -= 1
                self.failed.append(path)
                return True
            return False


class Handler(http.server.BaseHTTPRequestHandler):
    server: FaultyProxy

    def log_message(self, *args) -> None:  # quiet
        pass

    def _forward(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) or None
        if self.server.should_fail(self.path):
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
        req = urllib.request.Request(self.server.upstream + self.path, data=body, headers=headers,
                                     method=self.command)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                status, data, ctype = r.status, r.read(), r.headers.get("Content-Type", "application/json")
        except urllib.error.HTTPError as e:
            status, data, ctype = e.code, e.read(), e.headers.get("Content-Type", "application/json")
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PATCH = do_DELETE = _forward


@pytest.fixture(scope="module")
def server_uri(tmp_path_factory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("mlflow-server")
    with mlflow_server(tmp, str(tmp / "artifacts")) as uri:
        yield uri


@pytest.fixture
def proxy(server_uri, monkeypatch) -> Iterator[FaultyProxy]:
    # MLflow's client retries a 5xx itself 7 times over about two minutes; the first answer is enough here.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    server = FaultyProxy(server_uri)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): tracker faults run in test_tracking_restart; reopening is unit-tested
def test_a_503_while_the_run_is_reopened_keeps_the_job_in_one_run(proxy, tmp_path):
    uri = f"http://127.0.0.1:{proxy.server_address[1]}"
    spec = tiny_spec(tmp_path, name="reopen", **{"tracking.uri": uri, "tracking.experiment": "reopen"})
    run_dir = RunDir(spec.checkpoint.storage, spec.name)

    first = Tracker(spec, system_metrics=False, background=False)
    run_id = first.run_id()
    emit(spec, range(1, 6))
    assert first.flush(force=True) == 0
    # The tracker dies here (its actor is restarted by Ray) while the server answers 503.
    proxy.fail = 2
    second = Tracker(spec, system_metrics=False, background=False)
    assert proxy.failed, "the fault was injected"
    assert second.run_id() == run_id
    assert run_dir.read_json(JOB_FILE)["mlflow_run_id"] == run_id, "the job file still names the job's run"
    emit(spec, range(6, 11))
    # The next send reopens the run; the second 503 meets that, and the points wait in the log.
    assert second.flush(force=True) == 5
    assert second.flush(force=True) == 0
    second.close(ok=True, wall_s=1.0)

    c = MlflowClient(uri)
    runs = c.search_runs([c.get_experiment_by_name("reopen").experiment_id])
    assert [r.info.run_id for r in runs] == [run_id], "one run for the job"
    assert sorted(metric_history(spec, run_id, "loss")) == list(range(1, 11))
    assert c.get_run(run_id).info.status == "FINISHED"


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): the 503 test above covers reopening
def test_only_a_missing_run_counts_as_gone(proxy, tmp_path, mlflow_uri):
    """How MLflow 3.17 reports a missing run, from a server and from a SQLite store, and a 503."""
    for tracking in (f"http://127.0.0.1:{proxy.server_address[1]}", mlflow_uri):
        with pytest.raises(MlflowException) as missing:
            MlflowClient(tracking).update_run("0" * 32, status="RUNNING")
        assert run_is_gone(missing.value), (tracking, missing.value.error_code)
    spec = tiny_spec(tmp_path, name="gone", **{"tracking.uri": f"http://127.0.0.1:{proxy.server_address[1]}"})
    run_id = RunWriter(spec).start(None)
    proxy.fail = 1
    with pytest.raises(MlflowException) as busy:
        RunWriter(spec).start(run_id)
    assert not run_is_gone(busy.value)
    # A run really gone is replaced, and the job file names the new one.
    MlflowClient(spec.tracking.uri).delete_run(run_id)
    new = RunWriter(spec).start(run_id)
    assert new != run_id and RunDir(spec.checkpoint.storage, spec.name).read_json(JOB_FILE)["mlflow_run_id"] == new
