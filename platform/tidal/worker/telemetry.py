"""Training metrics for cluster operators: Ray's Prometheus endpoint, stragglers, site and cost.

Ray runs a metrics agent on every node; a `ray.util.metrics` gauge set in any process there is
served on the node's metrics export port with a `ray_` prefix, next to Ray's own metrics, and a
cluster's Prometheus scrapes it through Ray's service discovery file (docs/cluster.md). So each
worker sets its own gauges, tagged job, rank, node and site: nothing is sent anywhere by hand.

At every log step each rank calls `Telemetry.at_log_step(metrics, busy_s)` (a collective: every
rank calls it at the same steps; it gathers the ranks' placements once per group). `busy_s` is
every rank's busy time (its step time outside collectives, from the sampled step of
worker/metrics.py), gathered with the loss in the log step's one all-gather (worker/logsync.py).
It works out the straggler spread (worker/health/stragglers.py), sets the gauges (at most once a
second), and returns keys that rank 0's metrics then carry to MLflow: the straggler ratio and
rank, the workers on cloud nodes and the group's cost per hour and its uptime (which
tracking/usage.py integrates over time).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import ray
import ray.train
import torch
import torch.distributed as dist

from tidal.prices import worker_price
from tidal.sites import node_site
from tidal.spec.job import JobSpec
from tidal.storage import Found
from tidal.tracking.findings import input_bound_advice, input_bound_line
from tidal.worker.health.nodes import NodeAsks
from tidal.worker.health.stragglers import PersistentWait, spread
from tidal.worker.input_bound import InputWatch, Interval, PhaseTotals
from tidal.worker.metrics import Every, gpu_stats

# Not `job`: a Prometheus scrape config's job name is a target label of every series it scrapes
# (Ray's generated prometheus.yml says job "ray"), and a scraped `job` label yields to it (renamed
# exported_job), so every Tidal job would read as "ray", merged in the dashboard.
JOB_LABEL = "tidal_job"
TAGS = (JOB_LABEL, "rank", "node", "site")
EXTRA_TAGS = {"straggler_excluded_node": ("excluded_node",)}  # set where they are known, not by _export


def tag_keys(name: str) -> tuple[str, ...]:
    """The labels gauge `name` carries."""
    return TAGS + EXTRA_TAGS.get(name, ())
# Exported as ray_tidal_<key> (Ray adds the prefix). Keys of the loop's metrics dict, plus
# what this module adds; cluster_configs/grafana/tidal-dashboard.json is built on these names.
GAUGES: dict[str, str] = {
    "step": "last optimizer step done",
    "loss": "training loss (mean over ranks, since the last log step)",
    "lr": "learning rate",
    "tokens_per_s": "tokens per second, whole job",
    "tokens_per_s_per_worker": "tokens per second per worker",
    "samples_per_s": "sequences per second, whole job",
    "mfu": "model FLOPs utilization",
    "world_size": "workers in the group",
    "step_time_s": "seconds per optimizer step on this rank",
    "data_wait_s": "seconds per step waiting for data",
    "data_wait_frac": "share of the step waiting for data in the last log interval",
    "input_bound": "1 once the job was found input-bound (data.input_bound_share), else 0",
    "forward_backward_s": "seconds per step in forward and backward",
    "optimizer_s": "seconds per step in the optimizer step",
    "comm_s": "seconds inside collectives in the last sampled step",
    "comm_frac": "share of the last sampled step spent inside collectives",
    "busy_s": "seconds of the last sampled step outside collectives (what a straggler has most of)",
    "rank_slowness": "this rank's busy time over the median rank's",
    "straggler_ratio": "slowest rank's busy time over the median rank's (rank 0 reports it)",
    "straggler_rank": "rank with the most busy time (rank 0 reports it)",
    "straggler_excluded": "1 at the log step that took a straggler's node out of the job (rank 0; a Grafana annotation)",
    "straggler_excluded_node": "1 at the log step that took a straggler's node out, labelled with that node's "
                               "address (excluded_node; rank 0): the Grafana annotation names the node",
    "stall_s": "seconds outside training steps since the last log step (checkpoint saves mostly)",
    "workers_cloud": "workers on cloud nodes (rank 0 reports it)",
    "cost_per_hour": "what the group's workers cost per hour, from the nodes' price labels (rank 0)",
    "gpu_util_frac": "GPU utilization (NVML)",
    "gpu_memory_used_gb": "GPU memory in use on the device (NVML)",
    "gpu_memory_used_frac": "share of the GPU's memory in use",
    "gpu_power_w": "GPU power draw in watts (NVML)",
}
COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "group_starts": ("worker-group starts by reason: start, restart (same size) or resize", (JOB_LABEL, "reason")),
}
_metrics: dict[str, Any] = {}  # one Ray metric object per name and process
# Gauges are set at most once a second (and at the last step). Ray's metrics agent reports them
# every few seconds and Prometheus scrapes every 10 s or so, so setting them at every step of a
# job logging every 50 ms step only cost time: 25 gauge sets, 0.5% of each rank's time (py-spy).
EXPORT_EVERY_S = 1.0
# "0" turns the Prometheus gauges off (benchmarks/telemetry_overhead.py measures them). Not the straggler
# handling: that is failure handling (failure.straggler_*), which once went off with the gauges.
OFF_VAR = "TIDAL_TELEMETRY"


def enabled() -> bool:
    return os.environ.get(OFF_VAR, "1") != "0"


def exported_names() -> set[str]:
    """Every name a Prometheus scrape shows for Tidal (Ray's prefix, and `_total` on counters)."""
    # The cluster's admission exports the queue's; the job's tracker its goodput.
    from tidal.admission.gauges import QUEUE_GAUGES
    from tidal.tracking.goodput_gauges import GOODPUT_GAUGES

    return ({f"ray_tidal_{k}" for k in (*GAUGES, *QUEUE_GAUGES, *GOODPUT_GAUGES)}
            | {f"ray_tidal_{k}_total" for k in COUNTERS})


def _metric(name: str) -> Any:
    from ray.util.metrics import Counter, Gauge

    if name not in _metrics:
        if name in COUNTERS:
            description, tags = COUNTERS[name]
            _metrics[name] = Counter(f"tidal_{name}", description, tag_keys=tags)
        else:
            _metrics[name] = Gauge(f"tidal_{name}", GAUGES[name], tag_keys=tag_keys(name))
    return _metrics[name]


@dataclass(frozen=True)
class Place:
    """Where one rank runs, and what it costs there."""

    node: str  # the node's IP, as operators know it (Ray's own NodeAddress tag)
    node_id: str
    site: str  # onprem | cloud | unlabelled
    price_per_hour: float | None

    @classmethod
    def here(cls, spec: JobSpec) -> Place:
        ctx = ray.get_runtime_context()
        node_id = ctx.get_node_id()
        labels = ctx.get_node_labels() or {}
        resources = next((n.get("Resources") or {} for n in ray.nodes() if n["NodeID"] == node_id), {})
        s = spec.scaling
        return cls(ray.util.get_node_ip_address(), node_id, node_site(resources, labels) or "unlabelled",
                   worker_price(labels, resources, s.cpus_per_worker, s.gpus_per_worker))


class Telemetry:
    """One per worker; `at_log_step` is its only call from the training loop."""

    def __init__(self, spec: JobSpec, events: Any, device: torch.device, found: Found | None) -> None:
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.spec, self.events, self.device = spec, events, device
        d = spec.data
        # Rank 0's own: where its time goes does not need Prometheus, so it runs with telemetry off too.
        self.inputs = InputWatch(d.input_bound_share, d.input_bound_intervals)
        self.totals = PhaseTotals()
        self.input_last: tuple[int, float] | None = None  # (step, time) at the previous log step
        self.first_step = (found.step if found else 0) + 1  # this group's first step
        self.input_bound = 0.0
        self.enabled = enabled()
        self.place = Place.here(spec)
        self.tags = {JOB_LABEL: spec.name, "rank": str(self.rank), "node": self.place.node, "site": self.place.site}
        self.waits = PersistentWait()
        # Rank 0's asks for the group's size: a straggler's node out, a hung one, a node back (worker/health).
        self.nodes = NodeAsks(spec, events, self.world, self.rank == 0)
        self.places: list[Place] | None = None
        self.last: tuple[int, float] | None = None  # (step, time) at the previous log step
        self.gauges_due = Every(EXPORT_EVERY_S)
        self.started = time.time()  # before the engine build: start-up holds the devices too
        if self.rank == 0 and self.enabled:
            reason = "start" if not found else "restart" if int(found.state["world_size"]) == self.world else "resize"
            _metric("group_starts").inc(1.0, tags={JOB_LABEL: spec.name, "reason": reason})

    @property
    def target(self) -> float:
        """The group size rank 0 asks for at the next log step's collective (worker/health/nodes.py)."""
        return self.nodes.target

    def at_log_step(self, metrics: dict[str, Any], busy_s: list[float] | None, final: bool = False) -> dict[str, float]:
        """Gauges for this rank; for rank 0's metrics, the straggler and placement keys.
        `busy_s`: every rank's busy time on the interval's sampled step (worker/logsync.py).
        `final`: the group's last step, whose values the gauges keep."""
        inputs = self._inputs(metrics) if self.rank == 0 else {}
        if self.places is None:  # once per group: where every rank runs (a collective)
            self.places = [self.place] * self.world
            dist.all_gather_object(self.places, self.place)
        extra = self._placement() | {"uptime_s": time.time() - self.started} if self.rank == 0 else {}
        local: dict[str, float] = {}
        s, median = None, 0.0
        if busy_s is not None:  # a sampled step in this interval (the same on every rank)
            s, median = spread(busy_s), statistics.median_low(busy_s)
            # How long a step waits for a persistently slow rank: the goodput account's
            # straggler wait per step (tidal/goodput); jitter stays in the step time.
            extra |= {"straggler_ratio": s.ratio, "straggler_rank": float(s.slowest_rank),
                      "straggler_wait_s": self.waits.update(busy_s)}
            local["rank_slowness"] = busy_s[self.rank] / median if median > 0 else 1.0
        if self.rank == 0:
            extra |= self.nodes.at_log_step(s, busy_s, median, int(metrics["step"]), self.places or [self.place])
            if self.enabled and "straggler_excluded" in extra:
                _metric("straggler_excluded_node").set(1.0, tags={**self.tags, "excluded_node": self.nodes.excluded_node})
        now, step = time.time(), int(metrics["step"])
        if self.last is not None:
            trained = (step - self.last[0]) * float(metrics.get("step_time_s", 0.0))
            local["stall_s"] = max(0.0, now - self.last[1] - trained)
        self.last = (step, now)
        extra |= inputs
        if self.enabled and self.gauges_due.due(force=final or "straggler_excluded" in extra):
            self._export({**metrics, **local, **gpu_stats(self.device), **(extra if self.rank == 0 else {})})
        return extra if self.rank == 0 else {}

    def _inputs(self, metrics: dict[str, Any]) -> dict[str, float]:
        """Rank 0: the data-wait share, whether the job is input-bound (said once), each phase's share."""
        now, step = time.time(), int(metrics["step"])
        prev_step, prev_t = self.input_last or (self.first_step - 1, None)
        self.input_last = (step, now)
        interval = Interval(float(metrics.get("data_wait_s", 0.0)), float(metrics.get("step_time_s", 0.0)),
                            step - prev_step)
        self.totals.add(interval, float(metrics.get("forward_backward_s", 0.0)), float(metrics.get("optimizer_s", 0.0)),
                        None if prev_t is None else now - prev_t)
        out = self.totals.shares()
        if interval.step_time_s > 0:
            out["data_wait_frac"] = interval.data_wait_s / interval.step_time_s
        verdict = self.inputs.update(step, interval)
        if verdict is not None:
            d = self.spec.data
            self.events.say(input_bound_line(verdict.share, verdict.first_step, verdict.last_step,
                                             input_bound_advice(bool(d.dataset), d.streaming), d.input_bound_share),
                            step)
            self.input_bound = 1.0
            out["input_bound_share"] = verdict.share
        return out | {"input_bound": self.input_bound}

    def _placement(self) -> dict[str, float]:
        places = self.places or []
        out = {"workers_cloud": float(sum(p.site == "cloud" for p in places))}
        prices = [p.price_per_hour for p in places]
        if any(p is not None for p in prices):
            out["cost_per_hour"] = float(sum(p or 0.0 for p in prices))
        return out

    def _export(self, values: dict[str, Any]) -> None:
        for key in GAUGES.keys() - EXTRA_TAGS.keys():
            v = values.get(key)
            if isinstance(v, (int, float)) and v == v:  # NaN (e.g. MFU of an unknown GPU) is left out
                _metric(key).set(float(v), tags=self.tags)
