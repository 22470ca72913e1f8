"""The cluster's admission, live: one detached Ray actor on the head carries out `admission.decide`.

Why by hand: open-source Ray has no job queue (ray#32116, #41241), and Kueue, which does this on
Kubernetes, needs Kubernetes. The actor is the one owner of the cluster's capacity decisions:
- every job's driver (`tidal run` under any face: the CLI, the SDK, `ray job submit -- tidal run`)
  registers it and waits while it is QUEUED (admission/seat.py);
- once a second it decides (admission.decide) and saves the queue (queue_state) before anyone
  acts on the decision, so a restarted actor finds what the last one promised;
- each job's rank 0 polls its target (admission/directive.py); a job told to shrink, grow or
  suspend checkpoints at its next log step and its driver restarts it at the new size.

No new single point of failure: the state lives in the queue document (TIDAL_STORAGE or the
head's disk), the actor restarts by itself (max_restarts=-1) and reloads it, and while it is
down running jobs train on at their size (their polls fail, their directive stays). A job whose
driver stops checking in for `LEASE_S` (its driver died) gives its slots back.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, replace
from typing import Any

from tidal import fs
from tidal.admission.cloud import BurstPlan, BurstRequest, CloudUse, aggregate_bursts
from tidal.admission.policy import decide
from tidal.admission.queue_doc import (
    Entry,
    Queue,
    apply,
    finished,
    load_queue,
    queue_location,
    running,
    save_queue,
    submitted,
    waiting,
)
from tidal.admission.quotas import QUOTAS_VAR, Quotas, load_quotas
from tidal.cluster import SITE_LABEL, node_site
from tidal.cluster.prices import PRICE_LABEL, worker_price

log = logging.getLogger("tidal")
ACTOR = "tidal-admission"
NAMESPACE = "tidal"
TICK_S = 1.0
LEASE_S = float(os.environ.get("TIDAL_ADMISSION_LEASE_S", "60"))  # a driver silent this long is gone
QUEUE_VAR = "TIDAL_QUEUE"  # where the queue document lives, if not under TIDAL_STORAGE
RAY_JOB_CONFIG = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray's job supervisor for a submitted job's driver
REASSERT_S = 10.0  # Ray Train's autoscaling coordinator also calls request_resources (every 20 s)
USE_SAVE_S = 30.0  # how often each team's cloud use today is written down while bursts run
# Prometheus, per team, through Ray's metrics (exported as ray_tidal_<name>): the Grafana dashboard's queue panel.
QUEUE_GAUGES = {
    "queue_length": "jobs waiting (QUEUED or SUSPENDED) under the cluster's admission",
    "queue_wait_seconds": "how long the team's longest-waiting job has waited",
    "queue_running_workers": "workers admission gives the team's running jobs",
}


def job_key(name: str, environ: Mapping[str, str] | None = None) -> str:
    """A job's id in the queue: its Ray Jobs submission id when submitted (Ray's job supervisor
    passes it to the driver in the job config's metadata), else its name."""
    env = os.environ if environ is None else environ
    try:
        meta = json.loads(env.get(RAY_JOB_CONFIG, "") or "{}").get("metadata") or {}
    except ValueError:
        meta = {}
    return str(meta.get("job_submission_id") or name)


def admission_enabled(environ: Mapping[str, str]) -> bool:
    """Admission runs where the cluster names a quota file (the cluster's environment contract)."""
    return bool(environ.get(QUOTAS_VAR))


def queue_named(environ: Mapping[str, str]) -> bool:
    """Whether `environ` names the cluster's queue document (a machine off the head reads it only then)."""
    return bool(environ.get(QUEUE_VAR) or environ.get("TIDAL_STORAGE"))


def queue_document(environ: Mapping[str, str]) -> str:
    """TIDAL_QUEUE, else under the cluster's storage root, else on the head's disk."""
    if environ.get(QUEUE_VAR):
        return environ[QUEUE_VAR]
    if environ.get("TIDAL_STORAGE"):
        return queue_location(environ["TIDAL_STORAGE"])
    return os.path.expanduser("~/.tidal/queue.json")


