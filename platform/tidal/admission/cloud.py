"""Every job's cloud burst in one autoscaler request, within each team's cloud quota and budget.

Ray's `request_resources` is global: each call replaces the previous one, so one job's burst
wiped another's when every job called it. The owner of cluster capacity calls it once with the
sum that `aggregate_bursts` returns. Like `request_resources` itself, each job's request is the
cloud capacity it needs in total (held plus missing), so the sum sizes the cloud for all of them
at once. Pure: the caller measures each team's use today (GPU-hours and cost, from the nodes'
`tidal.io/price-per-hour` labels: cluster/prices.py) and carries the result out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from tidal.admission.quotas import Quotas


@dataclass(frozen=True)
class BurstRequest:
    """One job's cloud need: `bundles` copies of `bundle` (a worker's resources), each worth
    `slots_per_bundle` slots in the quota file's unit."""

    job: str
    team: str
    bundles: int
    bundle: Mapping[str, float]
    slots_per_bundle: int = 1


@dataclass(frozen=True)
class CloudUse:
    """What a team's cloud workers used today."""

    gpu_hours: float = 0.0
    cost: float = 0.0

    def plus(self, hours: float, gpus: float, price_per_hour: float | None) -> CloudUse:
        """This use and one cloud worker's `hours` more: `gpus` GPUs at `price_per_hour` (the
        worker's share of its node's `tidal.io/price-per-hour`: prices.worker_price; None: unpriced)."""
        return CloudUse(self.gpu_hours + hours * gpus, self.cost + hours * (price_per_hour or 0.0))


@dataclass(frozen=True)
class Refusal:
    job: str
    team: str
    reason: str


@dataclass(frozen=True)
class BurstPlan:
    """The one request for the autoscaler (`bundles`), what each job got, and who was refused."""

    bundles: tuple[dict[str, float], ...] = ()
    granted: dict[str, int] = field(default_factory=dict)
    refused: tuple[Refusal, ...] = ()


def aggregate_bursts(requests: Iterable[BurstRequest], use: Mapping[str, CloudUse], quotas: Quotas) -> BurstPlan:
    """The sum of every job's burst, less what a team's cloud budget or cloud quota refuses.

    `requests` come most urgent first: when a team's cloud quota cannot hold all its jobs' bursts,
    the first ones get it."""
    bundles: list[dict[str, float]] = []
    granted: dict[str, int] = {}
    refused: list[Refusal] = []
    team_slots: dict[str, int] = {}
    for r in requests:
        if r.bundles <= 0:
            continue
        over = _over_budget(r.team, use.get(r.team, CloudUse()), quotas)
        if over:
            refused.append(Refusal(r.job, r.team, over))
            continue
        n = _within_quota(r, team_slots.get(r.team, 0), quotas)
        if n == 0:
            limit = quotas.teams[r.team].cloud.limit
            refused.append(Refusal(r.job, r.team, f"burst refused: team {r.team!r} has reached its cloud quota of "
                                   f"{limit} slot(s) (cloud.guaranteed + cloud.borrow in the quota file)"))
            continue
        granted[r.job] = n
        team_slots[r.team] = team_slots.get(r.team, 0) + n * r.slots_per_bundle
        bundles += [dict(r.bundle) for _ in range(n)]
    return BurstPlan(tuple(bundles), granted, tuple(refused))


def _over_budget(team: str, used: CloudUse, quotas: Quotas) -> str | None:
    """A refusal naming the team and its budget, once the day's use has reached it."""
    quota = quotas.team(team)
    budget = quota.cloud_budget if quota else None
    if budget is None:
        return None
    if budget.gpu_hours_per_day is not None and used.gpu_hours >= budget.gpu_hours_per_day:
        spent = f"{used.gpu_hours:.1f} GPU-hours used today"
    elif budget.cost_per_day is not None and used.cost >= budget.cost_per_day:
        spent = f"{used.cost:.2f} spent today"
    else:
        return None
    return (f"burst refused: team {team!r} has used its cloud budget of {budget.describe()} ({spent}); its jobs "
            "keep running on on-prem capacity. Raise teams."
            f"{team}.cloud_budget in the quota file, or wait for the next day")


def _within_quota(r: BurstRequest, held: int, quotas: Quotas) -> int:
    """How many of the request's bundles fit in the team's cloud quota beside its earlier ones."""
    quota = quotas.team(r.team)
    if quota is None:
        return r.bundles
    room = max(0, quota.cloud.limit - held) // r.slots_per_bundle
    return min(r.bundles, room)


__all__ = ["BurstPlan", "BurstRequest", "CloudUse", "Refusal", "aggregate_bursts"]
