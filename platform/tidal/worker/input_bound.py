"""Is the job waiting for its data? The decision, and where each step's time went. No torch, no Ray.

Rank 0 hands `InputWatch.update` each log interval's phase times (worker/metrics.py's
`PhaseClock.take`: seconds per step, averaged over the interval) and how many steps it held.
The job is input-bound when the time spent waiting for the next micro-batch is at least
`threshold` of the step time over the last `intervals` log intervals, summed (not averaged:
a long interval weighs as much as its steps). That is said once per worker group: the cause
(a slow source, slow storage) does not go away by itself.

`PhaseTotals` adds the same figures up over the group's life for the end-of-run summary: each
phase's share of the wall time, checkpoints and evaluations (time outside steps) included.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Interval:
    """One log interval of rank 0: seconds per step (averages) and the steps it held."""

    data_wait_s: float
    step_time_s: float
    steps: int


@dataclass(frozen=True)
class Verdict:
    share: float  # data wait / step time over the window
    first_step: int  # the window's first step
    last_step: int


def wait_share(window: list[Interval]) -> float:
    """Seconds waiting for data over seconds stepping, summed over the window's steps."""
    wait = sum(i.data_wait_s * i.steps for i in window)
    total = sum(i.step_time_s * i.steps for i in window)
    return wait / total if total > 0 else 0.0


def input_bound(window: list[Interval], threshold: float, intervals: int) -> float | None:
    """The window's data-wait share if the job is input-bound, else None.

    Needs `intervals` intervals: one slow interval (the first batch of a cold cache, a storage
    hiccup) is noise. `threshold` 0 turns the check off."""
    if not threshold or len(window) < intervals:
        return None
    share = wait_share(window[-intervals:])
    return share if share >= threshold else None


@dataclass
class InputWatch:
    """Feeds `input_bound` one interval at a time; `update` returns a Verdict once, then None."""

    threshold: float
    intervals: int
    window: deque[tuple[int, Interval]] = field(default_factory=deque)
    said: bool = False

    def update(self, step: int, interval: Interval) -> Verdict | None:
        if not _finite(interval):  # warm-up (compile) intervals have no times
            return None
        self.window.append((step - interval.steps + 1, interval))
        while len(self.window) > self.intervals:
            self.window.popleft()
        if self.said:
            return None
        share = input_bound([i for _, i in self.window], self.threshold, self.intervals)
        if share is None:
            return None
        self.said = True
        return Verdict(share, self.window[0][0], step)


PHASES = ("data_wait", "forward_backward", "optimizer", "outside_steps")


@dataclass
class PhaseTotals:
    """Seconds per phase since the group started; `outside_steps` is the wall time between log
    steps that no step accounts for (checkpoint saves, evaluations, the log step's own work)."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    wall: float = 0.0  # steps and time outside them: the shares' denominator

    def add(self, interval: Interval, forward_backward_s: float, optimizer_s: float, wall_s: float | None) -> None:
        """`wall_s`: seconds since the previous log step (None at the group's first)."""
        if not _finite(interval):
            return
        n = interval.steps
        stepping = interval.step_time_s * n
        self.seconds["data_wait"] += interval.data_wait_s * n
        self.seconds["forward_backward"] += _num(forward_backward_s) * n
        self.seconds["optimizer"] += _num(optimizer_s) * n
        outside = max(0.0, wall_s - stepping) if wall_s is not None else 0.0
        self.seconds["outside_steps"] += outside
        self.wall += stepping + outside

    def shares(self) -> dict[str, float]:
        """`time_share_<phase>` of the wall time so far; what they leave of 1 is the steps' own
        overhead (seeding, the loss's copy to the host)."""
        if self.wall <= 0:
            return {}
        return {f"time_share_{k}": v / self.wall for k, v in self.seconds.items()}


def _finite(i: Interval) -> bool:
    return i.steps > 0 and math.isfinite(i.step_time_s) and math.isfinite(i.data_wait_s)


def _num(x: float) -> float:
    return x if math.isfinite(x) else 0.0