def onprem_capacity(quotas: Quotas, nodes: list[dict[str, Any]]) -> int:
    """On-prem slots in the quota file's unit: its `capacity`, else the live non-cloud nodes' GPUs
    (unit gpus) or CPUs (unit workers: one worker a CPU). Cloud capacity comes through bursts."""
    if quotas.capacity is not None:
        return quotas.capacity
    key = "GPU" if quotas.unit == "gpus" else "CPU"
    return int(sum((n.get("Resources") or {}).get(key, 0) for n in nodes
                   if n.get("Alive") and node_site(n.get("Resources") or {}, n.get("Labels") or {}) != "cloud"))


class Admitter:
    """The actor's body; also usable in-process (tests drive `tick` with their own clock)."""

    def __init__(self, quotas_path: str, location: str, tick_s: float = TICK_S, lease_s: float = LEASE_S,
                 background: bool = True) -> None:
        self.quotas = load_quotas(quotas_path)
        self.location, self.lease_s = location, lease_s
        self.queue = load_queue(location)  # a damaged document raises: never an empty queue
        now = time.time()
        # Re-adoption: every job the document lists gets a whole lease to check in again.
        self.seen = {e.job: now for e in self.queue.entries}
        self.lock = threading.Lock()
        # Cloud bursts: every job's need, the one request made for all of them, each team's use today.
        self.bursts: dict[str, BurstRequest] = {}
        self.plan, self.asked_at, self.accrued_at, self.use_saved_at = BurstPlan(), 0.0, now, now
        self.use_location = location.rsplit("/", 1)[0] + "/cloud-use.json"
        self.use = _load_use(self.use_location, now)
        self.gauges = _gauges() if background else {}
        if background:
            threading.Thread(target=self._loop, args=(tick_s,), daemon=True, name="tidal-admission").start()

    # -- what drivers and workers call ---------------------------------------------------------

    def submit(self, entry: dict[str, Any]) -> dict[str, Any]:
        """Register a job (QUEUED); a job already known (its driver restarted) keeps its place."""
        with self.lock:
            known = self.queue.get(entry["job"])
            if known is None:
                self.queue = submitted(self.queue, Entry(**entry))
                self._save()
            self.seen[entry["job"]] = time.time()
        self.tick()
        return self.status(entry["job"])

    def status(self, job: str, world: int | None = None) -> dict[str, Any]:
        """The job's entry (a heartbeat too); `world`: the size its group runs at now (rank 0)."""
        with self.lock:
            entry = self.queue.get(job)
            if entry is None:
                return {}
            self.seen[job] = time.time()
            if world is not None and world != entry.workers_now:  # saved: `tidal queue` reads the document
                self.queue = Queue(tuple(replace(e, workers_now=world) if e.job == job else e
                                         for e in self.queue.entries))
                self._save()
            return asdict(self.queue.get(job) or entry)

    def finished(self, job: str) -> None:
        with self.lock:
            if self.queue.get(job) is not None:
                self.queue = finished(self.queue, job)
                self.seen.pop(job, None)
                self._save()
        self.tick()

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
        with self.lock:
            return [asdict(e) for e in self.queue.entries]

    def tick(self, now: float | None = None) -> None:
        """One decision, saved before anything acts on it."""
        now = time.time() if now is None else now
        capacity = self._capacity()
        with self.lock:
            gone = [e.job for e in self.queue.entries if now - self.seen.get(e.job, now) > self.lease_s]
            for job in gone:
                log.warning("job %s stopped checking in for %.0fs: its slots are given back", job, self.lease_s)
                self.queue = finished(self.queue, job)
                self.seen.pop(job, None)
            decision = decide(capacity, running(self.queue), waiting(self.queue), self.quotas, now)
            after = apply(self.queue, decision, now)
            if after != self.queue or gone:
                self.queue = after
                self._save()
            for job in gone:
                self.bursts.pop(job, None)
            if self.bursts:
                self._accrue(now)
                self._request_cloud(now, force=bool(gone))
            self._export(now)

    # -- inside ---------------------------------------------------------------------------------

    def _capacity(self) -> int:
        if self.quotas.capacity is not None:
            return self.quotas.capacity
        import ray

        return onprem_capacity(self.quotas, ray.nodes())

    def _save(self) -> None:
        save_queue(self.location, self.queue)

    def _export(self, now: float) -> None:
        """The queue's gauges per team (every team the quota file names, and any with jobs)."""
        if not self.gauges:
            return
        teams = {*self.quotas.teams, *(e.team for e in self.queue.entries)}
        for team in teams:
            mine = [e for e in self.queue.entries if e.team == team]
            waits = [now - e.submitted_at for e in mine if e.state != "RUNNING"]
            values = {"queue_length": len(waits), "queue_wait_seconds": max(waits, default=0.0),
                      "queue_running_workers": sum(e.workers for e in mine if e.state == "RUNNING")}
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
        """Each team's cloud use today, from the bundles granted to its jobs since the last tick
        (GPU-hours, and cost at the cloud nodes' price labels); kept beside the queue document."""
        import ray

        hours, self.accrued_at = (now - self.accrued_at) / 3600, now
        if _day(now) != self.use["day"]:
            self.use = {"day": _day(now), "teams": {}}
        cloud = [n for n in ray.nodes() if n.get("Alive") and PRICE_LABEL in (n.get("Labels") or {})
                 and node_site(n.get("Resources") or {}, n.get("Labels") or {}) == "cloud"]
        for job, n in self.plan.granted.items():
            r = self.bursts.get(job)
            if r is None:
                continue
            gpus, cpus = r.bundle.get("GPU", 0.0), r.bundle.get("CPU", 0.0)
            price = worker_price(cloud[0]["Labels"], cloud[0]["Resources"], cpus, gpus) if cloud else None
            used = self.use["teams"].get(r.team, CloudUse())
            self.use["teams"][r.team] = used.plus(hours, n * gpus, None if price is None else n * price)
        if now - self.use_saved_at >= USE_SAVE_S:
            _save_use(self.use_location, self.use)
            self.use_saved_at = now

    def _loop(self, tick_s: float) -> None:
        while True:
            time.sleep(tick_s)
            try:
                self.tick()
            except Exception as e:  # noqa: BLE001 - a storage hiccup must not end admission; the next tick retries
                log.warning("admission tick failed: %s: %s", type(e).__name__, e)


