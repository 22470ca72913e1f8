"""The admission decision being built (policy.py `decide`): each job's workers after it, with running
totals per team and per (team, priority) so that a waiting job is checked against an upper bound
before any exact search. Pure: imports neither Ray nor torch."""

from __future__ import annotations

from typing import Any

from tidal.admission.decision import QueuedJob, RunningJob
from tidal.admission.quotas import Quotas


class Plan:
    """The decision being built: each job's workers after it, with the slots per team and per
    (team, priority) of the running jobs kept as totals that each change updates, and a journal
    so that one job's provisional changes can be undone (nothing is touched unless all is met)."""

    def __init__(self, quotas: Quotas, now: float, capacity: int, running: dict[str, RunningJob]) -> None:
        self.quotas, self.now, self.capacity, self.running = quotas, now, capacity, running
        self.ranks = {p: i for i, p in enumerate(quotas.priorities)}
        self.jobs: dict[str, RunningJob | QueuedJob] = dict(running)
        self.target = {j: 0 for j in running}
        self.admitted: dict[str, QueuedJob] = {}
        self.shrunk: dict[str, str] = {}
        self.suspended: dict[str, str] = {}
        self.used = 0
        self.team_used: dict[str, int] = {}
        # team -> rank -> running jobs' [slots, slots above min_workers], of those that may be resized
        # now, then of those that may not yet: what could yield to a job, without looking at each
        self.held: dict[str, dict[int, list[int]]] = {}
        self.journal: list[tuple[str, int]] = []
        self.memo: dict[tuple[Any, ...], Any] = {}  # what cannot change until the plan does
        self.ends: dict[str | None, tuple[list[float], list[int]]] = {}
        # victims are looked for in this order: lowest priority first, then the newest
        self.order = sorted(running.values(), key=lambda r: (self.rank(r), -r.submitted_at))
        self.elastic = [r for r in self.order if r.max_workers > r.min_workers]
        for r in running.values():
            self._set(r.job, r.workers)

    def rank(self, job: RunningJob | QueuedJob) -> int:
        return self.ranks.get(job.priority, -1)  # as Quotas.rank: an unknown name ranks below all

    def slots(self, job: str) -> int:
        return self.target[job] * self.jobs[job].slots_per_worker

    def free(self) -> int:
        return self.capacity - self.used

    def team_slots(self, team: str) -> int:
        return self.team_used.get(team, 0)

    def borrowing(self, team: str) -> bool:
        quota = self.quotas.team(team)
        return quota is not None and self.team_slots(team) > quota.onprem.guaranteed

    def may_resize(self, job: RunningJob) -> bool:
        return self.now - job.last_resize >= self.quotas.min_resize_interval_s

    def set(self, job: str, workers: int) -> None:
        self.journal.append((job, self.target[job]))
        self._set(job, workers)

    def rollback(self, mark: int) -> None:
        while len(self.journal) > mark:
            self._set(*self.journal.pop())

    def admit(self, q: QueuedJob) -> None:
        self.jobs[q.job], self.admitted[q.job], self.target[q.job] = q, q, 0
        self._set(q.job, q.min_workers)

    def _set(self, job: str, workers: int) -> None:
        j, old = self.jobs[job], self.target[job]
        delta = (workers - old) * j.slots_per_worker
        self.target[job] = workers
        self.used += delta
        self.team_used[j.team] = self.team_used.get(j.team, 0) + delta
        if isinstance(j, RunningJob):
            held = self.held.setdefault(j.team, {}).setdefault(self.rank(j), [0, 0, 0, 0])
            at = 0 if self.may_resize(j) else 2
            held[at] += delta
            held[at + 1] += (max(0, workers - j.min_workers) - max(0, old - j.min_workers)) * j.slots_per_worker
        self.memo.clear()
