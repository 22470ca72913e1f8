"""Every job's cloud burst in one autoscaler request, within each team's cloud quota and budget.

Ray's `request_resources` is global: each call replaces the previous one, so one job's burst
wiped another's when every job called it. The owner of cluster capacity calls it once with the
sum that `aggregate_bursts` returns. Like `request_resources` itself, each job's request is the
cloud capacity it needs in total (held plus missing), so the sum sizes the cloud for all of them
at once. Pure: the caller measures each team's use today (GPU-hours and cost, from the nodes'
`tidal.io/price-per-hour` labels: tidal/prices.py) and carries the result out. `load_use` and
`save_use` keep each team's use today beside the queue document, so a budget outlives a restart.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from tidal import fs
from tidal.admission.quotas import Quotas
from tidal.prices import PRICE_LABEL, worker_price
from tidal.sites import node_site


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


def day(now: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(now))


def load_use(location: str, now: float) -> dict[str, Any]:
    """Today's cloud use per team (a new day starts empty); the budget outlives a restart."""
    filesystem, path = fs.resolve(location)
    data = fs.read_json(filesystem, path) if fs.exists(filesystem, path) else None
    if not isinstance(data, dict) or data.get("day") != day(now):
        return {"day": day(now), "teams": {}}
    return {"day": data["day"], "teams": {t: CloudUse(**u) for t, u in data.get("teams", {}).items()}}


def accrue(use: dict[str, Any], plan: BurstPlan, bursts: Mapping[str, BurstRequest], nodes: list[dict[str, Any]],
           hours: float, now: float) -> dict[str, Any]:
    """Each team's cloud use today plus `hours` of what `plan` granted its jobs (GPU-hours, and
    cost at the live cloud nodes' price labels); a new day starts empty."""
    if day(now) != use["day"]:
        use = {"day": day(now), "teams": {}}
    cloud = [n for n in nodes if n.get("Alive") and PRICE_LABEL in (n.get("Labels") or {})
             and node_site(n.get("Resources") or {}, n.get("Labels") or {}) == "cloud"]
    for job, n in plan.granted.items():
        r = bursts.get(job)
        if r is None:
            continue
        gpus, cpus = r.bundle.get("GPU", 0.0), r.bundle.get("CPU", 0.0)
        price = worker_price(cloud[0]["Labels"], cloud[0]["Resources"], cpus, gpus) if cloud else None
        used = use["teams"].get(r.team, CloudUse())
        use["teams"][r.team] = used.plus(hours, n * gpus, None if price is None else n * price)
    return use


def save_use(location: str, use: dict[str, Any]) -> None:
    filesystem, path = fs.resolve(location)
    fs.write_json(filesystem, path, {"day": use["day"], "teams": {t: asdict(u) for t, u in use["teams"].items()}})


__all__ = ["BurstPlan", "BurstRequest", "CloudUse", "Refusal", "accrue", "aggregate_bursts", "day", "load_use", "save_use"]
