"""The chaos harness's own clock, to hold the goodput ledger against: when it launched the job, when it killed, and when the job printed each step.

Bucket by bucket, from the harness's own record only: its `time.time()` at the launch and at each
kill (or node removal), when each record of rank 0's loss trace appeared in its file (`TraceTail`:
every step of every group, read every 0.1 s) and when each `[tidal]` line of the job's console
reached it (`step_prints` in its own process, `LogTail` for a driver of its own): the step lines,
`restart N` (a failure), `checkpoint at step N` and the end's `goodput ...` summary. Never the
job's step times or the ledger's figures.

Why: the ledger and a benchmark that sums MLflow's `step_time_s` read the same numbers, and "the
buckets sum to the wall" holds by construction, so neither catches time booked to the wrong
bucket. Why the trace times the steps and not the console: under load the tracker falls behind
(tens of seconds) and catches up while a group restarts, so a gap timed by its lines comes out
short by the difference (the 106.5 / 133.4 s of issue 77).

From it (`observed`), per bucket the ledger reports: start-up with restore (from the launch, and
from each failure, to the first step of the group it starts, less one ordinary step; a restore's
start is on no line); each kill's step in flight and the steps trained again (replayed; as the
ledger counts them: a step whose event never reached the log is not one); the detection, from
the last step to the failure line less that step (`hang` past the ledger's documented threshold,
else `other`); the end, to the summary line (`other`); the intervals across a save less an
ordinary one (checkpoint stall and post-save slowdown); and the rest, first executions (productive
and the waits inside steps, not told apart). `compare` sets each beside the ledger's final
`goodput_<bucket>_s` within a tolerance made of what the harness measured it cannot see: the
console's delay behind the trace (its spread), the trace's poll, the steps' jitter and each log
step's own work (inside the harness's step intervals, the ledger's `other`). A start with no
failure line (a driver's or a node's loss, a resize) leaves its gap to the ledger's start-up,
resize or `other`: those rows are held as a range.
"""

from __future__ import annotations

import io
import json
import math
import re
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from tidal.goodput.account import HANG_MIN_S, HANG_RATIO

STEP_LINE = re.compile(r"^\[tidal\] step (\d+)/\d+")
MARK_LINES = (("restart", re.compile(r"^\[tidal\] restart (\d+):")),
              ("resumed", re.compile(r"^\[tidal\] resumed from .* at step (\d+)/")),
              ("checkpoint", re.compile(r"^\[tidal\] checkpoint at step (\d+):")),
              ("summary", re.compile(r"^\[tidal\] goodput [\d.]+% of")),
              ("complete", re.compile(r"^\[tidal\] job .* is already complete at step (\d+)")))
TRACE_POLL_S = 0.1  # the trace is read this often: a step's record is seen at most this late
NEW_LIFE_S = 0.5  # a record seen this long after a kill is a new group's (a restart takes seconds)
# Each log step's own work (the loss's collective, the trace, emitting the event) lies inside the harness's
# step intervals, where the ledger books it `other`: the harness cannot see it apart. Measured 2026-12-07
# (the ledger's `other` less the harness's detection and end): 3-10% of a step interval in process at loads
# of 15-29, 14% for the combined job at 29-42. The rows it touches allow up to half an interval.
LOG_WORK_MAX = 0.5


@dataclass
class Timeline:
    """What the harness saw, in its own clock (s since the epoch)."""

    launched: float
    ended: float = 0.0
    kills: list[tuple[float, int]] = field(default_factory=list)  # (when, the highest step known done by then; 0: unknown)
    prints: list[tuple[float, int]] = field(default_factory=list)  # console step lines: (when, step), as printed
    marks: list[tuple[float, str, int]] = field(default_factory=list)  # other console lines: (when, kind, step)
    trace: list[tuple[float, int]] = field(default_factory=list)  # loss-trace records: (when seen, step)


