"""The chaos harness's own clock, to hold the goodput ledger against: when it launched the job, when it killed, and when the job printed each step.

Why: the ledger and a benchmark that sums MLflow's `step_time_s` read the same numbers, and "the
buckets sum to the wall" holds by construction, so neither catches time booked to the wrong
bucket. The harness's timeline is measured apart from both: its own `time.time()` at the launch,
at each kill and at each `[tidal] step N/M` line as the job's driver prints it (`step_prints` in
its own process, `LogTail` for a driver of its own).
From it (`observed`): start-up, from the launch to the first step printed; each fault's loss,
from the print of the last step done before the kill (the kill itself, where that print came after
it) to the first new step after it, less one ordinary
step interval (the progress that gap would have held anyway); and progress, the rest of the wall.
`from_ledger` groups the ledger's buckets the same way and `compare` sets them side by side.
The printed lines reach the harness through the tracker's polling (about 0.5 s late, alike for
every line), so a difference of a second or two per fault is the measurement, not the ledger.
"""

from __future__ import annotations

import io
import re
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

STEP_LINE = re.compile(r"^\[tidal\] step (\d+)/\d+")
LAG_S = 1.5  # a step line reaches the harness this late at most (the tracker polls the log every 0.5 s)
# The ledger's buckets in the harness's three groups: what it sees as progress is training, its
# waits inside steps and between them (the log step's collective, logging, the saves).
PROGRESS = ("productive", "checkpoint_stall", "post_save_slowdown", "data_wait", "straggler_wait", "eval", "other")
LOST = ("queue", "startup", "restore", "replayed", "hang", "resize_preemption")
# Allowed gap between the harness's clock and the ledger, per fault and once more: the step lines reach
# the harness through the tracker's polling (about 0.5 s) and a fault's edges are a printed line apart.
SLACK_S = 2.0


@dataclass
class Timeline:
    """What the harness saw, in its own clock (s since the epoch)."""

    launched: float
    ended: float = 0.0
    kills: list[tuple[float, int]] = field(default_factory=list)  # (when, the highest step known done by then; 0: unknown)
    prints: list[tuple[float, int]] = field(default_factory=list)  # (when, step) in the order printed


class _Tee(io.TextIOBase):
    """The real stdout, and the time each `[tidal] step N/M` line passed through."""

    def __init__(self, out: TextIO, seen: list[tuple[float, int]], clock: Any) -> None:
        self.out, self.seen, self.clock, self.pending = out, seen, clock, ""
        self.lock = threading.Lock()

    def write(self, text: str) -> int:
        with self.lock:
            self.pending += text
            *lines, self.pending = self.pending.split("\n")
            for line in lines:
                if m := STEP_LINE.match(line):
                    self.seen.append((self.clock(), int(m.group(1))))
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


@contextmanager
def step_prints(timeline: Timeline, clock: Any = time.time) -> Iterator[Timeline]:
    """While it is open, note in `timeline.prints` when each step line is printed to this process's stdout."""
    real = sys.stdout
    sys.stdout = _Tee(real, timeline.prints, clock)  # type: ignore[assignment]
    try:
        yield timeline
    finally:
        sys.stdout = real


class LogTail:
    """For a driver that runs as its own process (its output in `log`): a thread that reads the lines
    the file gains, every `poll_s`, and notes when each step line appeared (a driver started again
    appends to the same file)."""

    def __init__(self, log: Path, timeline: Timeline, poll_s: float = 0.2, clock: Any = time.time) -> None:
        self.log, self.timeline, self.poll_s, self.clock = log, timeline, poll_s, clock
        self.offset, self.pending = 0, ""
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="tidal-log-tail")

    def __enter__(self) -> LogTail:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.read()

    def _loop(self) -> None:
        while not self.stop.wait(self.poll_s):
            self.read()

    def read(self) -> None:
        try:
            with self.log.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        self.offset += len(data)
        now = self.clock()
        *lines, self.pending = (self.pending + data.decode(errors="replace")).split("\n")
        self.timeline.prints += [(now, int(m.group(1))) for line in lines if (m := STEP_LINE.match(line))]


