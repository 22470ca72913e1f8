"""A step-time watchdog: a worker that finishes no step for too long exits, so Ray restarts the
group from the last checkpoint instead of hanging forever.

A rank stuck in a collective (a peer frozen, a NIC gone quiet) never returns to Python, and
gloo/NCCL timeouts are long or absent. Ray only restarts a group when a worker dies, so the
watchdog makes the stuck worker die: a daemon thread checks the time since the last finished
step and calls os._exit, which no blocked C++ call can hold up.

A save, an evaluation or a drain is no step: each may rightly take far longer than the step
timeout (a large synchronous checkpoint, a long eval set), and killing a save mid-write wastes
it. So each runs as a `phase` with a deadline of its own, during which the step timeout is
suspended; a phase past its deadline is hung like a step, and the message names it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tidal.tracking.emitter import Emitter

EXIT_CODE = 70  # EX_SOFTWARE


@dataclass(frozen=True)
class Phase:
    name: str  # "save", "eval", "drain"
    deadline_s: float
    started: float  # time.monotonic()


def hung(now: float, last_beat: float | None, timeout_s: float, phase: Phase | None) -> str | None:
    """What is hung at `now` (monotonic): the phase's name, "step", or None."""
    if phase is not None:
        return phase.name if phase.deadline_s > 0 and now - phase.started > phase.deadline_s else None
    return "step" if last_beat is not None and now - last_beat > timeout_s else None


class StepWatchdog:
    def __init__(self, timeout_s: float, rank: int, events: Emitter, phase_timeout_s: float = 0.0) -> None:
        self.timeout_s, self.rank, self.events = timeout_s, rank, events
        self.phase_timeout_s = phase_timeout_s
        self.last_beat: float | None = None  # armed by the first beat: engine build and JIT are slow
        self.current: Phase | None = None
        self.step = 0
        if timeout_s > 0:
            threading.Thread(target=self._watch, name="tidal-watchdog", daemon=True).start()

    def beat(self, step: int) -> None:
        self.step, self.last_beat = step, time.monotonic()

    @contextmanager
    def phase(self, name: str, deadline_s: float | None = None) -> Iterator[None]:
        """Run `name` under its own deadline (default: failure.phase_timeout_s; 0: none) instead
        of the step timeout, which restarts when the phase ends."""
        self.current = Phase(name, self.phase_timeout_s if deadline_s is None else deadline_s, time.monotonic())
        try:
            yield
        finally:
            self.current = None
            if self.last_beat is not None:
                self.last_beat = time.monotonic()

    def _watch(self) -> None:
        while True:
            phase = self.current
            time.sleep(min(5.0, self.timeout_s / 4, *([phase.deadline_s / 4] if phase and phase.deadline_s > 0 else [])))
            phase = self.current  # read once: the training thread changes it
            what = hung(time.monotonic(), self.last_beat, self.timeout_s, phase)
            if what is None:
                continue
            if phase is not None:
                said = (f"watchdog: rank {self.rank} spent over {phase.deadline_s:.0f}s in {what} after step {self.step} "
                        "(hung? failure.phase_timeout_s sets this deadline)")
            else:
                said = (f"watchdog: rank {self.rank} finished no step for {self.timeout_s:.0f}s after step {self.step} "
                        "(stuck in a collective or a dead peer?)")
            self.events.say(f"{said}; exiting so Ray restarts the group from the last checkpoint", self.step)
            self.events.drain(timeout_s=5.0)  # let the message reach storage; a stuck write must not hold the exit
            os._exit(EXIT_CODE)
