"""Who runs, with how many workers: the cluster's admission and preemption as one pure decision.

Policies return decisions; one controller carries them out (as cluster/burst.py `decide` and Ray
Train V2's scaling policies). `decide(...)` takes the cluster's capacity, the running jobs, the
queue, the quotas and the clock, and returns an `AdmissionDecision`: jobs to admit (with how many
workers), elastic jobs to shrink or grow, jobs to suspend, and for every job left waiting its
position, the reason and, where one can be made, an estimate of when it starts.

Written by hand because nothing on a plain Ray cluster does it: Ray has no job queue, and Kueue
(which does this on Kubernetes) needs Kubernetes. Imports neither Ray nor torch.

The rules, in the order they apply:
- Order: higher priority first, then earlier submission (a suspended job keeps its place).
- A team never holds more than its share's `guaranteed + borrow` slots; past it the job waits
  with a reason naming the team and the quota, unless the team's own lower-priority jobs can
  give the difference. Quota waits block no other team.
- A job that does not fit takes room from running jobs that yield to it: lower-priority jobs of
  its own team; of other teams only what they borrow, to a higher-priority job or to a team
  reclaiming its guarantee (a guarantee is never taken). Other teams' borrowers give first, then
  the lowest priority. Elastic jobs shrink toward `min_workers` first; only if that is not enough
  are jobs suspended (they give up everything). Nothing is touched unless the whole need is met.
- A job is resized (shrunk, suspended or grown) at most once per `min_resize_interval_s`.
- A job that cannot be placed holds back every lower-priority job behind it (no backfill past
  it), so a large urgent job is not starved by small ones.
- Free slots left over grow running and admitted elastic jobs toward `max_workers`, most urgent
  first, but never a job of lower priority than one still waiting for capacity.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from tidal.admission.quotas import Quotas

Why = Literal["capacity", "quota", "priority", "resize_interval"]


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


@dataclass
class _Plan:
    """The decision being built: each job's workers after it, and who changed."""

    quotas: Quotas
    now: float
    capacity: int
    running: dict[str, RunningJob]
    target: dict[str, int]
    admitted: dict[str, QueuedJob] = field(default_factory=dict)
    shrunk: dict[str, str] = field(default_factory=dict)
    suspended: dict[str, str] = field(default_factory=dict)

    def slots(self, job: str) -> int:
        spw = (self.running[job] if job in self.running else self.admitted[job]).slots_per_worker
        return self.target[job] * spw

    def free(self) -> int:
        return self.capacity - sum(self.slots(j) for j in self.target)

    def team_slots(self, team: str) -> int:
        return sum(self.slots(j) for j in self.target if _team_of(self, j) == team)

    def borrowing(self, team: str) -> bool:
        quota = self.quotas.team(team)
        return quota is not None and self.team_slots(team) > quota.onprem.guaranteed

    def may_resize(self, job: RunningJob) -> bool:
        return self.now - job.last_resize >= self.quotas.min_resize_interval_s


def decide(capacity: int, running: Iterable[RunningJob], queue: Iterable[QueuedJob], quotas: Quotas,
           now: float) -> AdmissionDecision:
    """The admission decision for on-prem `capacity` slots (in the quota file's unit)."""
    run = {j.job: j for j in running}
    plan = _Plan(quotas, now, capacity, run, {j: r.workers for j, r in run.items()})
    ordered = sorted(queue, key=lambda q: (-quotas.rank(q.priority), q.submitted_at, q.job))
    waiting: list[Waiting] = []
    blocked_at: int | None = None  # rank of the most urgent job waiting for capacity
    for q in ordered:
        if blocked_at is not None and quotas.rank(q.priority) < blocked_at:
            waiting.append(_behind(q, ordered, waiting))
            continue
        why = _quota_wait(plan, q) or _place(plan, q)
        if why is None:
            continue
        waiting.append(why)
        if why.why != "quota" and blocked_at is None:
            blocked_at = quotas.rank(q.priority)
    grown = _grow(plan, blocked_at)
    return AdmissionDecision(
        admit=tuple(Admit(j, plan.target[j]) for j in plan.admitted),
        shrink=tuple(Resize(j, plan.target[j], r) for j, r in plan.shrunk.items() if j not in plan.suspended),
        grow=grown,
        suspend=tuple(Suspend(j, r) for j, r in plan.suspended.items()),
        waiting=tuple(Waiting(w.job, i + 1, w.why, w.reason, w.starts_at) for i, w in enumerate(waiting)),
    )


