"""Where a job's workers run: on-prem first, cloud burst after a wait.

Policies return decisions; one controller carries them out (as Ray Train V2's ResizeDecision):
- `decide(...)` is a pure function of what the cluster has free now and how long the job has
  waited. It returns a `BurstDecision`: run now, wait for on-prem room, or burst (ask the
  autoscaler for cloud nodes).
- `scaling_overrides(spec)` pins workers to a site through a sliver of the site's custom
  resource (`site_onprem` / `site_cloud`, declared on every node by cluster_configs/), which both
  autoscaler versions understand.
- `burst_capacity(spec)` is the controller, wrapped around `trainer.fit()`. With `site: any` on
  a cluster whose nodes carry site resources and which runs an autoscaler, it waits up to
  `scaling.burst_after_s` for on-prem room for `min_workers`, then asks for cloud capacity with
  `ray.autoscaler.sdk.request_resources` and clears that request when the job ends, so the
  autoscaler releases the idle cloud nodes after their idle timeout. Under the cluster's
  admission (a quota file: admission/actor.py) the job hands its need to the admission actor
  instead, which sends every job's need summed (the call is global: it must have one caller),
  within each team's cloud quota and budget.

Why wait before `fit()`: once `fit()` starts, Ray Train itself asks the autoscaler for all its
workers (Train V2's AutoscalingCoordinator), and the autoscaler would launch cloud nodes at once.
Holding `fit()` back for `burst_after_s` is what gives on-prem nodes the first chance.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from tidal.admission.handle import admitter
from tidal.admission.naming import admission_enabled, job_key
from tidal.ray_private import autoscaler_report, available_resources_per_node
from tidal.sites import SITE_LABEL, SITES, node_site, site_resource
from tidal.spec.job import JobSpec

# A worker pinned to a site takes this much of the site resource (nodes declare 1000), so one
# node can hold many pinned workers while the pin still excludes nodes of the other site.
SITE_SLIVER = 0.001
POLL_S = 1.0
# How long to wait for requested cloud nodes before handing over to fit() anyway. Train V2
# gives up on a worker group that cannot start within RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S
# (60 s by default), shorter than a cloud GPU node's boot, so the wait happens here.
LAUNCH_WAIT_S = 900.0

Action = Literal["run", "wait", "burst"]


@dataclass(frozen=True)
class SiteRoom:
    """Workers of one job's shape that fit on each site: free now, and in total (busy or not)."""

    onprem_free: int = 0
    cloud_free: int = 0
    cloud_total: int = 0


@dataclass(frozen=True)
class BurstDecision:
    """What to do now. `worker_resource` is the site resource each worker bundle requires
    (None: either site); `cloud_bundles` is how many worker-shaped bundles on the cloud site to
    ask the autoscaler for (0: ask for nothing)."""

    action: Action
    worker_resource: str | None
    cloud_bundles: int
    reason: str


# ---------------------------------------------------------------------------------------------
# The policy: pure functions
# ---------------------------------------------------------------------------------------------

def decide(site: str, needed: int, room: SiteRoom, waited_s: float, burst_after_s: float,
           autoscaler: bool) -> BurstDecision:
    """The placement decision for a job that needs `needed` workers to start."""
    if site in SITES:
        return BurstDecision("run", site_resource(site), 0,
                             f"scaling.site is {site!r}: every worker requires {site_resource(site)}")
    here = room.onprem_free + room.cloud_free
    if room.onprem_free >= needed:
        return BurstDecision("run", None, 0, f"on-prem has room for {room.onprem_free} worker(s); "
                             f"{needed} needed to start")
    if here >= needed:
        return BurstDecision("run", None, 0, f"{room.onprem_free} on-prem slot(s) plus "
                             f"{room.cloud_free} idle cloud slot(s) already up hold the {needed} workers")
    if not autoscaler:
        return BurstDecision("run", None, 0, f"room for {here} of {needed} worker(s) and no "
                             "autoscaler: the job queues in Ray until nodes free up")
    if waited_s < burst_after_s:
        return BurstDecision("wait", None, 0, f"on-prem has room for {room.onprem_free} of {needed} "
                             f"worker(s); waiting up to {burst_after_s - waited_s:.0f}s more before bursting")
    missing = needed - here
    # The autoscaler sizes the cluster's TOTAL capacity to fit a request, busy nodes included,
    # so the request covers every cloud slot that exists plus the missing ones.
    return BurstDecision("burst", None, room.cloud_total + missing,
                         f"on-prem still has room for only {room.onprem_free} of {needed} worker(s) "
                         f"after {waited_s:.0f}s: asking the autoscaler for {missing} cloud worker slot(s)")


