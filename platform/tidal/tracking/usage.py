"""What a run used: GPU-hours that follow its real shape, split by site, its cost, and how well it scaled.

All from the run's own metrics timeline in MLflow (rank 0 logs `world_size`, `workers_cloud`,
`cost_per_hour` and `uptime_s` at every log step, worker/telemetry.py): world size integrated
over time, not the final world size times the wall time, which is wrong for every elastic run.

Each logged point pays for the time since the previous one at its own world size (the workers
that trained those steps), but for no longer than its worker group has been up (`uptime_s`):
the time between a failed group and its replacement, and between two launches of the job, when
no worker ran, is not counted, while a group's start-up (engine build, checkpoint load) is.
A CPU job (gpus_per_worker 0) counts worker-hours.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from tidal.spec.job import JobSpec

TIMELINE_KEYS = ("world_size", "workers_cloud", "cost_per_hour", "uptime_s", "tokens_per_s_per_worker")


@dataclass(frozen=True)
class Point:
    """One logged step of the timeline."""

    t: float  # seconds since the epoch, when the point was logged
    world: float
    cloud: float = 0.0
    cost_per_hour: float | None = None
    uptime: float | None = None  # seconds the worker group that logged it had been up
    per_worker: float | None = None  # tokens/s per worker


def charged_seconds(points: list[Point]) -> list[float]:
    """Seconds each point (in time order) pays for: since the previous point, capped by its uptime."""
    out: list[float] = []
    prev: float | None = None
    for p in points:
        since = math.inf if prev is None else p.t - prev
        cap = math.inf if p.uptime is None else p.uptime
        out.append(0.0 if math.isinf(since) and math.isinf(cap) else max(0.0, min(since, cap)))
        prev = p.t
    return out


def usage(points: list[Point], devices_per_worker: int) -> dict[str, float]:
    """gpu_hours, gpu_hours_cloud and (when any node had a price) cost, from a run's timeline."""
    points = sorted(points, key=lambda p: p.t)
    secs = charged_seconds(points)
    per = max(devices_per_worker, 1)
    out = {"gpu_hours": sum(p.world * s for p, s in zip(points, secs, strict=True)) * per / 3600,
           "gpu_hours_cloud": sum(p.cloud * s for p, s in zip(points, secs, strict=True)) * per / 3600}
    if any(p.cost_per_hour is not None for p in points):
        out["cost"] = sum((p.cost_per_hour or 0.0) * s for p, s in zip(points, secs, strict=True)) / 3600
    return out


def scaling(points: list[Point], reference_per_worker: float | None = None) -> dict[str, float]:
    """Per-worker throughput at the last world size against the smallest world size the run had
    (1.0: perfect scaling), and against a reference run's, each from the median of its points."""
    by_world: dict[float, list[float]] = {}
    for p in points:
        if p.per_worker:
            by_world.setdefault(p.world, []).append(p.per_worker)
    if not by_world:
        return {}
    last = max(points, key=lambda p: p.t).world
    now = statistics.median(by_world.get(last) or by_world[max(by_world)])
    out = {"scaling_efficiency": now / statistics.median(by_world[min(by_world)]),
           "scaling_smallest_world_size": min(by_world)}
    if reference_per_worker:
        out["scaling_efficiency_vs_reference"] = now / reference_per_worker
    return out


def timeline(client: Any, run_id: str) -> list[Point]:
    """The run's points from MLflow, one per logged step."""
    rows: dict[int, dict[str, float]] = {}
    for key in TIMELINE_KEYS:
        for m in client.get_metric_history(run_id, key):
            row = rows.setdefault(m.step, {"t": m.timestamp / 1000})
            row[key] = m.value
    return [Point(r["t"], r["world_size"], r.get("workers_cloud", 0.0), r.get("cost_per_hour"), r.get("uptime_s"),
                  r.get("tokens_per_s_per_worker")) for r in rows.values() if "world_size" in r]


def run_usage(spec: JobSpec, client: Any, run_id: str) -> dict[str, float]:
    """Usage and scaling of `run_id`, from its timeline in MLflow (and the reference run's)."""
    points = timeline(client, run_id)
    ref = None
    if spec.scaling.reference_run:
        hist = [m.value for m in client.get_metric_history(spec.scaling.reference_run, "tokens_per_s_per_worker")]
        ref = statistics.median(hist) if hist else None
    return usage(points, spec.scaling.gpus_per_worker) | scaling(points, ref)


def describe(u: dict[str, float], gpus_per_worker: int) -> str:
    """The end summary's line."""
    unit = "GPU-hours" if gpus_per_worker else "worker-hours"
    line = f"used {u.get('gpu_hours', 0.0):.4g} {unit} ({u.get('gpu_hours_cloud', 0.0):.4g} on cloud nodes)"
    if "cost" in u:
        line += f", cost {u['cost']:.4g}"
    if "scaling_efficiency" in u:
        line += (f"; per-worker throughput {100 * u['scaling_efficiency']:.0f}% of its "
                 f"{u['scaling_smallest_world_size']:.0f}-worker rate")
    if "scaling_efficiency_vs_reference" in u:
        line += f", {100 * u['scaling_efficiency_vs_reference']:.0f}% of the reference run's"
    return line
