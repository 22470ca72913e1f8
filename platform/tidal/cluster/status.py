"""`tidal cluster status`: nodes by site with GPUs free/used, pending demand, and which jobs'
Ray Train workers run on which nodes. Needs a connected Ray (`ray.init(address=...)`)."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

from tidal.ray_private import autoscaler_report, available_resources_per_node
from tidal.sites import node_site

TRAIN_WORKER_CLASS = "RayTrainWorker"


@dataclass(frozen=True)
class NodeLine:
    node_id: str
    site: str
    ip: str
    gpus_total: float
    gpus_free: float
    cpus_total: float
    cpus_free: float


def cluster_status() -> str:
    """A few lines a person reads: sites, nodes, pending demand, training workers."""
    nodes = node_lines()
    workers = train_workers()
    lines = [*format_sites(nodes), *format_demand(autoscaler_status()), *format_workers(workers, nodes)]
    return "\n".join(lines)


def cluster_record() -> dict[str, Any]:
    """`tidal cluster status --output json`: what `cluster_status` prints, as data (see status_record)."""
    return status_record(node_lines(), autoscaler_status(), train_workers())


def status_record(nodes: list[NodeLine], autoscaler: dict[str, Any], workers: list[tuple[str, str]]) -> dict[str, Any]:
    """`nodes`: node_id, site, ip, gpus/cpus total and used; `autoscaler`: its pending launches and
    demand, or None without one; `workers`: Ray Train workers per (job_id, node_id), with the site."""
    sites = {n.node_id: n.site for n in nodes}
    per_node = Counter(workers)
    return {
        "nodes": [{"node_id": n.node_id, "site": n.site, "ip": n.ip, "gpus_total": n.gpus_total,
                   "gpus_used": n.gpus_total - n.gpus_free, "cpus_total": n.cpus_total,
                   "cpus_used": n.cpus_total - n.cpus_free} for n in sorted(nodes, key=lambda n: (n.site, n.node_id))],
        "autoscaler": demand_record(autoscaler),
        "workers": [{"job_id": job, "node_id": node, "site": sites.get(node, "unknown"), "workers": count}
                    for (job, node), count in sorted(per_node.items())],
    }


def demand_record(status: dict[str, Any]) -> dict[str, Any] | None:
    """The autoscaler report's pending launches and demand, as `format_demand` reads them."""
    if not status:
        return None
    report = status.get("autoscaler_report") or {}
    load = status.get("load_metrics_report") or {}
    record: dict[str, Any] = {
        "pending_launches": dict(report.get("pending_launches") or {}),
        "pending_nodes": [{"ip": ip, "node_type": kind, "state": state} for ip, kind, state in report.get("pending_nodes") or []],
    }
    for key in ("resource_demand", "pg_demand", "request_demand"):
        record[key] = [{"shape": _shape(shape), "count": count} for shape, count in load.get(key) or []]
    return record


def _shape(shape: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in sorted(shape.items()) if not k.startswith("node:")}


def node_lines() -> list[NodeLine]:
    import ray

    free = available_resources_per_node()
    out = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        total = n.get("Resources") or {}
        avail = free.get(n["NodeID"], {})
        out.append(NodeLine(n["NodeID"], node_site(total, n.get("Labels") or {}) or "unlabelled",
                            n.get("NodeManagerAddress", "?"), total.get("GPU", 0.0), avail.get("GPU", 0.0),
                            total.get("CPU", 0.0), avail.get("CPU", 0.0)))
    return out


def format_sites(nodes: list[NodeLine]) -> list[str]:
    by_site: dict[str, list[NodeLine]] = defaultdict(list)
    for n in nodes:
        by_site[n.site].append(n)
    lines = []
    for site in sorted(by_site):
        group = by_site[site]
        gpus = sum(n.gpus_total for n in group)
        used = gpus - sum(n.gpus_free for n in group)
        lines.append(f"site {site}: {len(group)} node(s), GPUs {used:g} used / {gpus:g}")
        for n in sorted(group, key=lambda n: n.node_id):
            lines.append(f"  {_short(n.node_id)}  {n.ip:<15}  GPU {n.gpus_total - n.gpus_free:g}/{n.gpus_total:g} used"
                         f"  CPU {n.cpus_total - n.cpus_free:g}/{n.cpus_total:g} used")
    return lines or ["no live nodes"]


def _short(node_id: str) -> str:
    # Both ends: real ids differ at the start, the fake provider's simulated ones at the end.
    return f"{node_id[:6]}..{node_id[-6:]}"


def autoscaler_status() -> dict[str, Any]:
    """The autoscaler's last report (what `ray status` prints from); {} without an autoscaler."""
    return autoscaler_report()


def format_demand(status: dict[str, Any]) -> list[str]:
    if not status:
        return ["autoscaler: none reporting (a fixed cluster, or not started with --autoscaling-config)"]
    report = status.get("autoscaler_report") or {}
    load = status.get("load_metrics_report") or {}
    lines = ["autoscaler:"]
    launches = report.get("pending_launches") or {}
    pending = [f"{count}x {kind}" for kind, count in launches.items()]
    pending += [f"{kind} ({state})" for _ip, kind, state in report.get("pending_nodes") or []]
    lines.append(f"  launching: {', '.join(pending) or 'nothing'}")
    for key, title in (("resource_demand", "waiting tasks/actors"), ("pg_demand", "waiting placement groups"),
                       ("request_demand", "requested (request_resources)")):
        demand = load.get(key) or []
        if demand:
            lines.append(f"  {title}: " + "; ".join(f"{count}x {_bundle(shape)}" for shape, count in demand))
    return lines


def _bundle(shape: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(shape.items()) if not k.startswith("node:")) + "}"


def train_workers() -> list[tuple[str, str]]:
    """(job id, node id) of every live Ray Train worker."""
    import ray
    from ray.util.state import list_actors

    # The connected cluster's own address: without one the state API looks for a cluster on this
    # machine and refuses when it finds several (a laptop running a local Ray beside a tunnel).
    address = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
    actors = list_actors(address=address, filters=[("class_name", "=", TRAIN_WORKER_CLASS), ("state", "=", "ALIVE")],
                         raise_on_missing_output=False)
    return [(a.job_id, a.node_id) for a in actors if a.node_id]


def train_workers_by_site() -> dict[str, int]:
    """Live Ray Train workers per site (what BurstWatcher prints while a job runs)."""
    sites = {n.node_id: n.site for n in node_lines()}
    return dict(Counter(sites.get(node, "unknown") for _job, node in train_workers()))


def format_workers(workers: list[tuple[str, str]], nodes: list[NodeLine]) -> list[str]:
    if not workers:
        return ["training workers: none running"]
    sites = {n.node_id: n.site for n in nodes}
    per_job: dict[str, Counter[str]] = defaultdict(Counter)
    for job, node in workers:
        per_job[job][f"{sites.get(node, 'unknown')}:{_short(node)}"] += 1
    lines = ["training workers (Ray job id: workers per site:node):"]
    for job, where in sorted(per_job.items()):
        lines.append(f"  job {job}: " + ", ".join(f"{n} on {place}" for place, n in sorted(where.items())))
    return lines


__all__ = ["cluster_record", "cluster_status", "demand_record", "format_demand", "format_sites", "format_workers",
           "status_record", "train_workers", "train_workers_by_site"]