def note_line(t: Timeline, when: float, line: str) -> None:
    """One console line, seen at `when`."""
    if m := STEP_LINE.match(line):
        t.prints.append((when, int(m.group(1))))
        return
    for kind, pattern in MARK_LINES:
        if m := pattern.match(line):
            t.marks.append((when, kind, int(m.group(1)) if m.groups() else 0))
            return


def note_trace(t: Timeline, when: float, line: str) -> None:
    """One loss-trace record (tidal.worker.metrics.trace_loss), seen at `when`; a torn one is skipped."""
    with suppress(ValueError, KeyError, TypeError):
        t.trace.append((when, int(json.loads(line)["step"])))


class _Tee(io.TextIOBase):
    """The real stdout, and the time each `[tidal]` line passed through."""

    def __init__(self, out: TextIO, timeline: Timeline, clock: Any) -> None:
        self.out, self.timeline, self.clock, self.pending = out, timeline, clock, ""
        self.lock = threading.Lock()

    def write(self, text: str) -> int:
        with self.lock:
            self.pending += text
            *lines, self.pending = self.pending.split("\n")
            for line in lines:
                note_line(self.timeline, self.clock(), line)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


@contextmanager
def step_prints(timeline: Timeline, clock: Any = time.time) -> Iterator[Timeline]:
    """While it is open, note in `timeline` when each `[tidal]` line is printed to this process's stdout."""
    real = sys.stdout
    sys.stdout = _Tee(real, timeline, clock)  # type: ignore[assignment]
    try:
        yield timeline
    finally:
        sys.stdout = real


class Tail:
    """A thread that reads the lines a file gains, every `poll_s`, and hands each to `take(when, line)`
    (a writer started again appends to the same file)."""

    def __init__(self, path: Path, take: Callable[[float, str], None], poll_s: float = 0.2,
                 clock: Any = time.time) -> None:
        self.path, self.take, self.poll_s, self.clock = path, take, poll_s, clock
        self.offset, self.pending = 0, ""
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="tidal-tail")

    def __enter__(self) -> Tail:
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
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        self.offset += len(data)
        now = self.clock()
        *lines, self.pending = (self.pending + data.decode(errors="replace")).split("\n")
        for line in lines:
            self.take(now, line)


def LogTail(log: Path, timeline: Timeline, poll_s: float = 0.2, clock: Any = time.time) -> Tail:  # noqa: N802
    """For a driver that runs as its own process (its output in `log`): its `[tidal]` lines into `timeline`."""
    return Tail(log, lambda when, line: note_line(timeline, when, line), poll_s, clock)


def TraceTail(trace: Path, timeline: Timeline, poll_s: float = TRACE_POLL_S, clock: Any = time.time) -> Tail:  # noqa: N802
    """Rank 0's loss trace (TIDAL_LOSS_TRACE), a record per step of every life, into `timeline.trace`."""
    return Tail(trace, lambda when, line: note_trace(timeline, when, line), poll_s, clock)


# --- what the harness derives ---------------------------------------------------------------------

@dataclass
class Seen:
    """The harness's buckets (s) and what bounds its view of them."""

    wall: float = 0.0  # launch to the summary line (the account's end), else to the job's end
    startup: float = 0.0  # start-up and restore: launch and each failure line to its life's first step, less a step
    replayed: float = 0.0  # each kill's step in flight, and every step trained again
    replayed_steps: int = 0
    hang: float = 0.0  # detections longer than the ledger's documented hang threshold
    detection: float = 0.0  # the other detections: failure line less the last step before it and that step
    end: float = 0.0  # the last step to the summary line (the last save's upload, the group's teardown)
    checkpoint: float = 0.0  # the intervals across a save less an ordinary one (signed: noise cancels)
    first: float = 0.0  # first executions of steps, less the saves' excess: the rest of the wall
    step: float = 0.0  # an ordinary step's wall time (mean of the intervals without a save or a start in them)
    jitter: float = 0.0  # their standard deviation
    delay: float = 0.0  # the console's lines behind the trace: median
    spread: float = 0.0  # ... and its 10th to 90th percentile
    lives: int = 0
    faults: int = 0  # lives started after a kill with a failure line between
    blind: int = 0  # lives started with no failure line seen (a node's or driver's loss, a resize)
    blind_s: float = 0.0  # their gaps, last step to the new life's start: start-up, resize or `other` to the ledger
    saves: int = 0
    unlogged: int = 0  # step runs at a group's end never logged (their events went with the group)
    end_unseen: float = 0.0  # no summary line: from the last line seen to the job's end, where the account ended