def observed(t: Timeline) -> dict[str, float]:
    """The harness's buckets: `startup`, `faults` (each kill's loss, summed), `progress`, and `wall`."""
    wall = t.ended - t.launched
    new: list[tuple[float, int]] = []  # the prints of steps beyond any printed before: progress
    for when, step in t.prints:
        if not new or step > new[-1][1]:
            new.append((when, step))
    if not new:
        return {"startup": wall, "faults": 0.0, "progress": 0.0, "wall": wall}
    startup = new[0][0] - t.launched
    gaps = []  # (the print of the last step done before a kill, the print of the first step beyond it)
    starts = []  # where each gap's loss starts: that print, or the kill where the print came after it
    for kill, known in t.kills:
        # A step printed up to LAG_S after the kill was done before it: lines reach the harness late.
        done = max([known] + [s for w, s in new if w <= kill + LAG_S])
        before = [w for w, s in new if s == done]
        after = [w for w, s in new if s > done]
        if before and after:
            gaps.append((before[0], after[0]))
            # The step was done by the kill: a print later than it is the console's lag (seconds under load)
            starts.append(min(before[0], kill))
    # An ordinary step's time: the time between new steps outside the kills' gaps over the steps in it
    # (lines arrive in batches, one per tracker poll, so single intervals say little).
    spanned = set(gaps)
    ordinary = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(new, new[1:], strict=False) if (a[0], b[0]) not in spanned]
    steps_seen = sum(n for _, n in ordinary)
    step = sum(d for d, _ in ordinary) / steps_seen if steps_seen else 0.0
    faults = sum(max(0.0, after - start - step) for start, (_, after) in zip(starts, gaps, strict=True))
    return {"startup": startup, "faults": faults, "progress": wall - startup - faults, "wall": wall}


def from_ledger(metrics: dict[str, float]) -> dict[str, float]:
    """The ledger's final `goodput_<bucket>_s` metrics in the harness's groups: `lost` (start-up and
    the faults together: the ledger books a restart's start-up with the first one's) and `progress`."""
    return {"lost": sum(metrics.get(f"goodput_{b}_s", 0.0) for b in LOST),
            "progress": sum(metrics.get(f"goodput_{b}_s", 0.0) for b in PROGRESS),
            "wall": metrics.get("goodput_wall_s", 0.0)}


def compare(seen: dict[str, float], ledger: dict[str, float], within_s: float) -> list[dict[str, Any]]:
    """Per group, the harness's seconds, the ledger's, and whether they agree within `within_s`."""
    rows = []
    for group, harness in (("lost to start-up and faults", seen["startup"] + seen["faults"]),
                           ("progress", seen["progress"]), ("wall", seen["wall"])):
        key = {"lost to start-up and faults": "lost"}.get(group, group)
        off = ledger[key] - harness
        rows.append({"group": group, "harness_s": harness, "ledger_s": ledger[key], "off_s": off,
                     "ok": abs(off) <= within_s})
    return rows


def markdown_rows(name: str, t: Timeline, ledger: dict[str, float], note: str = "") -> str:
    """The chaos benchmarks' rows: per group, the harness's seconds and the ledger's (its final
    `goodput_*` metrics), within SLACK_S a fault and once more; `note` follows the verdict."""
    if not ledger:
        return f"| {name}: the ledger against the harness's clock | no goodput account in the run |\n"
    within = SLACK_S * (1 + len(t.kills))
    out = ""
    for row in compare(observed(t), from_ledger(ledger), within):
        out += (f"| {name}, {row['group']}: the harness's clock / the ledger | {row['harness_s']:.1f} s / "
                f"{row['ledger_s']:.1f} s: **{row['off_s']:+.1f} s** ({'within' if row['ok'] else 'beyond'} "
                f"{within:.0f} s{note}) |\n")
    return out
