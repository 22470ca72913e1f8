"""Who runs, with how many workers: the cluster's admission and preemption as one pure decision.

Policies return decisions; one controller carries them out (as cluster/burst.py `decide` and Ray
Train V2's scaling policies). `decide(...)` takes the cluster's capacity, the running jobs, the
queue, the quotas and the clock, and returns an `AdmissionDecision`: jobs to admit (with how many
workers), elastic jobs to shrink or grow, jobs to suspend, and for every job left waiting its
position, the reason and, where one can be made, an estimate of when it starts.

Written by hand because nothing on a plain Ray cluster does it: Ray has no job queue, and Kueue
(which does this on Kubernetes) needs Kubernetes. Imports neither Ray nor torch.

Fast at the size of an organisation (benchmarks/admission_decide.py): slots per team and per
(team, priority) are kept as totals that change with each resize, so a waiting job is first
checked against an upper bound of what could yield to it, and the exact search (which jobs,
in which order) runs only where the bound says it may succeed; results that cannot change until
the plan does are remembered.

The rules, in the order they apply:
- Order: higher priority first, then earlier submission (a suspended job keeps its place).
- A team never holds more than its share's `guaranteed + borrow` slots; past it the job waits
  with a reason naming the team and the quota, unless the team's own lower-priority jobs can
  give the difference. Quota waits block no other team.
- A job that does not fit takes room from running jobs that yield to it: lower-priority jobs of
  its own team; of other teams only what they borrow, to a higher-priority job or to a team
  reclaiming its guarantee (a guarantee is never taken). Other teams' borrowers give first, then
  the lowest priority. Elastic jobs shrink toward `min_workers` first; only if that is not enough
  are jobs suspended (they give up everything). Nothing is touched unless the whole need is met:
  the team's quota and the cluster's capacity together, or neither.
- A job is resized (shrunk, suspended or grown) at most once per `min_resize_interval_s`.
- A job that cannot be placed holds back every lower-priority job behind it (no backfill past
  it), so a large urgent job is not starved by small ones. Jobs of its own priority may start
  past it while they fit (backfill, as Kueue's BestEffortFIFO), but only for `reserve_after_s`:
  once the head of the queue has waited that long it holds a reservation (as Slurm's backfill
  reserves for the highest-priority job, or Kueue's StrictFIFO): no job of its priority or lower
  starts or grows before it, except one that stays within its own team's guarantee (a guarantee
  is never taken, not even by a reservation).
- Free slots left over grow running and admitted elastic jobs toward `max_workers`, most urgent
  first, but never a job of lower priority than one still waiting for capacity.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Iterator

from tidal.admission.decision import (
    AdmissionDecision,
    Admit,
    QueuedJob,
    Resize,
    RunningJob,
    Suspend,
    Waiting,
)
from tidal.admission.plan import Plan
from tidal.admission.quotas import Quotas


def decide(capacity: int, running: Iterable[RunningJob], queue: Iterable[QueuedJob], quotas: Quotas,
           now: float) -> AdmissionDecision:
    """The admission decision for on-prem `capacity` slots (in the quota file's unit)."""
    plan = Plan(quotas, now, capacity, {j.job: j for j in running})
    ordered = sorted(queue, key=lambda q: (-quotas.rank(q.priority), q.submitted_at, q.job))
    waiting: list[Waiting] = []
    head: QueuedJob | None = None  # the most urgent job waiting for capacity
    reserved = False  # whether it has waited long enough to hold back its own priority too
    for q in ordered:
        if head is not None and _held_back(plan, q, head, reserved):
            waiting.append(_behind(plan, q, head, reserved))
            continue
        why = _admit(plan, q)
        if why is None:
            continue
        waiting.append(why)
        if why.why != "quota" and head is None:
            head, reserved = q, now - q.submitted_at >= quotas.reserve_after_s
    grown = _grow(plan, None if head is None else quotas.rank(head.priority))
    return AdmissionDecision(
        admit=tuple(Admit(j, plan.target[j]) for j in plan.admitted),
        shrink=tuple(Resize(j, plan.target[j], r) for j, r in plan.shrunk.items() if j not in plan.suspended),
        grow=grown,
        suspend=tuple(Suspend(j, r) for j, r in plan.suspended.items()),
        waiting=tuple(Waiting(w.job, i + 1, w.why, w.reason, w.starts_at) for i, w in enumerate(waiting)),
    )


def _held_back(plan: Plan, q: QueuedJob, head: QueuedJob, reserved: bool) -> bool:
    """Behind a job waiting for capacity: every lower-priority job; once it holds a reservation,
    its own priority too, except a job that stays within its team's guarantee."""
    rank, head_rank = plan.rank(q), plan.rank(head)
    if rank < head_rank:
        return True
    if not reserved or rank > head_rank:
        return False
    quota = plan.quotas.team(q.team)
    return quota is None or plan.team_slots(q.team) + _need(q) > quota.onprem.guaranteed


def _need(q: QueuedJob) -> int:
    return q.min_workers * q.slots_per_worker


def _admit(plan: Plan, q: QueuedJob) -> Waiting | None:
    """Admit `q` at min_workers if its team's quota and the cluster's capacity can both be met,
    taking room from jobs that yield to it; else change nothing and say why it waits."""
    need, quota, mark = _need(q), plan.quotas.team(q.team), len(plan.journal)
    taken: dict[str, int] = {}
    if quota is not None and plan.team_slots(q.team) + need > quota.onprem.limit:
        if need > quota.onprem.limit:
            return _too_big(q, quota.onprem.limit, quota.onprem.guaranteed, quota.onprem.borrow)
        # within a team priority decides: its own lower-priority jobs may give the difference
        own = _search(plan, q, plan.team_slots(q.team) + need - quota.onprem.limit, own_only=True)
        if own is None:
            return _quota_wait(plan, q, need)
        taken = _apply(plan, own)
    if need > plan.free():
        more = _search(plan, q, need - plan.free())
        if more is None:
            plan.rollback(mark)
            return _capacity_wait(plan, q, need)
        taken |= _apply(plan, more)
    plan.admit(q)
    for job, workers in taken.items():
        book = plan.suspended if workers == 0 else plan.shrunk
        book[job] = (f"{'suspended' if workers == 0 else 'shrunk'} to make room for {q.job!r} "
                     f"({q.priority}, team {q.team!r})")
    return None


def _apply(plan: Plan, taken: dict[str, int]) -> dict[str, int]:
    for job, workers in taken.items():
        plan.set(job, workers)
    return taken


def _search(plan: Plan, q: QueuedJob, missing: int, own_only: bool = False,
            held_back: bool = False) -> dict[str, int] | None:
    """Workers left to each job that yields to `q` so that `missing` slots free up; None if
    they cannot. `held_back`: count jobs resized too recently to yield now as if they could.
    Checked first against the slots that could yield at most, and remembered until the plan
    changes: a waiting job costs a few additions unless it may start."""
    rank, reclaiming = plan.rank(q), _reclaiming(plan, q)
    key = (q.team, rank, reclaiming, own_only, held_back)
    if missing >= plan.memo.get(key, missing + 1):
        return None
    room = _room(plan, q, rank, reclaiming, own_only, held_back)
    bound = _most(room, 0)
    taken = None if bound < missing else _take(
        plan, lambda shrinkable: _victims(plan, q, reclaiming, own_only, held_back, shrinkable), room, missing)
    if taken is None:
        plan.memo[key] = min(plan.memo.get(key, missing), missing if bound >= missing else bound + 1)
    return taken


def _room(plan: Plan, q: QueuedJob, rank: int, reclaiming: bool, own_only: bool,
          held_back: bool) -> dict[str, list[int | None]]:
    """Per team whose jobs yield to `q`: [their slots, their slots above min_workers, what `q` may
    take from the team at most (its loan; None: no cap)], from the plan's totals."""
    out: dict[str, list[int | None]] = {}
    for team, by_rank in plan.held.items():
        quota = plan.quotas.team(team)
        capped = team != q.team and quota is not None
        if (own_only and team != q.team) or (capped and not plan.borrowing(team)):
            continue
        slots = shrink = 0
        for r, h in by_rank.items():
            if r < rank or (capped and reclaiming):
                slots += h[0] + (h[2] if held_back else 0)
                shrink += h[1] + (h[3] if held_back else 0)
        if slots and quota is not None and capped:
            out[team] = [slots, shrink, plan.team_slots(team) - quota.onprem.guaranteed]
        elif slots:
            out[team] = [slots, shrink, None]
    return out


def _most(room: dict[str, list[int | None]], at: int) -> int:
    """What the teams in `room` can give at most: all their slots (at 0) or their slots above
    min_workers (at 1), each within its loan."""
    return sum(min(r[at] or 0, r[2]) if r[2] is not None else (r[at] or 0) for r in room.values())


def _victims(plan: Plan, q: QueuedJob, reclaiming: bool, own_only: bool, held_back: bool,
             shrinkable: bool = False) -> Iterator[RunningJob]:
    """Running jobs that yield to `q`, in the order they give (lazily: a search that is met
    early looks at no more of them); `shrinkable`: only those above their min_workers.

    Within a team (or without quotas) priority alone decides: lower-priority jobs yield. Across
    teams a guarantee is a guarantee: another team yields only what it borrows, to a job of
    higher priority or to a team reclaiming its own guarantee (as Kueue's reclaimWithinCohort).
    Other teams' borrowers give first, then the lowest priority, then the newest."""
    rank, target = plan.rank(q), plan.target
    order = plan.elastic if shrinkable else plan.order
    if not own_only:
        lenders = {t for t in plan.held if t != q.team and plan.quotas.team(t) is not None and plan.borrowing(t)}
        for r in order:
            if r.team in lenders and target[r.job] > (r.min_workers if shrinkable else 0) \
                    and (held_back or plan.may_resize(r)) and (reclaiming or plan.rank(r) < rank):
                yield r
    for r in order:
        if plan.rank(r) >= rank:
            break  # in priority order: no lower-priority job is left
        if (r.team == q.team or (not own_only and plan.quotas.team(r.team) is None)) \
                and target[r.job] > (r.min_workers if shrinkable else 0) and (held_back or plan.may_resize(r)):
            yield r


def _reclaiming(plan: Plan, q: QueuedJob) -> bool:
    quota = plan.quotas.team(q.team)
    return quota is not None and plan.team_slots(q.team) + _need(q) <= quota.onprem.guaranteed


def _take(plan: Plan, victims: Callable[[bool], Iterator[RunningJob]], room: dict[str, list[int | None]],
          missing: int) -> dict[str, int] | None:
    """Workers left to each victim so that `missing` slots free up; None (and nothing taken) if
    they cannot. Elastic jobs shrink toward min_workers first; only where shrinking every one of
    them would not be enough are whole jobs suspended, in order, until shrinking can cover the
    rest: no job is shrunk for slots a suspension frees. `room`: `_room`'s totals, updated here."""
    after: dict[str, int] = {}
    if _most(room, 1) < missing:
        for r in victims(False):
            held, share = plan.target[r.job], room[r.team]
            slots = held * r.slots_per_worker
            if share[2] is not None and slots > share[2]:
                continue  # more than the team lends: a job is suspended whole or not at all
            after[r.job], missing = 0, missing - slots
            share[0] = (share[0] or 0) - slots
            share[1] = (share[1] or 0) - max(0, held - r.min_workers) * r.slots_per_worker
            if share[2] is not None:
                share[2] -= slots
            if missing <= 0 or _most(room, 1) >= missing:
                break
    for r in victims(True) if missing > 0 else ():
        held, share = after.get(r.job, plan.target[r.job]), room[r.team]
        if held == 0:
            continue  # suspended above
        give = min(held - r.min_workers, -(-missing // r.slots_per_worker))
        if share[2] is not None:
            give = min(give, share[2] // r.slots_per_worker)
        if give <= 0:
            continue
        after[r.job], missing = held - give, missing - give * r.slots_per_worker
        if share[2] is not None:
            share[2] -= give * r.slots_per_worker
        if missing <= 0:
            break
    return {j: n for j, n in after.items() if n != plan.target[j]} if missing <= 0 else None


def _too_big(q: QueuedJob, limit: int, guaranteed: int, borrow: int) -> Waiting:
    return Waiting(q.job, 0, "quota", f"needs {_need(q)} slot(s) to start, more than team {q.team!r}'s whole "
                   f"on-prem quota of {limit} (guaranteed {guaranteed} + borrow {borrow}): it cannot start here; "
                   "lower scaling.min_workers or ask for a larger quota")


def _quota_wait(plan: Plan, q: QueuedJob, need: int) -> Waiting:
    quota = plan.quotas.teams[q.team].onprem
    holds = plan.team_slots(q.team)
    over = holds + need - quota.limit
    return Waiting(q.job, 0, "quota", f"team {q.team!r} is at its on-prem quota: it holds {holds} of "
                   f"{quota.limit} slot(s) (guaranteed {quota.guaranteed} + borrow {quota.borrow}) and this job "
                   f"needs {need}; it starts when the team's jobs free {over} slot(s)", _estimate(plan, q.team, over))


def _capacity_wait(plan: Plan, q: QueuedJob, need: int) -> Waiting:
    """Why `q` cannot start yet: jobs resized too recently to yield now, or no job that yields."""
    missing = need - plan.free()
    if _search(plan, q, missing, held_back=True) is not None:
        key = ("first held back", q.team, plan.rank(q), _reclaiming(plan, q))
        if key not in plan.memo:
            victims = _victims(plan, q, _reclaiming(plan, q), False, True)
            plan.memo[key] = min((r for r in victims if not plan.may_resize(r)), key=lambda r: r.last_resize)
        first = plan.memo[key]
        gap = plan.quotas.min_resize_interval_s
        return Waiting(q.job, 0, "resize_interval", f"needs {need} slot(s), {max(plan.free(), 0)} free; job "
                       f"{first.job!r} yields to it but was resized under {gap:g}s ago (the least time between "
                       "two resizes of one job)", first.last_resize + gap)
    guarantees = ", or hold their team's guarantee" if plan.quotas.teams else ""
    return Waiting(q.job, 0, "capacity", f"needs {need} slot(s) and {max(plan.free(), 0)} of {plan.capacity} are "
                   f"free; the jobs holding the rest do not yield to it (equal or higher priority{guarantees})",
                   _estimate(plan, None, missing))


def _behind(plan: Plan, q: QueuedJob, head: QueuedJob, reserved: bool) -> Waiting:
    if plan.rank(q) < plan.rank(head):
        return Waiting(q.job, 0, "priority", f"a higher-priority job is ahead: {head.job!r} ({head.priority}) "
                       "waits for capacity and goes first", None)
    return Waiting(q.job, 0, "reservation", f"{head.job!r} ({head.priority}, {_need(head)} slot(s)) has waited "
                   f"{plan.now - head.submitted_at:.0f}s, past the cluster's reserve_after_s of "
                   f"{plan.quotas.reserve_after_s:g}s: it holds a reservation, and jobs of its priority start "
                   "after it", None)


def _estimate(plan: Plan, team: str | None, missing: int) -> float | None:
    """When enough running jobs (of `team`, or all) will have ended to free `missing` slots;
    None if some end is unknown. Sorted once per team and decision; then a binary search."""
    if team not in plan.ends:
        known = sorted((r for r in plan.running.values() if r.expected_end is not None
                        and (team is None or r.team == team)), key=lambda r: r.expected_end or 0.0)
        plan.ends[team] = ([r.expected_end or 0.0 for r in known], list(itertools.accumulate(r.slots for r in known)))
    ends, freed = plan.ends[team]
    i = bisect.bisect_left(freed, missing)
    return ends[i] if i < len(ends) else None


def _grow(plan: Plan, blocked_at: int | None) -> tuple[Resize, ...]:
    """Give free slots to elastic jobs below max_workers, most urgent first, within team quotas,
    never to a job of a priority at or below one still waiting for capacity."""
    grown: dict[str, int] = {}
    jobs = [*plan.running.values(), *plan.admitted.values()]
    for j in sorted(jobs, key=lambda j: (-plan.rank(j), j.submitted_at)):
        if blocked_at is not None and plan.rank(j) <= blocked_at:
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
            plan.set(j.job, plan.target[j.job] + add)
            if isinstance(j, RunningJob):
                grown[j.job] = plan.target[j.job]
    return tuple(Resize(j, n, "free capacity: growing back toward max_workers") for j, n in grown.items())


__all__ = ["decide"]
