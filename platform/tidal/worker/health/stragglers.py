"""Stragglers: which rank holds the others back, and when to say so. Pure functions, no torch.

Every rank's step time is the same (the collectives make the fast ranks wait for the slow
one), so the signal is each rank's *busy* time: its step time minus the time it spent inside
collectives. A straggler is busy for long while the others wait for it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Spread:
    """How far the slowest rank is from the typical one in one log interval."""

    ratio: float  # slowest busy time / median busy time (1.0: balanced)
    slowest_rank: int


def spread(busy_s: list[float]) -> Spread:
    """The ratio of the slowest rank's busy time to the median's, and which rank it is.

    The median is the lower median, so with two ranks the ratio compares the slow one with the
    other (the mean of both would halve the signal); with many ranks it is the usual median.
    """
    if not busy_s:
        return Spread(1.0, 0)
    slowest = max(range(len(busy_s)), key=busy_s.__getitem__)
    median = statistics.median_low(busy_s)
    ratio = busy_s[slowest] / median if median > 0 else 1.0
    return Spread(ratio, slowest)


@dataclass
class PersistentWait:
    """How long each step waits for a persistently slow rank: the goodput account's straggler wait.

    One sampled step's spread is mostly jitter: two ranks on shared cores take turns being the slower,
    and the slowest less the median is above 0 at every sample, so counting it charged a balanced job
    7% of its wall to "stragglers" (the quickstart, 2,000 steps, 2 ranks on 2 cores). Nor is the
    difference of the ranks' means over a few samples enough: random jitter leaves the means apart by
    chance, and the larger less the other still charged 3.6% of the wall while rank 0 was the slowest at
    46% of the samples. So each rank keeps its excess over the median of the other ranks at each of the
    last `window` samples (signed: negative when it was the faster), and a rank is a straggler only when
    its mean excess is `margin` standard errors above 0 (a one-sided test); then the others wait its
    whole mean excess. On simulated ranks with 10% random noise a step (tests/test_stragglers.py) that
    charges jitter about 0.2% of a step, a rank 2x slow all of its excess and one 1.2x slow 98% of it.
    With fewer than 3 samples there is no telling, and nothing is charged. The jitter's cost stays in
    the step time, like the collectives'.
    """

    window: int = 16
    margin: float = 2.5
    excess: list[list[float]] = field(default_factory=list)

    def update(self, busy_s: list[float]) -> float:
        """The wait per step, after adding this interval's sample (one busy time per rank)."""
        if len(busy_s) != len(self.excess):  # the first sample, or another group size
            self.excess = [[] for _ in busy_s]
        if len(busy_s) < 2:
            return 0.0
        for i, kept in enumerate(self.excess):
            kept.append(busy_s[i] - statistics.median_low(busy_s[:i] + busy_s[i + 1:]))
            del kept[:-self.window]  # the last `window` samples
        return max(self._persistent(kept) for kept in self.excess)

    def _persistent(self, kept: list[float]) -> float:
        if len(kept) < 3:
            return 0.0
        mean, error = statistics.fmean(kept), statistics.stdev(kept) / math.sqrt(len(kept))
        return mean if mean > self.margin * error else 0.0


@dataclass
class StragglerWatch:
    """Warns when the same rank stays above `threshold` for `intervals` log intervals in a row.

    `update` returns the rank to warn about, once per streak (None otherwise); a streak ends
    when the ratio falls back under the threshold or another rank becomes the slowest.
    `threshold` 0 turns the watch off.
    """

    threshold: float
    intervals: int
    rank: int | None = None
    streak: int = 0
    warned: bool = False

    def update(self, s: Spread) -> int | None:
        if not self.threshold or s.ratio < self.threshold:
            self.rank, self.streak, self.warned = None, 0, False
            return None
        if s.slowest_rank != self.rank:
            self.rank, self.streak, self.warned = s.slowest_rank, 0, False
        self.streak += 1
        if self.streak >= self.intervals and not self.warned:
            self.warned = True
            return self.rank
        return None


@dataclass
class ExclusionWatch:
    """Which rank to take out of the group: the same rank above `ratio` at every sampled log
    interval for `after_s` seconds (rank 0's clock). Any interval under the ratio, or another rank
    becoming the slowest, starts over: a checkpoint's hiccup or a neighbour's burst is not a
    straggler. `update` returns the rank once; None otherwise."""

    ratio: float
    after_s: float
    rank: int | None = None
    since: float = 0.0
    done: bool = False

    def update(self, s: Spread, now: float) -> int | None:
        if self.done:
            return None
        if s.ratio < self.ratio:
            self.rank = None
            return None
        if s.slowest_rank != self.rank:
            self.rank, self.since = s.slowest_rank, now
        if now - self.since >= self.after_s:
            self.done = True
            return self.rank
        return None


def exclusion_on(setting: bool | None, elastic: bool) -> bool:
    """failure.straggler_exclude: None follows the job's kind (on for elastic jobs only)."""
    return elastic if setting is None else setting


def size_without(world: int, on_node: int, min_workers: int) -> int | None:
    """The group's size without a node holding `on_node` of its ranks; None below min_workers."""
    left = world - on_node
    return left if left >= min_workers else None
