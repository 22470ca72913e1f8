"""The team queue's Prometheus gauges, per team, through Ray's metrics (exported as
ray_tidal_<name>): the Grafana dashboard's queue panel. The admission actor sets them each tick."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tidal.admission.queue_doc import Entry

QUEUE_GAUGES = {
    "queue_length": "jobs waiting (QUEUED or SUSPENDED) under the cluster's admission",
    "queue_wait_seconds": "how long the team's longest-waiting job has waited",
    "queue_running_workers": "workers admission gives the team's running jobs",
}


def queue_gauges() -> dict[str, Any]:
    """Ray's gauges for QUEUE_GAUGES (made in a Ray process: the actor's)."""
    from ray.util.metrics import Gauge

    return {name: Gauge(f"tidal_{name}", text, tag_keys=("team",)) for name, text in QUEUE_GAUGES.items()}


def team_values(teams: Iterable[str], entries: Iterable[Entry], now: float) -> dict[str, dict[str, float]]:
    """team -> each gauge's value: every team in `teams` (those the quota file names) and any with jobs."""
    entries = list(entries)
    out = {}
    for team in {*teams, *(e.team for e in entries)}:
        mine = [e for e in entries if e.team == team]
        waits = [now - e.submitted_at for e in mine if e.state != "RUNNING"]
        out[team] = {"queue_length": len(waits), "queue_wait_seconds": max(waits, default=0.0),
                     "queue_running_workers": sum(e.workers for e in mine if e.state == "RUNNING")}
    return out


__all__ = ["QUEUE_GAUGES", "queue_gauges", "team_values"]