def worker_bundle(spec: JobSpec) -> dict[str, float]:
    """One worker's resources, as launch/trainer.py gives them to ScalingConfig."""
    s = spec.scaling
    return {"CPU": s.cpus_per_worker, **({"GPU": s.gpus_per_worker} if s.gpus_per_worker else {})}


def scaling_overrides(spec: JobSpec) -> dict[str, Any]:
    """Keyword arguments for Ray's ScalingConfig that place the workers by `scaling.site`."""
    site = spec.scaling.site
    pin = {site_resource(site): SITE_SLIVER} if site in SITES else {}
    return {"resources_per_worker": {**worker_bundle(spec), **pin}}


def cloud_request(spec: JobSpec, bundles: int) -> tuple[list[dict[str, float]], list[dict[str, str]]]:
    """`request_resources` arguments for `bundles` worker-shaped bundles on the cloud site.

    The site resource steers autoscaler v1; the label selector steers v2."""
    bundle = {**worker_bundle(spec), site_resource("cloud"): SITE_SLIVER}
    return [dict(bundle) for _ in range(bundles)], [{SITE_LABEL: "cloud"} for _ in range(bundles)]


def slots(available: Mapping[str, float], bundle: Mapping[str, float]) -> int:
    """How many copies of `bundle` fit in `available`."""
    counts = [math.floor(available.get(k, 0.0) / v + 1e-9) for k, v in bundle.items() if v > 0]
    return max(0, min(counts)) if counts else 0


def site_room(nodes: list[dict[str, Any]], available: Mapping[str, Mapping[str, float]],
              bundle: Mapping[str, float]) -> SiteRoom:
    """SiteRoom from `ray.nodes()` entries and `available_resources_per_node()`."""
    onprem_free = cloud_free = cloud_total = 0
    for n in nodes:
        if not n.get("Alive"):
            continue
        site = node_site(n.get("Resources") or {}, n.get("Labels") or {})
        free = slots(available.get(n["NodeID"], {}), bundle)
        if site == "onprem":
            onprem_free += free
        elif site == "cloud":
            cloud_free += free
            cloud_total += slots(n.get("Resources") or {}, bundle)
    return SiteRoom(onprem_free, cloud_free, cloud_total)


# ---------------------------------------------------------------------------------------------
# The controller: reads the cluster, carries the decisions out
# ---------------------------------------------------------------------------------------------

