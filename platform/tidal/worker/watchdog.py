"""A step-time watchdog: a worker that finishes no step for too long exits, so Ray restarts the
group from the last checkpoint instead of hanging forever.

A rank stuck in a collective (a peer frozen, a NIC gone quiet) never returns to Python, and
gloo/NCCL timeouts are long or absent. Ray only restarts a group when a worker dies, so the
watchdog makes the stuck worker die: a daemon thread checks the time since the last finished
step and calls os._exit, which no blocked C++ call can hold up.
"""

from __future__ import annotations

import os
import threading
import time

from tidal.tracking.emitter import Emitter

EXIT_CODE = 70  # EX_SOFTWARE


class StepWatchdog:
    def __init__(self, timeout_s: float, rank: int, events: Emitter) -> None:
        self.timeout_s, self.rank, self.events = timeout_s, rank, events
        self.last_beat: float | None = None  # armed by the first beat: engine build and JIT are slow
        self.step = 0
        if timeout_s > 0:
            threading.Thread(target=self._watch, name="tidal-watchdog", daemon=True).start()

    def beat(self, step: int) -> None:
        self.step, self.last_beat = step, time.monotonic()

    def pause(self) -> None:
        """Disarm until the next beat (e.g. while waiting for a node to be reclaimed)."""
        self.last_beat = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(5.0, self.timeout_s / 4))
            if self.last_beat is not None and time.monotonic() - self.last_beat > self.timeout_s:
                self.events.say(
                    f"watchdog: rank {self.rank} finished no step for {self.timeout_s:.0f}s after step {self.step} "
                    "(stuck in a collective or a dead peer?); exiting so Ray restarts the group from the last checkpoint",
                    self.step,
                )
                self.events.drain(timeout_s=5.0)  # let the message reach storage; a stuck write must not hold the exit
                os._exit(EXIT_CODE)