def _gauges() -> dict[str, Any]:
    from ray.util.metrics import Gauge

    return {name: Gauge(f"tidal_{name}", text, tag_keys=("team",)) for name, text in QUEUE_GAUGES.items()}


def _day(now: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(now))


def _load_use(location: str, now: float) -> dict[str, Any]:
    """Today's cloud use per team (a new day starts empty); the budget outlives a restart."""
    filesystem, path = fs.resolve(location)
    data = fs.read_json(filesystem, path) if fs.exists(filesystem, path) else None
    if not isinstance(data, dict) or data.get("day") != _day(now):
        return {"day": _day(now), "teams": {}}
    return {"day": data["day"], "teams": {t: CloudUse(**u) for t, u in data.get("teams", {}).items()}}


def _save_use(location: str, use: dict[str, Any]) -> None:
    filesystem, path = fs.resolve(location)
    fs.write_json(filesystem, path, {"day": use["day"], "teams": {t: asdict(u) for t, u in use["teams"].items()}})


def admitter(create: bool = False, environ: Mapping[str, str] | None = None) -> Any:
    """The cluster's admission actor (started on the head if `create` and none runs); None when
    it cannot be reached (admission down: running jobs carry on)."""
    import ray

    env = os.environ if environ is None else environ
    try:
        return ray.get_actor(ACTOR, namespace=NAMESPACE)
    except ValueError:
        if not create:
            return None
    actor = ray.remote(Admitter).options(
        name=ACTOR, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0,
        max_restarts=-1, max_task_retries=-1, max_concurrency=8,
        scheduling_strategy=_on_head(),
        runtime_env={"env_vars": {k: env[k] for k in (QUOTAS_VAR, QUEUE_VAR, "TIDAL_STORAGE",
                                                      "AWS_ENDPOINT_URL") if env.get(k)}},
    )
    return actor.remote(env[QUOTAS_VAR], queue_document(env))


def _on_head() -> Any:
    """The head node, softly: the queue belongs with the cluster's one lasting node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    head = next((n["NodeID"] for n in ray.nodes() if n.get("Alive") and "node:__internal_head__" in
                 (n.get("Resources") or {})), None)
    return NodeAffinitySchedulingStrategy(head, soft=True) if head else "DEFAULT"


__all__ = ["ACTOR", "NAMESPACE", "QUEUE_GAUGES", "Admitter", "admission_enabled", "admitter", "onprem_capacity",
           "queue_document", "queue_named"]