@dataclass
class BurstWatcher:
    """Carries out `decide` for one job on the connected cluster."""

    spec: JobSpec
    poll_s: float = POLL_S
    launch_wait_s: float = LAUNCH_WAIT_S
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    requested: int = 0
    refused: str | None = None  # admission's word on this job's burst (a team's cloud budget or quota)
    placements: list[dict[str, int]] = field(default_factory=list)

    def room(self) -> SiteRoom:
        import ray

        return site_room(ray.nodes(), available_resources_per_node(), worker_bundle(self.spec))

    def wait_for_room(self) -> BurstDecision:
        """Poll the cluster until the policy says run or burst; carry out a burst."""
        s = self.spec.scaling
        start = self.clock()
        last_reason = ""
        while True:
            decision = decide(s.site, s.min_workers, self.room(), self.clock() - start,
                              s.burst_after_s, autoscaler=True)
            if decision.reason != last_reason and decision.action == "wait":
                _say(decision.reason)
            last_reason = decision.reason
            if decision.action != "wait":
                break
            self.sleep(self.poll_s)
        _say(f"placement: {decision.reason}")
        if decision.action == "burst":
            self.request(decision.cloud_bundles)
            if self.requested:  # refused (a team's cloud budget): the job waits for on-prem room instead
                self.wait_for_launch(s.min_workers)
        return decision

    def request(self, bundles: int) -> None:
        shapes, selectors = cloud_request(self.spec, bundles)
        if admission_enabled(os.environ):
            self._through_admission(bundles, shapes[0] if shapes else {})
            return
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=shapes, bundle_label_selectors=selectors)
        self.requested = bundles

    def _through_admission(self, bundles: int, bundle: dict[str, float]) -> None:
        """The job's need, to the admission actor (it sums every job's); a refusal (the team's
        cloud budget or quota) is said once, and the job runs on what on-prem has."""
        import ray

        from tidal.admission.quotas import cluster_quotas, resolve_scheduling

        team, _ = resolve_scheduling(self.spec.scheduling.team, self.spec.scheduling.priority,
                                     cluster_quotas(os.environ))
        handle = admitter(create=True)
        got = ray.get(handle.burst.remote(job_key(self.spec.name, storage=self.spec.checkpoint.storage), team, bundles, bundle), timeout=30)
        if got["refused"] and got["refused"] != self.refused:
            _say(got["refused"])
        self.refused = got["refused"]
        self.requested = 0 if got["refused"] else bundles

    def wait_for_launch(self, needed: int) -> None:
        """Until the requested nodes have joined (or launch_wait_s), re-asserting the request:
        another job's Ray Train coordinator may overwrite the cluster-wide request meanwhile
        (under admission the admission actor re-asserts every job's request: admission/actor.py)."""
        deadline = self.clock() + self.launch_wait_s
        while self.clock() < deadline:
            room = self.room()
            if room.onprem_free + room.cloud_free >= needed:
                _say(f"cloud capacity is up: {room.onprem_free} on-prem + {room.cloud_free} cloud worker slot(s)")
                return
            if not admission_enabled(os.environ):  # the admission actor re-asserts the sum itself
                self.request(self.requested)
            self.sleep(self.poll_s)
        _say(f"WARNING: cloud nodes did not join within {self.launch_wait_s:.0f}s; "
             "starting anyway, Ray queues the workers until they do")

    def clear(self) -> None:
        """Withdraw the request so that the autoscaler can release idle cloud nodes.

        The request is cluster-wide: other jobs' Ray Train coordinators re-send theirs within 20 s."""
        if not self.requested:
            return
        if admission_enabled(os.environ):
            self._through_admission(0, {})
        else:
            from ray.autoscaler.sdk import request_resources

            request_resources(bundles=[])
        self.requested = 0
        _say("cloud capacity request withdrawn; the autoscaler releases idle cloud nodes after their idle timeout")

    def record_placement(self) -> dict[str, int]:
        """Count this cluster's live Ray Train workers per site, print it when it changes."""
        from tidal.cluster.status import train_workers_by_site

        counts = train_workers_by_site()
        if counts and (not self.placements or counts != self.placements[-1]):
            self.placements.append(counts)
            where = ", ".join(f"{n} on {site}" for site, n in sorted(counts.items()))
            _say(f"workers running: {where}")
        return counts


def cluster_can_burst() -> bool:
    """An autoscaler runs and some node carries a site resource (a Tidal cluster config)."""
    import ray

    if "autoscaler_report" not in autoscaler_report():
        return False
    return any(node_site(n.get("Resources") or {}, n.get("Labels") or {}) for n in ray.nodes() if n.get("Alive"))


@contextmanager
def burst_capacity(spec: JobSpec, watch_s: float = 2.0) -> Iterator[BurstWatcher | None]:
    """Around `trainer.fit()`: on-prem first, cloud after `burst_after_s`, request cleared at exit.

    A no-op (yields None) unless `scaling.site` is "any" and the cluster can burst."""
    site = spec.scaling.site
    if site in SITES:
        _say(f"placement: scaling.site is {site!r}: workers run only on nodes labelled {SITE_LABEL}={site}")
        yield None
        return
    if not cluster_can_burst():
        yield None
        return
    watcher = BurstWatcher(spec)
    watcher.wait_for_room()
    stop = threading.Event()
    thread = threading.Thread(target=_watch, args=(watcher, stop, watch_s), daemon=True, name="tidal-burst-watch")
    thread.start()
    try:
        yield watcher
    finally:
        stop.set()
        thread.join(timeout=10)
        watcher.clear()


def _watch(watcher: BurstWatcher, stop: threading.Event, every_s: float) -> None:
    # Best effort: the state API can be briefly unavailable; placement lines are informational.
    while not stop.wait(every_s):
        try:
            watcher.record_placement()
        except Exception as e:  # noqa: BLE001 - a status line must never break a training job
            _say(f"could not list workers ({type(e).__name__}); retrying")


def _say(message: str) -> None:
    print(f"[tidal] {message}", flush=True)


__all__ = ["BurstDecision", "BurstWatcher", "SiteRoom", "burst_capacity", "cloud_request",
           "cluster_can_burst", "decide", "scaling_overrides", "site_room", "slots", "worker_bundle"]
