"""The tracking core without Ray (tracking/ledger.py): against a real MLflow SQLite store, with the
job's event log on its storage and a fake clock. Seconds in all."""

from __future__ import annotations

import threading

import pytest

from tests.conftest import metric_history
from tests.helpers import STORAGES
from tests.ledger_fakes import STEP, Clock, Server, emit, ledger, setup
from tidal.storage import RunDir
from tidal.tracking.emitter import Emitter
from tidal.tracking.events import Resumed, StepMetrics, TrackingDown
from tidal.tracking.ledger import SENT_FILE
from tidal.tracking.writer import RunWriter


def test_a_replayed_step_is_logged_once_across_restarts_of_training_and_tracker(mlflow_uri, tmp_path):
    spec, run, buffer = setup(tmp_path, mlflow_uri)
    run_id = RunWriter(spec).start(None)
    server, seen = Server(spec), []
    first = ledger(spec, run, server, run_id, printed=seen)
    emit(spec, range(1, 7), checkpoints=(4,))
    first.poll()
    assert first.flush() == 0
    # Training resumes from the checkpoint at 4 and replays 5-6 with other values; the tracker
    # itself was restarted in between (a new ledger from the mark and the log).
    events = Emitter(spec.checkpoint.storage, spec.name)
    events.resumed("checkpoint_000000004", 4, 2, 2)
    events.drain()
    emit(spec, range(5, 9), loss=lambda s: -1.0, checkpoints=(8,))
    second = ledger(spec, run, server, run_id, printed=seen)
    second.poll()
    assert second.flush() == 0

    loss = metric_history(spec, run_id, "loss")  # fails on any step logged twice
    assert sorted(loss) == list(range(1, 9))
    assert loss[5] == pytest.approx(9.5) and loss[7] == -1.0, "the first value of a step stands"
    assert sorted(metric_history(spec, run_id, "checkpoint_bytes")) == [4, 8]
    assert metric_history(spec, run_id, "steps_lost") == {**dict.fromkeys(range(1, 7), 0.0), 7: 2.0, 8: 2.0}
    assert buffer.load() == [], "everything handled is forgotten"
    assert [e.step for e in seen if isinstance(e, StepMetrics) and e.replay] == [5, 6]
    assert any(isinstance(e, Resumed) and e.lost == 2 for e in seen)


@pytest.mark.parametrize("where", STORAGES)
def test_a_crash_between_append_and_send_loses_nothing_and_sends_nothing_twice(mlflow_uri, tmp_path, where, request):
    storage = str(tmp_path / "runs") if where == "local" else request.getfixturevalue("bucket") + "/runs"
    spec, run, buffer = setup(tmp_path, mlflow_uri, **{"checkpoint.storage": storage})
    run_id = RunWriter(spec).start(None)
    server = Server(spec)
    emit(spec, range(1, 4))
    crashed = ledger(spec, run, server, run_id)
    crashed.poll()  # read, never sent: the process died here
    emit(spec, range(4, 7))
    # Another life sent steps 1-3 and died before recording it (no mark) or forgetting them.
    server.send(run_id, [e for e in buffer.load() if e["step"] <= 3])
    assert run.read_json(SENT_FILE) is None or run.read_json(SENT_FILE).get("step") is None

    again = ledger(spec, run, server, run_id)
    again.poll()
    assert again.flush() == 0
    assert sorted(metric_history(spec, run_id, "loss")) == list(range(1, 7))
    assert sorted(metric_history(spec, run_id, "tokens_per_s")) == list(range(1, 7))
    assert buffer.load() == []


@pytest.mark.slow
def test_points_batch_up_behind_a_slow_server(mlflow_uri, tmp_path):
    spec, run, _ = setup(tmp_path, mlflow_uri)
    run_id = RunWriter(spec).start(None)
    server = Server(spec)
    server.gate = threading.Event()
    core = ledger(spec, run, server, run_id)
    emit(spec, [1])
    core.poll()
    sending = threading.Thread(target=core.flush)
    sending.start()  # stuck in the server for as long as the gate is shut
    emit(spec, range(2, 152))  # training goes on meanwhile: 150 steps reach the durable log
    server.gate.set()
    sending.join()
    core.poll()
    assert core.flush() == 0
    values = len(STEP) + 4  # the step's metrics and the four fault counters
    assert server.batches == [1, 1000 // values, 150 - 1000 // values], "whole steps, at most 1000 metrics a batch"
    assert sorted(metric_history(spec, run_id, "loss")) == list(range(1, 152))


def test_a_server_down_longer_than_the_job_gets_everything_at_the_next_launch(mlflow_uri, tmp_path):
    spec, run, buffer = setup(tmp_path, mlflow_uri)
    clock, seen = Clock(), []
    server = Server(spec, down=True)
    core = ledger(spec, run, server, None, clock=clock, printed=seen)  # MLflow was down when the job started
    emit(spec, range(1, 6), checkpoints=(5,))
    core.poll()
    assert core.flush() == 6 and server.attempts == 1
    assert [type(e) for e in seen].count(TrackingDown) == 1
    clock.now += 4.9
    assert core.flush() == 6 and server.attempts == 1, "no retry before retry_s"
    clock.now += 0.2
    emit(spec, range(6, 11))
    core.poll()
    assert core.flush() == 11 and server.attempts == 2
    assert core.flush(force=True) == 11 and server.attempts == 3, "the driver's last try at the job's end"
    assert len(buffer.load()) == 11, "the job ended with every point still in the durable log"

    server.down = False  # MLflow is back when the job runs again
    later = ledger(spec, run, server, None, clock=clock)
    later.poll()
    assert later.flush() == 0
    run_id = later.run_id
    assert run_id and RunDir(spec.checkpoint.storage, spec.name).read_json("tidal-job.json")["mlflow_run_id"] == run_id
    assert sorted(metric_history(spec, run_id, "loss")) == list(range(1, 11))
    assert sorted(metric_history(spec, run_id, "checkpoint_bytes")) == [5]
    assert buffer.load() == []


def test_counters_and_latest_values_survive_a_tracker_restart(mlflow_uri, tmp_path):
    spec, run, _ = setup(tmp_path, mlflow_uri)
    run_id = RunWriter(spec).start(None)
    server = Server(spec)
    emit(spec, range(1, 4))
    Emitter(spec.checkpoint.storage, spec.name).failed({1: "killed"})
    first = ledger(spec, run, server, run_id)
    first.poll()
    first.flush()
    emit(spec, [4])
    again = ledger(spec, run, server, run_id)  # the tracker was killed and restarted by Ray
    again.poll()
    again.flush()
    assert metric_history(spec, run_id, "restarts")[4] == 1.0
    assert again.latest["loss"] == pytest.approx(9.6)