def lives_of(t: Timeline) -> list[list[tuple[float, int]]]:
    """The trace's records per worker group: a new one where the steps do not follow on, or where a
    kill came between two records and the second was seen well after it."""
    kills = sorted(k for k, _ in t.kills)
    out: list[list[tuple[float, int]]] = []
    for when, step in t.trace:
        if out:
            w0, s0 = out[-1][-1]
            # a record seen up to NEW_LIFE_S after a kill was done before it (the trace is read late)
            killed = any(w0 - NEW_LIFE_S < k <= when - NEW_LIFE_S for k in kills)
            if step == s0 + 1 and not killed:
                out[-1].append((when, step))
                continue
        out.append([(when, step)])
    return out


def _delay(t: Timeline) -> tuple[float, float]:
    """The console's step lines behind the trace's records of the same steps (steps run once)."""
    runs = {}
    for _, s in t.trace:
        runs[s] = runs.get(s, 0) + 1
    seen = {s: w for w, s in t.trace if runs[s] == 1}
    printed: dict[int, float] = {}
    for w, s in t.prints:
        printed.setdefault(s, w)
    lags = sorted(printed[s] - seen[s] for s in seen if s in printed)
    if not lags:
        return 0.0, 0.0
    q = statistics.quantiles(lags, n=10) if len(lags) > 1 else [lags[0]] * 9
    return statistics.median(lags), q[-1] - q[0]


def observed(t: Timeline) -> Seen:
    """The harness's buckets, from its timeline alone."""
    seen = Seen()
    seen.delay, seen.spread = _delay(t)
    summary = [w for w, kind, _ in t.marks if kind == "summary"]
    end = summary[0] if summary else t.ended
    if not summary:  # its line lost (a slow tracker's last lines): the account ended after the last one seen
        seen.end_unseen = max(0.0, t.ended - max([w for w, _ in t.prints] + [w for w, *_ in t.marks], default=t.ended))
    elif any(kind == "complete" for _, kind, _ in t.marks):
        # a driver started again after the last step (its first was killed while it closed) found the job complete:
        # the account ends at the job's last event (docs/reliability.md), somewhere after the last step
        seen.end_unseen = max(0.0, end - max((w for w, _ in t.trace), default=end))
    seen.wall = end - t.launched
    lives = logged(lives_of(t), t.prints)
    seen.lives = len(lives)
    seen.unlogged = sum(len(life) for life in lives_of(t)) - sum(len(life) for life in lives)
    if not lives:
        seen.startup = seen.wall
        return seen
    saves = {s for _, kind, s in t.marks if kind == "checkpoint"}
    ordinary = [b[0] - a[0] for life in lives for a, b in zip(life, life[1:], strict=False) if a[1] not in saves]
    seen.step = statistics.fmean(ordinary) if ordinary else 0.0
    seen.jitter = statistics.pstdev(ordinary) if len(ordinary) > 1 else 0.0
    failures = sorted(w for w, kind, _ in t.marks if kind == "restart")
    kills = sorted(k for k, _ in t.kills)
    high, last = 0, t.launched
    for j, life in enumerate(lives):
        start = life[0][0] - seen.step
        if j == 0:
            seen.startup += start - t.launched
        else:
            _fault(seen, (last, start), kills, failures, lambda when: _lag_at(t, when, seen.delay))
        for i, (when, step) in enumerate(life):
            took = seen.step if i == 0 else when - life[i - 1][0]
            if step <= high:
                seen.replayed += took
                seen.replayed_steps += 1
            else:
                seen.first += took
                if i and life[i - 1][1] in saves:
                    seen.checkpoint += took - seen.step
                    seen.saves += 1
            high = max(high, step)
        last = life[-1][0]
    seen.first -= seen.checkpoint
    seen.end = end - last
    return seen


