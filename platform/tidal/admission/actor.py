"""The cluster's admission, live: one detached Ray actor on the head carries out `admission.decide`.

Why by hand: open-source Ray has no job queue (ray#32116, #41241), and Kueue, which does this on
Kubernetes, needs Kubernetes. The actor is the one owner of the cluster's capacity decisions:
- every job's driver (`tidal run` under any face: the CLI, the SDK, `ray job submit -- tidal run`)
  registers it and waits while it is QUEUED (admission/seat.py);
- once a second it decides (admission.decide) and saves the queue (queue_state) before anyone
  acts on the decision, so a restarted actor finds what the last one promised;
- each job's rank 0 polls its target (worker/health/directive.py); a job told to shrink, grow or
  suspend checkpoints at its next log step and its driver restarts it at the new size.
- a submitted job that waits long parks (admission/parking.py): its driver leaves, the actor keeps
  its place and package, and submits its driver again through the Jobs API once it is admitted.

No new single point of failure: the state lives in the queue document (TIDAL_STORAGE or the
head's disk), the actor restarts by itself (max_restarts=-1) and reloads it, and while it is
down running jobs train on at their size (their polls fail, their directive stays). A job whose
driver stops checking in for `LEASE_S` (its driver died) gives its slots back.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from tidal.admission.cloud import (
    BurstPlan,
    BurstRequest,
    accrue,
    aggregate_bursts,
    load_use,
    save_use,
)
from tidal.admission.gauges import queue_gauges, team_values
from tidal.admission.parking import CHECK_S, ParkedStarts, Pinner, Pins, stopped_soon
from tidal.admission.policy import decide
from tidal.admission.queue_doc import (
    Entry,
    Queue,
    apply,
    changed,
    document,
    finished,
    is_submission_id,
    load_or_set_aside,
    row,
    running,
    save_queue,
    submitted,
    waiting,
    with_world,
)
from tidal.admission.quotas import Quotas, load_quotas
from tidal.admission.registration import checked_registration, holder_digest
from tidal.admission.relaunch import (
    JobsApi,
    Relauncher,
    Relaunches,
    cluster_jobs_api,
    current_head,
)
from tidal.errors import TidalError
from tidal.sites import SITE_LABEL, node_site

log = logging.getLogger("tidal")
TICK_S = 1.0
LEASE_S = float(os.environ.get("TIDAL_ADMISSION_LEASE_S", "60"))  # a driver silent this long is gone
REASSERT_S = 10.0  # Ray Train's autoscaling coordinator also calls request_resources (every 20 s)
USE_SAVE_S = 30.0  # how often each team's cloud use today is written down while bursts run


def onprem_capacity(quotas: Quotas, nodes: list[dict[str, Any]]) -> int:
    """On-prem slots in the quota file's unit: its `capacity`, else the live non-cloud nodes' GPUs
    (unit gpus) or CPUs (unit workers: one worker a CPU). Cloud capacity comes through bursts."""
    if quotas.capacity is not None:
        return quotas.capacity
    key = "GPU" if quotas.unit == "gpus" else "CPU"
    return int(sum((n.get("Resources") or {}).get(key, 0) for n in nodes
                   if n.get("Alive") and node_site(n.get("Resources") or {}, n.get("Labels") or {}) != "cloud"))


class Admitter:
    """The actor's body; also usable in-process (tests drive `tick` with their own clock).

    Two paths, apart: decisions (`tick`, `submit`, `finished`) take `lock`; heartbeats (`status`)
    take no lock at all. They read `published`, the last saved queue (a dict replaced whole after
    each save), and write the time they were seen, so no heartbeat ever waits behind a decision or
    a slow save, and no lease runs out while the actor is busy."""

    def __init__(self, quotas_path: str, location: str, tick_s: float = TICK_S, lease_s: float = LEASE_S,
                 background: bool = True, head: str | None = None, relauncher: Relauncher | None = None,
                 pinner: Pinner | None = None, stopped: Callable[[str], bool] | None = None,
                 marker: Callable[[str, str], None] | None = None) -> None:
        """`head`: the Ray node id of the head it runs on (asked of Ray when None); `relauncher`
        submits a job's driver from its record (a lost head's jobs, admitted parked ones), `pinner`
        keeps a parked job's package, `stopped` says whether a stop took a parked job's next id and
        `marker` marks a dropped one's: the cluster's Jobs API when None."""
        self.quotas = load_quotas(quotas_path)
        self.location, self.lease_s = location, lease_s
        self.queue = load_or_set_aside(self.location)  # registrations and finishes may be ahead of the document...
        head = (current_head() if background else "") if head is None else head
        api: list[JobsApi] = []  # made on first use: most actors never need the Jobs API

        def jobs() -> JobsApi:
            api[:] = api or [cluster_jobs_api()]
            return api[0]
        make: Callable[[], Relauncher] = (lambda: relauncher) if relauncher else (lambda: jobs().relaunch)
        self.pins = Pins(pinner or (lambda submission, seconds: jobs().pin(submission, seconds)))
        self.relaunches = Relaunches(self.queue, head, make, time.time())
        self.parked, self.checked_at = ParkedStarts(make, (lambda: marker) if marker else (lambda: jobs().mark_dropped)), 0.0
        self.stopped = stopped or (lambda successor: jobs().stopped(successor))
        # This head is recorded once the lost head's drivers are relaunched (`_relaunch`): an actor
        # that died before then would otherwise come back, find its own head recorded, and relaunch
        # nothing. A queue with no head yet (a new cluster) takes this one now.
        self.head = head
        if not self.relaunches.pending:
            self.queue = replace(self.queue, head=head)
        self.saved: Queue | None = None  # ...decisions never are: they land here only once saved
        self.published: dict[str, dict[str, Any]] = {}
        self.seen: dict[str, float] = {}
        self.world: dict[str, int] = {}  # each job's size as its rank 0 last said (heartbeats)
        # Re-adoption: every job the document lists gets a whole lease to check in again; so does
        # every job after a tick that took long (the actor was busy, not the drivers silent).
        self.resumed_at = time.time()
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self._save(self.queue)
        now = time.time()
        # Cloud bursts: every job's need, the one request made for all of them, each team's use today.
        self.bursts: dict[str, BurstRequest] = {}
        self.plan, self.asked_at, self.accrued_at, self.use_saved_at = BurstPlan(), 0.0, now, now
        self.use_location = location.rsplit("/", 1)[0] + "/cloud-use.json"
        self.use = load_use(self.use_location, now)
        self.gauges = queue_gauges() if background else {}
        if background:
            threading.Thread(target=self._loop, args=(tick_s,), daemon=True, name="tidal-admission").start()

    # -- what drivers and workers call ---------------------------------------------------------

    def submit(self, registration: dict[str, Any]) -> dict[str, Any]:
        """Register a job (QUEUED), in memory: the next tick saves it (a registration never waits
        for a whole-document write). A job already known (its driver restarted) keeps its place and
        the new driver becomes its holder. The actor sets the submission time and the slots a
        worker takes itself. A job unknown here that says it runs (`running_workers`: its driver
        kept training while the queue was lost) is adopted RUNNING at that size."""
        try:
            reg = checked_registration(registration, self.quotas)
        except TidalError as e:
            return {"error": str(e)}
        with self.lock:
            known = self.queue.get(reg["job"])
            now = time.time()
            if known is None:
                entry = Entry(reg["job"], reg["name"], reg["team"], reg["priority"], reg["min_workers"],
                              reg["max_workers"], self._clock(now), slots_per_worker=reg["slots_per_worker"],
                              holder=reg["holder"], submission=reg["submission"])
                workers = min(reg["running_workers"], reg["max_workers"])
                if workers > 0:
                    entry = replace(entry, state="RUNNING", workers=workers, workers_now=workers, last_resize=now,
                                    reason="re-adopted: it was running when the queue was rebuilt")
                self.queue = submitted(self.queue, entry, adopted=workers > 0)
            elif known.holder != reg["holder"] or known.submission != (reg["submission"] or known.submission):
                # A new driver (a parked job's successor, a relaunch, one started by hand) holds the seat
                # and un-parks it; saved at once, so that a restarted actor does not forget whose it is.
                # The parked driver's own late call (same holder) changes nothing.
                self.queue = changed(self.queue, reg["job"], holder=reg["holder"],
                                     submission=reg["submission"] or known.submission,
                                     successor="" if known.holder != reg["holder"] else known.successor)
                self._save(self.queue)
            self.seen[reg["job"]] = now
        self.wake.set()  # the tick saves it with every other registration since the last (one write)
        return self.status(reg["job"])

    def status(self, job: str, world: int | None = None) -> dict[str, Any]:
        """The job's entry as last saved (a heartbeat too); `world`: the size its group runs at now
        (rank 0). No lock: a heartbeat never waits behind a decision or a save."""
        entry = self.published.get(job)
        if entry is None:
            pending = self.queue.get(job)
            if pending is None:
                return {}
            entry = {**_public(pending), "reason": "registered; waiting for the queue document to be saved"}
        self.seen[job] = time.time()
        if world is not None:
            self.world[job] = world
        return entry

    def finished(self, job: str, token: str = "") -> bool:
        """The job ended: its slots are given back. Only from its holder (the driver that
        registered it last): a stale or mistaken caller cannot end another job's seat."""
        with self.lock:
            entry = self.queue.get(job)
            if entry is None:
                return True
            if entry.holder != holder_digest(token):
                log.warning("refused `finished` for job %s from a caller that does not hold its seat", job)
                return False
            self.queue = finished(self.queue, job)
            self.seen.pop(job, None)
            self.world.pop(job, None)
            self._save(self.queue)
        self.wake.set()
        return True

    def park(self, job: str, token: str, successor: str) -> bool:
        """The job's driver leaves while its job waits (admission/parking.py): once admitted, the
        job starts as Ray job `successor`. True only once the queue document says so and the
        job's package is pinned; False (the driver keeps waiting) if either fails, if the caller
        does not hold the seat, or if the job was admitted meanwhile."""
        entry = self.queue.get(job)
        if entry is None or entry.holder != holder_digest(token) or not is_submission_id(successor):
            return False
        if entry.successor == successor and self.saved and self.saved.get(job) == entry:
            return True  # the driver asks again after its first call timed out, which had landed
        if entry.state == "RUNNING":
            return False
        try:
            pinned = self.pins.pin(entry)  # before the driver ends: its end frees the package
        except Exception as e:  # noqa: BLE001 - no pin, no parking: the driver keeps waiting
            log.warning("job %s cannot park: its package could not be pinned (%s: %s)", job, type(e).__name__, e)
            return False
        with self.lock:
            entry = self.queue.get(job)
            if entry is None or entry.holder != holder_digest(token) or entry.state == "RUNNING":
                return False
            parked = changed(self.queue, job, successor=successor)  # its holder stays, so a retry is known
            if not self._save(parked):
                return False
            self.queue, self.pins.at[job] = parked, pinned
            self.seen.pop(job, None)
        log.info("job %s parked: its driver ends, and it starts as Ray job %s once admitted", job, successor)
        return True

    def burst(self, job: str, team: str, bundles: int, bundle: dict[str, float]) -> dict[str, Any]:
        """A job's cloud need in worker-shaped bundles (0: withdrawn). The autoscaler gets every
        job's need summed, in one `request_resources` call: the call is global, so one job's
        request used to replace another's. Returns what the job got, or why it was refused."""
        with self.lock:
            self.bursts[job] = BurstRequest(job, team, bundles, bundle,
                                            self.quotas.slots_per_worker(bundle.get("CPU", 1.0), bundle.get("GPU", 0.0)))
            plan = self._request_cloud(time.time(), force=True)
        refused = next((r.reason for r in plan.refused if r.job == job), None)
        return {"granted": plan.granted.get(job, 0), "refused": refused, "requested": len(plan.bundles)}

    def entries(self) -> list[dict[str, Any]]:
        """Every job as last saved (what `tidal queue` shows)."""
        return list(self.published.values())

    def document(self) -> dict[str, Any]:
        """The queue document as last saved, with each job's size now: `tidal queue --address`."""
        saved = self.saved or Queue()
        return {**document(with_world(saved, dict(self.world))), "source": "actor"}

    def tick(self, now: float | None = None) -> None:
        """One decision, saved before anything acts on it: drivers and workers see it (through
        `published`) only once the document holds it; a failed save publishes nothing and the
        next tick decides and saves again."""
        started = time.monotonic()
        now = time.time() if now is None else now
        capacity = self._capacity()
        stopped = []  # parked jobs a stop took: out before the decision makes room for them
        if now - self.checked_at >= CHECK_S:
            self.checked_at, stopped = now, stopped_soon(self.queue, self.stopped)
        with self.lock:
            # A job a lost head took with it waits for its relaunch, not on its lease.
            # A parked job has no driver to check in: it waits for its start.
            gone = [e.job for e in self.queue.entries if now - max(self.seen.get(e.job, 0.0), self.resumed_at)
                    > self.lease_s and e.job not in self.relaunches.pending and not e.successor]
            queue = self.queue
            for job in gone + stopped:
                queue = finished(queue, job)
            decision = decide(capacity, running(queue), waiting(queue), self.quotas, now)
            after = with_world(apply(queue, decision, now), dict(self.world))
            if after != self.saved and self._save(after):
                for job in gone:
                    log.warning("job %s stopped checking in for %.0fs: its slots are given back", job, self.lease_s)
                    self.seen.pop(job, None)
                    self.world.pop(job, None)
                    self.bursts.pop(job, None)
                self.queue = after
            if self.bursts:
                self._accrue(now)
                self._request_cloud(now, force=bool(gone))
            self._export(now)
        self._relaunch(now)
        if time.monotonic() - started > self.lease_s / 4:
            self.resumed_at = time.time()  # busy, not silent drivers: every lease starts again

    # -- inside ---------------------------------------------------------------------------------

    def _relaunch(self, now: float) -> None:
        """Submit the drivers admission owes (outside the lock: Jobs API calls): those a lost head
        took with it, and those of parked jobs it has admitted (as saved); each gets a whole lease
        for its new driver to check in. A parked job's package is pinned again while it waits."""
        started = self.relaunches.run(self.queue, self.seen, now) if self.relaunches.pending else {}
        why = dict.fromkeys(started, "started again after the head restarted")
        parked, dropped = self.parked.run(self.saved or Queue(), now)
        why.update(dict.fromkeys(parked, "admitted"))
        self.pins.renew(self.queue, now)
        settled = not self.relaunches.pending and self.queue.head != self.head  # every owed driver relaunched
        if not (started or parked or dropped or settled):
            return
        with self.lock:
            if settled:
                self.queue = replace(self.queue, head=self.head)
            for job, submission in {**started, **parked}.items():
                self.seen[job] = now
                self.pins.at.pop(job, None)
                self.queue = changed(self.queue, job, submission=submission, successor="",
                                     reason=f"{why[job]}: its driver starts as Ray job {submission}")
            for job in dropped:
                self.queue = finished(self.queue, job)
            self._save(self.queue)

    def _clock(self, now: float) -> float:
        """A submission time of the actor's own, later than every other (so the order is the
        order of registration, whatever a caller's clock says)."""
        latest = max((e.submitted_at for e in self.queue.entries), default=0.0)
        return max(now, latest + 1e-6)

    def _save(self, queue: Queue) -> bool:
        try:
            save_queue(self.location, queue)
        except Exception as e:  # noqa: BLE001 - storage down: nothing is published, the next tick retries
            log.warning("the queue document %s could not be saved (%s: %s): no decision is acted on until it is; "
                        "retrying", self.location, type(e).__name__, e)
            return False
        self.saved = queue
        self.published = {e.job: _public(e) for e in queue.entries}  # shallow: an entry holds scalars only
        return True

    def _capacity(self) -> int:
        if self.quotas.capacity is not None:
            return self.quotas.capacity
        import ray

        return onprem_capacity(self.quotas, ray.nodes())

    def _export(self, now: float) -> None:
        """The queue's gauges per team (admission/gauges.py)."""
        if not self.gauges:
            return
        for team, values in team_values(self.quotas.teams, self.queue.entries, now).items():
            for name, value in values.items():
                self.gauges[name].set(value, tags={"team": team})

    def _request_cloud(self, now: float, force: bool) -> BurstPlan:
        """Sum every job's burst (most urgent first) within each team's cloud quota and budget, and
        send it when it changed; re-sent every REASSERT_S, since Ray Train's elastic coordinator
        also calls the global request_resources."""
        from ray.autoscaler.sdk import request_resources

        order = {e.job: (-self.quotas.rank(e.priority), e.submitted_at) for e in self.queue.entries}
        asks = sorted((r for r in self.bursts.values() if r.bundles > 0), key=lambda r: order.get(r.job, (0, 0.0)))
        plan = aggregate_bursts(asks, self.use["teams"], self.quotas)
        if force or plan.bundles != self.plan.bundles or (plan.bundles and now - self.asked_at >= REASSERT_S):
            request_resources(bundles=[dict(b) for b in plan.bundles],
                              bundle_label_selectors=[{SITE_LABEL: "cloud"} for _ in plan.bundles])
            self.asked_at = now
        self.bursts = {j: r for j, r in self.bursts.items() if r.bundles > 0}
        self.plan = plan
        return plan

    def _accrue(self, now: float) -> None:
        """Each team's cloud use today (admission/cloud.accrue), kept beside the queue document."""
        import ray

        hours, self.accrued_at = (now - self.accrued_at) / 3600, now
        self.use = accrue(self.use, self.plan, self.bursts, ray.nodes(), hours, now)
        if now - self.use_saved_at >= USE_SAVE_S:
            save_use(self.use_location, self.use)
            self.use_saved_at = now

    def _loop(self, tick_s: float) -> None:
        while True:
            self.wake.wait(tick_s)  # a registration or an end decides at once, else once a tick
            self.wake.clear()
            try:
                self.tick()
            except Exception as e:  # noqa: BLE001 - a storage hiccup must not end admission; the next tick retries
                log.warning("admission tick failed: %s: %s", type(e).__name__, e)


def _public(e: Entry) -> dict[str, Any]:
    out = row(e)
    out.pop("holder")
    return out


__all__ = ["Admitter", "onprem_capacity"]