def _team_of(plan: _Plan, job: str) -> str:
    return (plan.running[job] if job in plan.running else plan.admitted[job]).team


def _quota_wait(plan: _Plan, q: QueuedJob) -> Waiting | None:
    """The job waits if admitting it at min_workers would take its team past its on-prem quota,
    unless the team's own lower-priority jobs can give the difference (within a team, priority
    decides): then they are shrunk or suspended for it."""
    quota = plan.quotas.team(q.team)
    if quota is None:
        return None
    holds, need = plan.team_slots(q.team), q.min_workers * q.slots_per_worker
    if holds + need <= quota.onprem.limit:
        return None
    own = [r for r in _victims(plan, q) if r.team == q.team and plan.may_resize(r)]
    if need <= quota.onprem.limit and (taken := _take(plan, q, own, holds + need - quota.onprem.limit)) is not None:
        _yield_to(plan, q, taken)
        return None
    if need > quota.onprem.limit:
        return Waiting(q.job, 0, "quota", f"needs {need} slot(s) to start, more than team {q.team!r}'s whole "
                       f"on-prem quota of {quota.onprem.limit} (guaranteed {quota.onprem.guaranteed} + borrow "
                       f"{quota.onprem.borrow}): it cannot start here; lower scaling.min_workers or ask for a "
                       "larger quota")
    ends = [r for r in plan.running.values() if r.team == q.team]
    return Waiting(q.job, 0, "quota", f"team {q.team!r} is at its on-prem quota: it holds {holds} of "
                   f"{quota.onprem.limit} slot(s) (guaranteed {quota.onprem.guaranteed} + borrow "
                   f"{quota.onprem.borrow}) and this job needs {need}; it starts when the team's jobs free "
                   f"{holds + need - quota.onprem.limit} slot(s)", _estimate(ends, holds + need - quota.onprem.limit))


def _place(plan: _Plan, q: QueuedJob) -> Waiting | None:
    """Admit `q` at min_workers, taking room from jobs that yield to it; else say why it waits."""
    need = q.min_workers * q.slots_per_worker
    if need > plan.free():
        victims = [r for r in _victims(plan, q) if plan.may_resize(r)]
        taken = _take(plan, q, victims, need - plan.free())
        if taken is None:
            return _capacity_wait(plan, q, need)
        _yield_to(plan, q, taken)
    plan.admitted[q.job] = q
    plan.target[q.job] = q.min_workers
    return None


def _yield_to(plan: _Plan, q: QueuedJob, taken: dict[str, int]) -> None:
    """Record that the jobs in `taken` shrink to (or, at 0, are suspended for) `q`."""
    for job, workers in taken.items():
        plan.target[job] = workers
        book = plan.suspended if workers == 0 else plan.shrunk
        book[job] = (f"{'suspended' if workers == 0 else 'shrunk'} to make room for {q.job!r} "
                     f"({q.priority}, team {q.team!r})")


def _victims(plan: _Plan, q: QueuedJob) -> list[RunningJob]:
    """Running jobs that yield to `q`, in the order they give.

    Within a team (or without quotas) priority alone decides: lower-priority jobs yield. Across
    teams a guarantee is a guarantee: another team yields only what it borrows, to a job of
    higher priority or to a team reclaiming its own guarantee (as Kueue's reclaimWithinCohort).
    Other teams' borrowers give first, then the lowest priority, then the newest."""
    rank, reclaiming = plan.quotas.rank(q.priority), _reclaiming(plan, q)

    def yields(r: RunningJob) -> bool:
        lower = plan.quotas.rank(r.priority) < rank
        if _capped(plan, q, r) is None:
            return lower
        return plan.borrowing(r.team) and (lower or reclaiming)
    chosen = [r for r in plan.running.values() if yields(r) and plan.target[r.job] > 0]
    return sorted(chosen, key=lambda r: (_capped(plan, q, r) is None, plan.quotas.rank(r.priority), -r.submitted_at))


def _reclaiming(plan: _Plan, q: QueuedJob) -> bool:
    quota = plan.quotas.team(q.team)
    return quota is not None and plan.team_slots(q.team) + q.min_workers * q.slots_per_worker \
        <= quota.onprem.guaranteed


def _capped(plan: _Plan, q: QueuedJob, r: RunningJob) -> int | None:
    """What `q` may take from `r`'s team at most: its loan, when it is another team with a quota;
    None (no cap, priority alone) for `q`'s own team or a team without a quota."""
    quota = plan.quotas.team(r.team)
    if r.team == q.team or quota is None:
        return None
    return max(0, plan.team_slots(r.team) - quota.onprem.guaranteed)


