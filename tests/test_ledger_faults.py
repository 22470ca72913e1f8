"""The ledger under storage and MLflow faults (tracking/ledger.py), against a real MLflow SQLite
store and the job's real event log: a mark that fails to save once loses no counted event, and an
MLflow that cannot say what it holds is waited for, never taken as "nothing logged"."""

from __future__ import annotations

from tests.conftest import metric_history
from tests.ledger_fakes import Clock, Server, emit, ledger, setup
from tidal.tracking.emitter import Emitter
from tidal.tracking.events import TrackingBack, TrackingDown
from tidal.tracking.ledger import SENT_FILE, retry_delay
from tidal.tracking.writer import RunWriter


class FlakyStore:
    """The job's storage, whose next `fail` writes of the mark raise as a full or gone disk would."""

    def __init__(self, run, fail: int = 1) -> None:
        self.run, self.fail = run, fail

    def read_json(self, rel):
        return self.run.read_json(rel)

    def write_json(self, rel, data):
        if rel == SENT_FILE and self.fail > 0:
            self.fail -= 1
            raise OSError("No space left on device")
        self.run.write_json(rel, data)


class Blind(Server):
    """The real sink, whose `logged_steps` fails while `blind` (a server answering 5xx)."""

    def __init__(self, spec) -> None:
        super().__init__(spec)
        self.blind = False

    def logged_steps(self, run_id, key):
        if self.blind:
            raise ConnectionError("503 Service Unavailable")
        return super().logged_steps(run_id, key)


def fail(spec) -> None:
    """The controller's record of a failed worker group, durable in the log."""
    events = Emitter(spec.checkpoint.storage, spec.name)
    events.failed({1: "killed"})
    assert events.drain(timeout_s=30)


def test_a_failed_mark_save_forgets_no_counted_event(mlflow_uri, tmp_path):
    spec, run, buffer = setup(tmp_path, mlflow_uri, name="mark")
    run_id = RunWriter(spec).start(None)
    server = Server(spec)
    emit(spec, range(1, 4))
    fail(spec)
    first = ledger(spec, run, server, run_id)
    first.store = FlakyStore(run)  # the mark that counts the failure cannot be saved
    first.poll()
    # The tracker dies here and Ray restarts it: the new ledger starts from the log and the mark.
    emit(spec, [4])
    again = ledger(spec, run, server, run_id)
    again.poll()
    assert again.flush() == 0
    assert metric_history(spec, run_id, "restarts")[4] == 1.0, "the failure is still counted"
    assert sorted(metric_history(spec, run_id, "loss")) == [1, 2, 3, 4]


def test_a_failed_mark_save_after_a_send_logs_nothing_twice_and_loses_nothing(mlflow_uri, tmp_path):
    spec, run, buffer = setup(tmp_path, mlflow_uri, name="mark-send")
    run_id = RunWriter(spec).start(None)
    server = Server(spec)
    first = ledger(spec, run, server, run_id)
    first.store = FlakyStore(run, fail=2)  # the poll's save and the flush's save both fail
    emit(spec, range(1, 4))
    fail(spec)
    first.poll()
    assert first.flush() == 0  # sent, but the mark saying so was not saved
    emit(spec, range(4, 6))
    first.poll()  # the store works again: this mark counts everything so far
    assert first.flush() == 0
    assert buffer.load() == [], "everything handled is forgotten once a mark counts it"
    again = ledger(spec, run, server, run_id)
    emit(spec, [6])
    again.poll()
    assert again.flush() == 0
    assert sorted(metric_history(spec, run_id, "loss")) == list(range(1, 7))  # fails on a step twice
    assert metric_history(spec, run_id, "restarts")[6] == 1.0


def test_an_mlflow_that_cannot_say_what_it_holds_is_waited_for(mlflow_uri, tmp_path):
    """A ledger with no mark asks MLflow which steps it holds; unreachable is not "none"."""
    spec, run, buffer = setup(tmp_path, mlflow_uri, name="blind")
    run_id = RunWriter(spec).start(None)
    server, clock, seen = Blind(spec), Clock(), []
    first = ledger(spec, run, server, run_id, clock=clock)
    emit(spec, range(1, 6))
    first.poll()
    assert first.flush() == 0
    run.fs.delete_file(f"{run.path}/{SENT_FILE}")  # a run from before marks, or a mark lost
    # Training resumed from step 3 and replays 4-5 (other values), then trains 6.
    emit(spec, range(4, 7), loss=lambda s: -1.0)
    server.blind = True
    again = ledger(spec, run, server, run_id, clock=clock, printed=seen)
    assert again.poll() == 3 and again.untaken == 3, "nothing taken (all 3 wait) while MLflow cannot say what it holds"
    assert [type(e) for e in seen] == [TrackingDown]
    server.blind = False
    assert again.poll() == 3 and again.untaken == 3, "not asked again before the backoff"
    clock.now += 5.1
    assert again.poll() == 1
    assert again.flush() == 0
    loss = metric_history(spec, run_id, "loss")  # fails on a step logged twice
    assert sorted(loss) == list(range(1, 7)) and loss[4] != -1.0 and loss[6] == -1.0
    assert isinstance(seen[-1], TrackingBack)
    assert buffer.load() == []


def test_retries_back_off_to_a_minute():
    assert [retry_delay(5.0, n) for n in range(6)] == [5.0, 10.0, 20.0, 40.0, 60.0, 60.0]
    assert retry_delay(90.0, 3) == 90.0


def test_the_jobs_last_flush_takes_in_what_waits_in_the_log_backoff_or_not(mlflow_uri, tmp_path):
    """At the job's end the driver flushes with force: events left in the log while MLflow could
    not say what it holds are taken in and sent at once, not after the backoff; while MLflow is
    still blind they count as left, so the driver waits for them instead of ending the run
    without them (seen: a job that outlived an MLflow outage ended with steps 83-400 unsent)."""
    spec, run, buffer = setup(tmp_path, mlflow_uri, name="last-flush")
    run_id = RunWriter(spec).start(None)
    server, clock = Blind(spec), Clock()
    server.blind = True
    led = ledger(spec, run, server, run_id, clock=clock)
    emit(spec, range(1, 6))
    assert led.poll() == 5, "left in the log, and counted"
    assert led.poll(force=True) == 5 and led.untaken == 5, "still blind: still counted as waiting"
    server.blind = False
    assert led.poll() == 5, "the backoff runs: not asked again yet"
    assert led.poll(force=True) == 5 and led.untaken == 0, "forced: asked now, and taken in"
    assert led.flush(force=True) == 0
    assert sorted(metric_history(spec, run_id, "loss")) == [1, 2, 3, 4, 5]
