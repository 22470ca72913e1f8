"""The one call workers and the controller track through: events into the job's durable log.

Rank 0 writes its step metrics, checkpoints, resumes and notes to the event log on the job's
storage itself (tracking/buffer.py), from a background thread, instead of sending them to the
tracker actor. So nothing the tracker does (dying, restarting, waiting on MLflow) can raise
into training or slow a step, and the guarantee that a checkpoint never becomes the resume
point before every step up to it is durable needs no other process: rank 0's checkpoint write
waits, before its manifest, until every event emitted before the save is written (`mark`,
`wait_written`), and the log lives on the same storage as the checkpoint, which survives the
driver. The tracker reads the log, dedupes, sends to MLflow and prints (tracking/ledger.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from tidal import test_hooks
from tidal.lease import LeaseCheck
from tidal.redact import redact_text
from tidal.storage import RunDir
from tidal.tracking.buffer import MetricsBuffer
from tidal.tracking.events import (
    CheckpointSaved,
    Event,
    GroupEnding,
    GroupStarted,
    HangFound,
    Note,
    Resumed,
    StepMetrics,
    WorkersFailed,
)

log = logging.getLogger("tidal")
NOT_METRICS = ("step", "preempted")
LEDGER_FIELDS: dict[type[Event], tuple[str, ...]] = {StepMetrics: ("replay",), CheckpointSaved: ("replay",),
                                                     Resumed: ("lost",), WorkersFailed: ("restarts", "reported")}
ONLY_WHEN_SET: dict[type[Event], tuple[str, ...]] = {WorkersFailed: ("final", "in_place")}


def metric_values(m: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics dict, as MLflow takes them."""
    return {k: float(v) for k, v in m.items() if k not in NOT_METRICS and isinstance(v, (int, float))}


class Emitter:
    """Writes events to `<storage>/<name>/tidal-mlflow-buffer/` in order, off the caller's thread."""

    def __init__(self, storage: str, name: str, retry_s: float = 1.0, fence: LeaseCheck | None = None) -> None:
        run = RunDir(storage, name)
        self.buffer, self.retry_s = MetricsBuffer(run.fs, run.path), retry_s
        # The job's log is its lease holder's: once a newer start holds it, this attempt's events
        # are dropped (that start trains these steps again from its resume point, and logs them once).
        self.fence = fence
        self.queue: queue.Queue[dict[str, Any]] = queue.Queue()
        self.done = threading.Condition()
        self.emitted = self.written = 0  # events so far, and how many of the first are durable (in order)
        self.delay = _write_delay(test_hooks.read(test_hooks.EVENT_WRITE_DELAY))  # tests only: a lagging log
        threading.Thread(target=self._write_loop, name="tidal-events", daemon=True).start()

    # --- what workers say ---------------------------------------------------------------
    def metrics(self, m: dict[str, Any]) -> None:
        self._emit(StepMetrics(int(m["step"]), metric_values(m)))

    def checkpointed(self, step: int, m: dict[str, float]) -> None:
        self._emit(CheckpointSaved(step, metric_values(m)))

    def resumed(self, checkpoint: str, step: int, old_world: int, world: int) -> None:
        self._emit(Resumed(step, checkpoint, old_world, world))

    def started(self, step: int, world: int, setup_s: float, restore_s: float) -> None:
        self._emit(GroupStarted(step, {"world": float(world), "setup_s": setup_s, "restore_s": restore_s}))

    def ending(self, step: int, reason: str) -> None:
        self._emit(GroupEnding(step, reason))

    def say(self, message: str, step: int = 0) -> None:
        self._emit(Note(step, message))

    def failed(self, failures: dict[int, str], step: int = 0, final: bool = False, in_place: bool = False) -> None:
        self._emit(WorkersFailed(step, {str(r): why for r, why in failures.items()}, final, in_place=in_place))

    def hang_found(self, step: int, folder: str, culprits: list[int], text: str, stalled_s: float = 0.0) -> None:
        self._emit(HangFound(step, folder, culprits, text, stalled_s))

    def mark(self) -> int:
        """A mark for `wait_written`: the events emitted so far."""
        with self.done:
            return self.emitted

    def wait_written(self, mark: int, timeout_s: float | None = None) -> bool:
        """Block until the events emitted before `mark` are durable; False if `timeout_s` passed first.

        Events emitted after the mark do not hold it: a checkpoint's write waits for the steps
        up to its own, not for the steps trained while it was being written. Without a timeout
        this waits as long as storage refuses writes: the checkpoint it holds back could not be
        saved to that storage either.
        """
        with self.done:
            return self.done.wait_for(lambda: self.written >= mark, timeout=timeout_s)

    def drain(self, timeout_s: float | None = None) -> bool:
        """Block until every event emitted so far is durable; False if `timeout_s` passed first."""
        return self.wait_written(self.mark(), timeout_s)

    # --- the writer thread --------------------------------------------------------------
    def _emit(self, event: Event) -> None:
        entry = event.entry()
        # Fields only the ledger sets stay out of the log, which keeps its format.
        for key in LEDGER_FIELDS.get(type(event), ()):
            entry.pop(key)
        for key in ONLY_WHEN_SET.get(type(event), ()):  # and a flag that is off, as the log held it before
            if not entry[key]:
                entry.pop(key)
        with self.done:
            self.emitted += 1
            self.queue.put({**entry, "ts": int(time.time() * 1000)})  # under the lock: queued in count order

    def _write_loop(self) -> None:
        while True:
            event = self.queue.get()
            warned = False
            if self.delay[0] and int(event.get("step", 0)) <= self.delay[1]:
                time.sleep(self.delay[0])
            while self.fence is None or self.fence.current():
                try:
                    self.buffer.append(event)
                    break
                except OSError as e:  # storage hiccup: keep the event and try again; never give up on it
                    if not warned:
                        log.warning("[tidal] could not write a tracking event to %s (%s); retrying",
                                    redact_text(self.buffer.path), redact_text(str(e)))
                        warned = True
                    time.sleep(self.retry_s)
            with self.done:
                self.written += 1
                self.done.notify_all()


def _write_delay(value: str) -> tuple[float, int]:
    """test_hooks.EVENT_WRITE_DELAY's `S:STEP`: (seconds, up to which step); (0, 0) when unset."""
    seconds, _, step = value.partition(":")
    return (float(seconds), int(step)) if seconds and step else (0.0, 0)