def logged(lives: list[list[tuple[float, int]]], prints: list[tuple[float, int]]) -> list[list[tuple[float, int]]]:
    """Each group's steps less the last ones whose events never reached the log: the console printed
    each step once per logged execution, and a step trained more often than printed lost an event with
    its group (rank 0 writes events in the background; a newer start of the job drops an older one's).
    The ledger never hears of those: it books their time with the failure's gap and their next run as a
    first one, so the harness does the same (only at a group's end: a line lost mid-group, with a killed
    tracker, is not a lost step)."""
    missing = Counter(s for life in lives for _, s in life)
    missing.subtract(s for _, s in prints)
    out = []
    for j, life in enumerate(lives):
        keep = len(life)
        while j < len(lives) - 1 and keep > 1 and missing[life[keep - 1][1]] > 0:
            missing[life[keep - 1][1]] -= 1
            keep -= 1
        out.append(life[:keep])
    return out


def _lag_at(t: Timeline, when: float, default: float) -> float:
    """The console's delay at `when`: that of the last step line it showed by then (one tracker prints in
    order, so a line waits behind the same backlog as the lines just before it); `default` if none."""
    shown = [(w, s) for w, s in t.prints if w <= when]
    if not shown:
        return default
    w, s = shown[-1]
    done = [d for d, step in t.trace if step == s and d <= w]
    return w - done[-1] if done else default


def _fault(seen: Seen, gap: tuple[float, float], kills: list[float], failures: list[float],
           lags: Callable[[float], float]) -> None:
    """The gap between a life's last step and the next life's start: the step in flight, the detection up
    to the failure, and start-up with restore after it. The failure's line is the first the console showed
    after the kill and before the next kill (under load it can come after the new life's first step: the
    tracker falls behind); the failure, that line's time less the console's delay just before it
    (`lags`), within the gap."""
    last, start = gap
    killed = [k for k in kills if last - NEW_LIFE_S <= k <= start]
    until = min((k for k in kills if k > start), default=math.inf)
    lines = [f for f in failures if (killed[0] if killed else last) <= f < until]
    if not lines:  # no failure line (a node's or a driver's loss, a resize): all start-up to the harness
        seen.blind += 1
        seen.blind_s += start - last
        return
    seen.faults += 1
    failed = min(max(lines[0] - lags(lines[0]), last), start)
    in_flight = min(failed - last, seen.step)  # the ledger books one interval's steps as lost with the group
    seen.replayed += in_flight
    beyond = failed - last - in_flight
    if failed - last > HANG_RATIO * seen.step and beyond > HANG_MIN_S:  # the ledger's rule for a hang nothing declared
        seen.hang += beyond
    else:
        seen.detection += beyond
    seen.startup += start - failed


# --- the comparison --------------------------------------------------------------------------------

def _g(ledger: dict[str, float], *buckets: str) -> float:
    return sum(ledger.get(f"goodput_{b}_s", 0.0) for b in buckets)


