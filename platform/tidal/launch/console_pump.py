"""The driver prints the tracker's `[tidal]` lines itself (tidal.tracking.console.HeldLines says
why): a thread asks the tracker actor for them every `every_s` and prints them as they came.

The driver is the process a person watches, for `tidal run` and for `ray job submit -- tidal run`
alike, so its stdout is where the lines belong.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from tidal.redact import redact_text


class ConsolePump:
    def __init__(self, tracker: Any, every_s: float = 0.5, out: Callable[[str], None] | None = None) -> None:
        self.tracker, self.every_s = tracker, every_s
        self.out = out or (lambda line: print(line, flush=True))
        self.stopped = threading.Event()
        self.lock = threading.Lock()  # the last drain (stop) and the thread's never print the same batch twice
        self.thread = threading.Thread(target=self._loop, daemon=True, name="tidal-console")

    def start(self) -> ConsolePump:
        self.thread.start()
        return self

    def drain(self, timeout_s: float = 10.0) -> None:
        """Print what the tracker holds now; a tracker that is gone or slow only costs its lines
        (they are for people: the event log and MLflow keep the record)."""
        import ray

        with self.lock:
            try:
                lines = ray.get(self.tracker.take_lines.remote(), timeout=timeout_s)
            except (ray.exceptions.RayError, TimeoutError):
                return
            for line in lines:
                self.out(redact_text(line))

    def stop(self) -> None:
        """The last lines (the tracker prints some while it closes the run), then no more."""
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join()
        self.drain()

    def _loop(self) -> None:
        while not self.stopped.wait(self.every_s):
            self.drain()
