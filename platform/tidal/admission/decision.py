"""The admission decision's values: the jobs it is made about and what it decides for each.

`policy.decide` makes the decision; `queue_doc.apply` writes it into the queue; the actor
publishes it once saved. Plain frozen dataclasses: no Ray, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Why = Literal["capacity", "quota", "priority", "resize_interval", "reservation"]


@dataclass(frozen=True)
class RunningJob:
    """A job holding workers now. `expected_end` (clock time) comes from its progress, if known."""

    job: str
    team: str
    priority: str
    min_workers: int
    max_workers: int
    workers: int
    last_resize: float
    slots_per_worker: int = 1
    submitted_at: float = 0.0
    expected_end: float | None = None

    @property
    def slots(self) -> int:
        return self.workers * self.slots_per_worker


@dataclass(frozen=True)
class QueuedJob:
    """A job waiting for workers: new, or suspended (it keeps its submission time, so its place)."""

    job: str
    team: str
    priority: str
    min_workers: int
    max_workers: int
    submitted_at: float
    slots_per_worker: int = 1


@dataclass(frozen=True)
class Admit:
    job: str
    workers: int


@dataclass(frozen=True)
class Resize:
    job: str
    workers: int
    reason: str


@dataclass(frozen=True)
class Suspend:
    job: str
    reason: str


@dataclass(frozen=True)
class Waiting:
    """A job left queued: its place in the queue (1 = next), why, and when it should start."""

    job: str
    position: int
    why: Why
    reason: str
    starts_at: float | None = None


@dataclass(frozen=True)
class AdmissionDecision:
    admit: tuple[Admit, ...] = ()
    shrink: tuple[Resize, ...] = ()
    grow: tuple[Resize, ...] = ()
    suspend: tuple[Suspend, ...] = ()
    waiting: tuple[Waiting, ...] = ()

    def workers(self, job: str) -> int | None:
        """What the decision gives `job` (admitted, shrunk or grown); None: unchanged or waiting."""
        for item in (*self.admit, *self.shrink, *self.grow):
            if item.job == job:
                return item.workers
        return 0 if any(s.job == job for s in self.suspend) else None


__all__ = ["Admit", "AdmissionDecision", "QueuedJob", "Resize", "RunningJob", "Suspend", "Waiting", "Why"]
