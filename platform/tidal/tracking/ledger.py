"""The tracking core, free of Ray: which steps MLflow holds, and getting the rest there once.

Events come from the job's durable log (tracking/buffer.py; rank 0 and the controller write
it, tracking/emitter.py). `poll` reads the new ones, drops a step already logged (a step
replayed after a restart), counts restarts, resizes and lost steps, and tells subscribers
(the console) as typed events (tracking/events.py). `flush` sends what is pending to a `Sink` (MLflow) in
batches, retries an unreachable sink after `retry_s` (doubling, up to a minute), and forgets
events only after a saved mark records how far the sink holds the run and the counters (the
mark, `tidal-mlflow-sent.json`), so a ledger that dies at any point is replaced by one that
sends the rest once and nothing twice.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from tidal.goodput import account
from tidal.goodput.report import live_metrics
from tidal.redact import redact_text
from tidal.tracking.buffer import MetricsBuffer
from tidal.tracking.events import (
    CheckpointSaved,
    Event,
    Note,
    Resized,
    Resumed,
    StepMetrics,
    TrackingBack,
    TrackingDown,
    WorkersFailed,
    parse,
)

SENT_FILE = "tidal-mlflow-sent.json"  # beside the buffer: how far MLflow holds the run, and the counters
SENT_KINDS = {"metrics": "step", "checkpoint": "checkpoint_step"}  # kind -> its key in the mark
COUNTERS = ("restarts", "resizes", "steps_lost", "max_steps_lost")
Subscriber = Callable[[Event], None]


class Sink(Protocol):
    """Where points end up (MLflow): one run, steps as given."""

    def open(self, run_id: str | None) -> str:
        """The run to send to, created now if `run_id` is None."""

    def send(self, run_id: str, entries: list[dict[str, Any]]) -> None:
        """Store `entries` whole or not at all (MLflow's log_batch is one transaction)."""

    def logged_steps(self, run_id: str, key: str) -> set[int]:
        """Steps at which the run holds `key`."""


class Store(Protocol):
    def read_json(self, rel: str) -> dict[str, Any] | None: ...
    def write_json(self, rel: str, data: dict[str, Any]) -> None: ...


def kind_of(entry: dict[str, Any]) -> str:
    """An entry's kind; entries written before kinds existed were metrics or checkpoints."""
    return entry.get("kind") or ("checkpoint" if "checkpoint_bytes" in entry["values"] else "metrics")


class Ledger:
    def __init__(self, buffer: MetricsBuffer, store: Store, sink: Sink, run_id: str | None,
                 subscribers: list[Subscriber] | None = None, retry_s: float = 5.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.buffer, self.store, self.sink, self.run_id = buffer, store, sink, run_id
        self.subscribers, self.retry_s, self.clock = list(subscribers or []), retry_s, clock
        mark = store.read_json(SENT_FILE) or {}
        self.mark = mark if run_id and mark.get("run_id") == run_id else {"run_id": run_id}
        # Highest step accepted per kind (pending or sent); None until known (the mark, or MLflow).
        self.high: dict[str, int | None] = {k: self.mark.get(key) for k, key in SENT_KINDS.items()}
        self.counters = {k: float(self.mark.get("counters", {}).get(k, 0.0)) for k in COUNTERS}
        self.reported = int(self.mark.get("reported_step", 0))  # highest step trained, replays included
        self.world_size: int | None = self.mark.get("world_size")
        self.latest: dict[str, float] = dict(self.mark.get("latest", {}))
        # Where the job's wall time went (tidal/goodput), kept in the mark: the events it came from
        # are forgotten once handled, so the account is built as they are read, never re-read.
        self.goodput = account.State.load(self.mark.get("goodput"))
        self.keeps_account = account.kept()
        self.failed_since_resume = False
        self.pending: list[dict[str, Any]] = []
        self.known: set[str] = set()  # ids read and still in the buffer
        self.read_whole_log = False
        self.recovered: set[str] | None = None  # ids an earlier ledger left: some may be in MLflow
        self.retry_at, self.down_since, self.failures = 0.0, None, 0
        self.unsaved: list[dict[str, Any]] = []  # handled, but the mark that counts them failed to save
        self.untaken = 0  # events the last poll left in the log (the sink could not say what it holds)
        self.lock = threading.RLock()  # one poll or flush at a time

    # --- reading the log ----------------------------------------------------------------
    def poll(self, force: bool = False) -> int:
        """Take in new events; returns how many wait to be sent, those left in the log included.
        `force` asks the sink now even while its backoff runs (the job's end: nothing comes later)."""
        with self.lock:
            new = self.buffer.load(self.known)
            if not self.read_whole_log:  # this ledger's first read is the whole log: an id it lacks was dropped
                account.forget(self.goodput, self.goodput.seen - {e["id"] for e in new})
                self.read_whole_log = True
            self.untaken = 0
            if not self._learn_highs(new, force):
                self.untaken = len(new)  # left in the log: read again once the sink answers
                return len(self.pending) + self.untaken
            if self.recovered is None:
                self.recovered = {e["id"] for e in new}
            for e in sorted(new, key=happened):
                self.known.add(e["id"])
                if self.keeps_account:
                    account.fold(self.goodput, {**e, "kind": kind_of(e)})
                if not self._take(e):
                    self.unsaved.append(e)
            # Counters first: a handled event is forgotten only once a saved mark counts it, else
            # a ledger that replaced this one would have neither the event nor its count.
            if (new or self.unsaved) and self._save_mark():
                self._forget(self.unsaved)
                self.unsaved = []
            return len(self.pending)

    def _take(self, e: dict[str, Any]) -> bool:
        """Handle one log entry; True if it waits to be sent (the entry as stored: the sink's input)."""
        event = parse({**e, "kind": kind_of(e)})
        match event:
            case StepMetrics() | CheckpointSaved():
                return self._take_point(e, event)
            case Resumed():
                lost = max(0, self.reported - event.step)
                self.counters["steps_lost"] += lost
                self.counters["max_steps_lost"] = max(self.counters["max_steps_lost"], lost)
                self.notify(dataclasses.replace(event, lost=lost))
            case WorkersFailed():
                if not event.final:  # the failure Ray Train gives up on restarts nothing
                    self.counters["restarts"] += 1
                self.failed_since_resume = True
                self.notify(dataclasses.replace(event, restarts=self.counters["restarts"], reported=self.reported))
            case None:
                pass  # a kind this Tidal does not know (a newer writer's): nothing to count or say
            case _:
                self.notify(event)
        return False

    def _take_point(self, e: dict[str, Any], event: StepMetrics | CheckpointSaved) -> bool:
        """A step's metrics or a checkpoint's figures: sent unless the sink holds that step already
        (a step replayed after a restart is said, as a replay, but never sent twice)."""
        kind = event.KIND
        if isinstance(event, StepMetrics):
            self._note_world_size(event.step, int(event.values.get("world_size", 0)))
            self.reported = max(self.reported, event.step)
        self.latest.update(event.values)
        fresh = event.step > self._high(kind)
        self.notify(dataclasses.replace(event, replay=not fresh))
        if fresh:
            self.high[kind] = event.step
            values = ({**event.values, **self.counters, **live_metrics(self.goodput)} if isinstance(event, StepMetrics)
                      else event.values)
            self.pending.append({**e, "values": values})
        return fresh

    def _note_world_size(self, step: int, world: int) -> None:
        """Count every change of world size, whether or not a checkpoint was there to resume from."""
        if world and self.world_size and world != self.world_size:
            self.counters["resizes"] += 1
            self.notify(Resized(step, self.world_size, world, self.failed_since_resume))
        if world and world != self.world_size:
            self.failed_since_resume = False
        self.world_size = world or self.world_size

    def _learn_highs(self, new: list[dict[str, Any]], force: bool = False) -> bool:
        """Know the highest step the sink holds of each kind among `new` before taking any of
        them; False while the sink cannot say (the events wait in the log, asked again after the
        backoff). Taking "unreachable" as "nothing logged" would send a replayed step twice."""
        unknown = {kind_of(e) for e in new} & {k for k, v in self.high.items() if v is None}
        if not unknown or not self.run_id:  # no run yet: nothing of it can be logged
            self.high.update(dict.fromkeys(unknown, 0))
            return True
        if not force and self.clock() < self.retry_at:
            return False
        try:
            for kind in unknown:  # no mark (a run from before marks, or none sent yet): ask MLflow
                key = "loss" if kind == "metrics" else "checkpoint_bytes"
                self.high[kind] = max(self.sink.logged_steps(self.run_id, key), default=0)
        except Exception as e:  # noqa: BLE001 - any sink failure leaves training running; retried later
            self._sink_failed(e)
            return False
        return True

    def _high(self, kind: str) -> int:
        return int(self.high[kind] or 0)  # known: _learn_highs ran first

    # --- sending ------------------------------------------------------------------------
    def flush(self, force: bool = False) -> int:
        """Send pending points unless the sink's backoff is running (`force` tries now);
        returns the points left unsent."""
        with self.lock:
            todo = list(self.pending)
            if not todo or (not force and self.clock() < self.retry_at):
                return len(todo)
            sent = 0
            try:
                self.run_id = self.sink.open(self.run_id)
                self.mark["run_id"] = self.run_id
                todo = self._skip_recovered(todo)
                while sent < len(todo):
                    chunk = batch(todo[sent:])
                    self.sink.send(self.run_id, chunk)
                    sent += len(chunk)
            except Exception as e:  # noqa: BLE001 - any sink failure leaves training running; retried later
                self._sink_failed(e)
            done = todo[:sent]
            ids = {e["id"] for e in done}
            self.pending = [e for e in self.pending if e["id"] not in ids]
            for e in done:
                key = SENT_KINDS[kind_of(e)]
                self.mark[key] = max(int(self.mark.get(key) or 0), int(e["step"]))
            # The mark goes first: an entry forgotten without it would be sent again after a crash.
            self.unsaved += done
            if done and self._save_mark():
                self._forget(self.unsaved)
                self.unsaved = []
            if sent == len(todo):
                self.failures = 0
            if self.down_since is not None and sent == len(todo):
                self.notify(TrackingBack(self.clock() - self.down_since, sent))
                self.down_since = None
            return len(self.pending)

    def finish_goodput(self, now: float | None) -> account.State:
        """Close the goodput account at the job's (this launch's) end and keep it in the mark;
        `now` None: nothing ran in this launch (a finished job run again), so the account ends at
        its last event, not with the idle time since."""
        with self.lock:
            account.finish(self.goodput, self.goodput.cursor if now is None else now)
            self._save_mark()
            return self.goodput

    def _sink_failed(self, e: Exception) -> None:
        """Wait before the next try, twice as long after each failure in a row (up to MAX_RETRY_S),
        and say once that the sink is down."""
        self.retry_at = self.clock() + retry_delay(self.retry_s, self.failures)
        self.failures += 1
        if self.down_since is None:
            self.down_since = self.clock()
            self.notify(TrackingDown(type(e).__name__, self.buffer.path))

    def _skip_recovered(self, todo: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Entries an earlier ledger sent but died before forgetting: the sink has their step already.

        A batch reaches the sink whole or not at all, so checking each entry's first metric is enough.
        """
        candidates = [e for e in todo if e["id"] in (self.recovered or ())]
        if not candidates:
            return todo
        logged: dict[str, set[int]] = {}
        done = []
        for e in candidates:
            if int(e["step"]) <= int(self.mark.get(SENT_KINDS[kind_of(e)]) or 0):  # sent and marked
                done.append(e)
                continue
            key = next(iter(e["values"]), None)
            if key is not None and key not in logged:
                logged[key] = self.sink.logged_steps(self.run_id, key)
            if key is None or int(e["step"]) in logged[key]:
                done.append(e)
        self.recovered = set()
        ids = {e["id"] for e in done}
        self.pending = [e for e in self.pending if e["id"] not in ids]
        self._forget(done)
        return [e for e in todo if e["id"] not in ids]

    # --- the mark and the log -----------------------------------------------------------
    def _save_mark(self) -> bool:
        """Record how far the sink holds the run, the counters and the latest values; False if
        storage refused (entries stay buffered, and a later ledger dedupes them against the sink)."""
        self.mark.update({"counters": self.counters, "reported_step": self.reported,
                          "world_size": self.world_size, "latest": self.latest, "goodput": self.goodput.dump()})
        try:
            self.store.write_json(SENT_FILE, self.mark)
            return True
        except OSError as e:
            self.notify(Note(0, f"WARNING: could not record sent metrics: {e}"))
            return False

    def _forget(self, entries: list[dict[str, Any]]) -> None:
        try:
            self.buffer.forget(entries)
        except OSError:  # left in the log: a later poll or ledger finds them handled (by the mark)
            return
        ids = {e["id"] for e in entries}
        self.known -= ids
        account.forget(self.goodput, ids)  # out of the log: no re-read can bring them back

    def notify(self, event: Event) -> None:
        for subscriber in self.subscribers:
            try:
                subscriber(event)
            except Exception as e:  # noqa: BLE001 - a broken printer or status file must not stop tracking
                print(redact_text(f"[tidal] WARNING: tracking subscriber {subscriber!r} failed: {e}"), flush=True)


MAX_RETRY_S = 60.0


def retry_delay(retry_s: float, failures: int) -> float:
    """The wait after `failures` earlier failures in a row: retry_s, doubling, at most MAX_RETRY_S."""
    return min(retry_s * 2 ** min(failures, 16), max(retry_s, MAX_RETRY_S))


def happened(entry: dict[str, Any]) -> tuple[int, str]:
    """When an event happened: its time in ms, then the write time in ns its id holds (buffer.py)."""
    parts = entry["id"].split("-")
    return int(entry["ts"]), parts[1] if len(parts) == 3 else ""


def batch(entries: list[dict[str, Any]], limit: int = 1000) -> list[dict[str, Any]]:
    """The longest prefix of whole steps within MLflow's 1000-metrics-per-batch limit."""
    n = total = 0
    for e in entries:
        total += len(e["values"])
        if total > limit and n:
            break
        n += 1
    return entries[:n]
