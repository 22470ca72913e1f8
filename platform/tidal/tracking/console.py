"""What a person watching a job reads: one subscriber of the ledger's events, printing `[tidal]` lines.

The wording here is for people only: `tidal status/list` and `Job.progress()` read the
structured status record (the `tidal.progress` tag tracking/writer.py keeps on the run), never these lines.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from tidal.redact import redact_text
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

PREFIX = "[tidal] "


class Console:
    def __init__(self, total_steps: int, clock: Callable[[], float] = time.time, max_restarts: int | None = None) -> None:
        # failure.max_restarts: per group, where the failures' `restarts` count over the job's life
        self.total, self.clock, self.max_restarts = total_steps, clock, max_restarts
        self.t0, self.first_step = clock(), None

    def __call__(self, notice: Event | Mapping[str, Any]) -> None:
        """One ledger notice (a typed event, with what the ledger adds; or an event log entry) -> at
        most one line."""
        line = self.line(notice if isinstance(notice, Event) else parse(notice))
        if line:
            print(redact_text(f"[tidal] {line}"), flush=True)

    def line(self, e: Event | None) -> str | None:
        match e:
            case StepMetrics():
                return self._metrics(e)
            case CheckpointSaved():
                return self._checkpoint(e)
            case Note():
                return e.text
            case Resumed():
                return self._resumed(e)
            case Resized():
                why = "after a failure" if e.after_failure else "capacity changed"
                return f"resized: world size {e.old_world} -> {e.world} ({why}), training again at step {e.step}"
            case WorkersFailed():
                return self._failure(e)
            case TrackingDown():
                return (f"WARNING: MLflow is unreachable ({e.error}); training continues and metrics wait in "
                        f"{e.where} until it is back")
            case TrackingBack():
                return f"MLflow is reachable again after {e.down_s:.0f}s: sent {e.sent} buffered point(s)"
        return None  # a kind this Tidal does not know: a newer writer's

    def _metrics(self, e: StepMetrics) -> str | None:
        m, step = e.values, int(e.step)
        if "loss" not in m:
            return None
        if self.first_step is None:
            self.first_step, self.t0 = step, self.clock()
        elapsed, done = self.clock() - self.t0, step - self.first_step
        eta = elapsed / done * (self.total - step) if done > 0 else math.nan
        parts = [f"step {step}/{self.total}", f"loss {m['loss']:.4f}"]
        if "tokens_per_s" in m:  # not for a user's own dataset: its samples have no token count
            parts.append(f"{m['tokens_per_s']:,.0f} tok/s")
        parts.append(f"{m.get('samples_per_s', 0):,.1f} samples/s")
        if "mfu" in m:
            parts.append(f"MFU {100 * m['mfu']:.1f}%")
        parts += [f"world {m.get('world_size', 0):.0f}", f"elapsed {hms(elapsed)}", f"ETA {hms(eta)}"]
        return " | ".join(parts)

    def _checkpoint(self, e: CheckpointSaved) -> str | None:
        if e.replay:
            return None
        m = e.values
        return (f"checkpoint at step {e.step}: {m.get('checkpoint_bytes', 0) / 2**20:.1f} MiB on rank 0, "
                f"written in {m.get('checkpoint_save_s', 0):.2f}s, training blocked {m.get('checkpoint_blocked_s', 0):.2f}s")

    def _resumed(self, e: Resumed) -> str:
        line = f"resumed from {e.checkpoint} at step {e.step}/{self.total}"
        if e.lost:
            line += f" ({e.lost} step(s) to redo)"
        if e.old_world != e.world:
            line += f"; checkpoint written at world size {e.old_world} resharded for {e.world}"
        return line

    def _failure(self, e: WorkersFailed) -> str:
        lines = [f"worker rank {rank} failed: {why}" for rank, why in sorted(e.failures.items())]
        if e.final:
            limit = "used up" if self.max_restarts is None else self.max_restarts
            lines.append(f"the worker group failed again after {e.restarts:.0f} restart(s) (failure.max_restarts "
                         f"{limit}): Ray Train gives up on it")
        elif e.in_place:
            ranks = ", ".join(sorted(e.failures, key=int))
            lines.append(f"restart {e.restarts:.0f}: replacing rank(s) {ranks} alone (failure.replace_in_place); the "
                         f"other ranks keep their processes and roll back to the newest complete snapshot "
                         f"(last step reached: {e.reported})")
        else:
            lines.append(f"restart {e.restarts:.0f}: restarting the worker group from the latest complete "
                         f"checkpoint (last step reached: {e.reported})")
        return "\n[tidal] ".join(lines)


class HeldLines:
    """The stdout of the tracker's process (a Ray actor): `[tidal]` lines are held for the driver
    to print (tidal.launch.console_pump), every other line goes on to the real stdout.

    Ray forwards an actor's stdout to the driver with a `(TrackerActor pid=...)` prefix, and its only
    switch to drop it (RAY_DISABLE_WORKER_LOG_PREFIX) drops it for every worker, so a real error would
    lose its origin. The driver printing Tidal's lines itself keeps them plain and leaves Ray's
    forwarding of everything else as it is."""

    def __init__(self, passthrough: TextIO, keep: int = 10_000) -> None:
        self.passthrough, self.keep = passthrough, keep
        self.held: list[str] = []
        self.partial = ""
        self.lock = threading.Lock()

    def write(self, text: str) -> int:
        with self.lock:
            *complete, self.partial = (self.partial + text).split("\n")
            for line in complete:
                if line.startswith(PREFIX):
                    # bounded: a driver that stopped asking must not grow this process without end
                    self.held = (self.held + [line])[-self.keep:]
                else:
                    self.passthrough.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.passthrough.flush()

    def take(self) -> list[str]:
        with self.lock:
            lines, self.held = self.held, []
        return lines

    def __getattr__(self, name: str) -> Any:  # fileno, encoding, isatty...: the real stream's
        return getattr(self.passthrough, name)


def hold_tidal_lines() -> HeldLines:
    """Install HeldLines as this process's stdout (idempotent); returns it."""
    if not isinstance(sys.stdout, HeldLines):
        sys.stdout = HeldLines(sys.stdout)
    return sys.stdout


def hms(seconds: float) -> str:
    if seconds != seconds:  # NaN: no estimate yet
        return "--:--"
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
