"""The durable event log and the mark beside it, as a new tracker finds them. No Ray."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import metric_history, tiny_spec
from tidal.storage import RunDir
from tidal.tracking.buffer import MetricsBuffer
from tidal.tracking.emitter import Emitter
from tidal.tracking.ledger import SENT_FILE, Ledger
from tidal.tracking.tracker import Tracker
from tidal.tracking.writer import RunWriter

STEP = {"loss": 1.0, "tokens_per_s": 1.0, "samples_per_s": 1.0, "mfu": 0.1, "world_size": 2}


def test_a_new_tracker_knows_what_mlflow_holds_while_mlflow_is_down(tmp_path):
    """The mark beside the log says how far MLflow holds the run, so steps replayed after a
    restart are not sent again even when MLflow cannot be asked."""
    spec = tiny_spec(tmp_path, name="down", **{"tracking.uri": "http://127.0.0.1:9"})  # nothing listens there
    run = RunDir(spec.checkpoint.storage, spec.name)
    run.write_json(SENT_FILE, {"run_id": "r" * 32, "step": 5, "checkpoint_step": 4})
    events = Emitter(spec.checkpoint.storage, spec.name)
    for step in (4, 5, 6):  # resumed from the checkpoint at 4: 5 is a replay, 6 is new
        events.metrics({"step": step, **STEP})
    events.checkpointed(4, {"checkpoint_bytes": 1.0, "checkpoint_save_s": 0.1, "checkpoint_blocked_s": 0.1})
    events.drain()

    ledger = Ledger(MetricsBuffer(run.fs, run.path), run, RunWriter(spec), "r" * 32, retry_s=60)
    assert ledger.poll() == 1
    assert [e["step"] for e in ledger.pending] == [6]
    assert [e["step"] for e in MetricsBuffer(run.fs, run.path).load()] == [6], "the replays are forgotten"


def test_running_a_finished_job_again_sends_what_an_earlier_driver_left(tmp_path, mlflow_uri):
    """What `tidal run` does for a complete job (launch/trainer.py `_complete`): a tracker in the
    driver's own process, no thread, sends the log and closes."""
    spec = tiny_spec(tmp_path, name="leftover", **{"tracking.uri": mlflow_uri})
    run_id = RunWriter(spec).start(None)
    events = Emitter(spec.checkpoint.storage, spec.name)
    for step in (1, 2, 3):
        events.metrics({"step": step, **STEP, "loss": 5.0 - step})
    events.drain()

    got_id, latest, left = Tracker(spec, system_metrics=False, background=False).close(True, 1.0)
    assert (got_id, left, latest["loss"]) == (run_id, 0, 2.0), "the tracker reopens the run the job file names"
    assert metric_history(spec, run_id, "loss") == {1: 4.0, 2: 3.0, 3: 2.0}
    closed = MlflowClient(mlflow_uri).get_run(run_id)
    assert closed.info.status == "FINISHED"
    assert "summary.json" in {a.path for a in MlflowClient(mlflow_uri).list_artifacts(run_id)}
    run = RunDir(spec.checkpoint.storage, spec.name)
    assert MetricsBuffer(run.fs, run.path).load() == []


@pytest.mark.slow
def test_storage_refusing_writes_never_raises_into_training_and_holds_the_checkpoint_wait(tmp_path):
    """Rank 0's emitter keeps an event it cannot write and retries; `drain` (the wait before a
    checkpoint) says so instead of raising, and succeeds once storage takes writes again."""
    blocker = tmp_path / "runs"
    blocker.write_text("a file where the run folder should be")
    events = Emitter(str(blocker), "job", retry_s=0.05)
    events.metrics({"step": 1, **STEP})  # returns at once, whatever storage does
    assert events.drain(timeout_s=0.5) is False
    blocker.unlink()
    assert events.drain(timeout_s=30) is True
    run = RunDir(str(blocker), "job")
    assert [e["step"] for e in MetricsBuffer(run.fs, run.path).load()] == [1]


@pytest.mark.slow
def test_a_checkpoints_wait_covers_the_events_before_it_not_those_after(tmp_path):
    """The checkpoint's write waits for the steps up to its own (`mark`, `wait_written`), not for
    the steps trained while it is written: with storage refusing a later event, the earlier
    ones' wait returns while a full drain does not."""
    storage = tmp_path / "runs"
    events = Emitter(str(storage), "job", retry_s=0.05)
    events.metrics({"step": 1, **STEP})
    mark = events.mark()
    assert events.wait_written(mark, timeout_s=30)
    log = RunDir(str(storage), "job")
    folder = storage / "job"
    folder.rename(tmp_path / "aside")
    folder.write_text("a file where the run folder should be")  # storage now refuses writes
    events.metrics({"step": 2, **STEP})
    assert events.wait_written(mark, timeout_s=0.5) is True
    assert events.drain(timeout_s=0.5) is False
    folder.unlink()
    (tmp_path / "aside").rename(folder)
    assert events.drain(timeout_s=30) is True
    assert [e["step"] for e in MetricsBuffer(log.fs, log.path).load()] == [1, 2]