def compare(seen: Seen, ledger: dict[str, float]) -> list[dict[str, Any]]:
    """Per bucket: the harness's figure, the ledger's, how far below (`below`) and above (`above`) it the
    ledger's may be, and whether it was (`ok`)."""
    # A boundary read off the trace: its poll, and a step's own length taken as the mean (the jitter); one
    # read off a console line (a failure, the summary): that line's delay, as far as it strays from the
    # console's (its spread). Measured on this run, so a loaded machine widens them.
    step_edge, line_edge = 2 * TRACE_POLL_S + seen.jitter, seen.spread + TRACE_POLL_S
    starts, stops = seen.lives + seen.blind, seen.faults + seen.blind
    work = LOG_WORK_MAX * (seen.first + seen.replayed)  # the log steps' own work: in `other` to the ledger
    lines = line_edge * (seen.faults + 1) + step_edge  # the failures' lines, the summary's, the last step
    rows = [
        ("wall: launch to the account's end", seen.wall, _g(ledger, "wall"), line_edge + 1.0 + seen.end_unseen,
         line_edge + 1.0, "no summary line: the driver's exit, which the account ends before" if seen.end_unseen else ""),
        ("start-up + restore + resize", seen.startup, _g(ledger, "queue", "startup", "restore", "resize_preemption"),
         step_edge * starts + line_edge * seen.faults, step_edge * starts + line_edge * seen.faults + seen.blind_s,
         "restore not told apart: no line marks where it begins"),
        ("steps trained again", float(seen.replayed_steps), ledger.get("goodput_replayed_steps", 0.0),
         float(stops), float(stops), "a count"),
        ("replayed", seen.replayed, _g(ledger, "replayed"), step_edge * stops + LOG_WORK_MAX * seen.replayed,
         step_edge * stops, "the log steps' work in them is `other` to the ledger"),
        ("hang (detection past the threshold)", seen.hang, _g(ledger, "hang"), line_edge * seen.faults + 0.5,
         line_edge * seen.faults + 0.5, ""),
        ("other: at least detection + the end", seen.detection + seen.end, _g(ledger, "other"),
         lines + 1.0 + seen.end_unseen, lines + 1.0 + seen.blind_s + work, "and the log steps' work"),
        ("checkpoint stall + post-save slowdown", seen.checkpoint,
         _g(ledger, "checkpoint_stall", "post_save_slowdown"),
         *[2 * seen.jitter * math.sqrt(max(seen.saves, 1)) + TRACE_POLL_S * seen.saves] * 2, "the saves' excess"),
        ("productive + data, straggler, eval: at most first runs", seen.first,
         _g(ledger, "productive", "data_wait", "straggler_wait", "eval"), step_edge * starts + 1.0 + work,
         step_edge * starts + 1.0, "less the log steps' work"),
        ("productive, waits in steps and other together", seen.first + seen.detection + seen.end,
         _g(ledger, "productive", "data_wait", "straggler_wait", "eval", "other"),
         lines + 1.0 + seen.end_unseen, lines + 1.0 + seen.blind_s, ""),
    ]
    out = []
    for name, harness, theirs, below, above, note in rows:
        off = theirs - harness
        out.append({"bucket": name, "harness": harness, "ledger": theirs, "off": off, "below": below,
                    "above": above, "ok": -below <= off <= above, "note": note})
    return out


def markdown_rows(name: str, t: Timeline, ledger: dict[str, float], note: str = "") -> str:
    """The chaos benchmarks' rows: per bucket, the harness's figure and the ledger's (its final
    `goodput_*` metrics), the tolerance and whether it held; `note` follows the first row's verdict."""
    if not ledger:
        return f"| {name}: the ledger against the harness's clock | no goodput account in the run |\n"
    seen = observed(t)
    out = (f"| {name}: the harness's clock | {seen.lives} lives, {seen.faults} failure line(s) after a kill, "
           f"{seen.blind} start(s) with none; a step {seen.step:.3f} s (sd {seen.jitter:.3f}); console "
           f"{seen.delay:.2f} s behind the trace (spread {seen.spread:.2f} s){note} |\n")
    for row in compare(seen, ledger):
        unit = "" if row["bucket"] == "steps trained again" else " s"
        out += (f"| {name}, {row['bucket']}: harness / ledger | {row['harness']:.1f}{unit} / {row['ledger']:.1f}{unit}: "
                f"**{row['off']:+.1f}** ({'held' if row['ok'] else 'NOT held'}: -{row['below']:.1f} to +{row['above']:.1f})"
                f"{'; ' + row['note'] if row['note'] else ''} |\n")
    return out