def _take(plan: _Plan, q: QueuedJob, victims: list[RunningJob], missing: int) -> dict[str, int] | None:
    """Workers left to each victim so that `missing` slots free up: shrink elastic jobs toward
    min_workers first, then suspend whole jobs; None (and nothing taken) if that cannot free enough."""
    after = {r.job: plan.target[r.job] for r in victims}
    loans = {r.team: cap for r in victims if (cap := _capped(plan, q, r)) is not None}
    for whole in (False, True):
        for r in victims:
            if missing <= 0:
                break
            give = after[r.job] - (0 if whole else r.min_workers)
            if r.team in loans:
                give = min(give, loans[r.team] // r.slots_per_worker)
            if whole and give < after[r.job]:
                continue  # a job is suspended whole or not at all
            give = give if whole else min(give, -(-missing // r.slots_per_worker))
            if give <= 0:
                continue
            after[r.job] -= give
            missing -= give * r.slots_per_worker
            if r.team in loans:
                loans[r.team] -= give * r.slots_per_worker
    return {j: n for j, n in after.items() if n != plan.target[j]} if missing <= 0 else None


def _capacity_wait(plan: _Plan, q: QueuedJob, need: int) -> Waiting:
    """Why `q` cannot start yet: jobs resized too recently to yield now, or no job that yields."""
    held_back = [r for r in _victims(plan, q) if not plan.may_resize(r)]
    if held_back and _take(plan, q, _victims(plan, q), need - plan.free()) is not None:
        first = min(held_back, key=lambda r: r.last_resize)
        at = first.last_resize + plan.quotas.min_resize_interval_s
        return Waiting(q.job, 0, "resize_interval", f"needs {need} slot(s), {max(plan.free(), 0)} free; job "
                       f"{first.job!r} yields to it but was resized under {plan.quotas.min_resize_interval_s:g}s "
                       "ago (the least time between two resizes of one job)", at)
    guarantees = ", or hold their team's guarantee" if plan.quotas.teams else ""
    return Waiting(q.job, 0, "capacity", f"needs {need} slot(s) and {max(plan.free(), 0)} of {plan.capacity} are "
                   f"free; the jobs holding the rest do not yield to it (equal or higher priority{guarantees})",
                   _estimate(plan.running.values(), need - plan.free()))


def _behind(q: QueuedJob, ordered: list[QueuedJob], waiting: list[Waiting]) -> Waiting:
    ahead = next(w for w in waiting if w.why != "quota")
    first = next(o for o in ordered if o.job == ahead.job)
    return Waiting(q.job, 0, "priority", f"a higher-priority job is ahead: {first.job!r} ({first.priority}) "
                   "waits for capacity and goes first", None)


def _estimate(jobs: Iterable[RunningJob], missing: int) -> float | None:
    """When enough of `jobs` will have ended to free `missing` slots; None if some end is unknown."""
    total = 0
    for r in sorted(jobs, key=lambda r: (r.expected_end is None, r.expected_end or 0.0)):
        if r.expected_end is None:
            return None
        total += r.slots
        if total >= missing:
            return r.expected_end
    return None


def _grow(plan: _Plan, blocked_at: int | None) -> tuple[Resize, ...]:
    """Give free slots to elastic jobs below max_workers, most urgent first, within team quotas."""
    grown: dict[str, int] = {}
    jobs = [*plan.running.values(), *plan.admitted.values()]
    for j in sorted(jobs, key=lambda j: (-plan.quotas.rank(j.priority), j.submitted_at)):
        if blocked_at is not None and plan.quotas.rank(j.priority) <= blocked_at:
            break
        if j.job in plan.suspended or j.job in plan.shrunk:
            continue
        if isinstance(j, RunningJob) and not plan.may_resize(j):
            continue
        room = plan.free() // j.slots_per_worker
        quota = plan.quotas.team(j.team)
        if quota is not None:
            room = min(room, (quota.onprem.limit - plan.team_slots(j.team)) // j.slots_per_worker)
        add = min(j.max_workers - plan.target[j.job], room)
        if add > 0:
            plan.target[j.job] += add
            if isinstance(j, RunningJob):
                grown[j.job] = plan.target[j.job]
    return tuple(Resize(j, n, "free capacity: growing back toward max_workers") for j, n in grown.items())


__all__ = ["Admit", "AdmissionDecision", "QueuedJob", "Resize", "RunningJob", "Suspend", "Waiting", "decide"]
