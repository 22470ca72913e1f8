"""The goodput account as Prometheus gauges, by job and team, through Ray's metrics (exported as
ray_tidal_<name>): the Grafana dashboard's goodput panels. The tracker (a Ray actor on the
driver's node) sets them as it reads the job's event log, at most every EVERY_S, and at the end."""

from __future__ import annotations

import logging
import time
from typing import Any

from tidal.goodput.account import BUCKETS, State

log = logging.getLogger("tidal")
JOB_LABEL = "tidal_job"  # as worker/telemetry.py's gauges (a scraped `job` label would yield to Prometheus's)
GOODPUT_GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "goodput": ("productive share of the job's wall time so far (tidal/goodput)", (JOB_LABEL, "team")),
    "goodput_seconds": ("seconds of the job's wall time in each goodput bucket", (JOB_LABEL, "team", "bucket")),
    "goodput_worker_hours": ("worker-hours of the job in each goodput bucket", (JOB_LABEL, "team", "bucket")),
}
EVERY_S = 5.0  # Prometheus scrapes every 10 s or so


class GoodputGauges:
    """Ray gauges for one job; does nothing outside a Ray process (a tracker in a test, say)."""

    def __init__(self, job: str, team: str) -> None:
        self.tags = {JOB_LABEL: job, "team": team or "none"}
        self.gauges: dict[str, Any] | None = None
        self.last = 0.0
        try:
            import ray

            if ray.is_initialized():
                from ray.util.metrics import Gauge

                self.gauges = {name: Gauge(f"tidal_{name}", text, tag_keys=tags)
                               for name, (text, tags) in GOODPUT_GAUGES.items()}
        except Exception as e:  # noqa: BLE001 - gauges are for operators; the job goes on without them
            log.debug("goodput gauges off: %s", e)

    def update(self, state: State, force: bool = False) -> None:
        now = time.monotonic()
        if self.gauges is None or state.goodput is None or (not force and now - self.last < EVERY_S):
            return
        self.last = now
        try:
            self.gauges["goodput"].set(state.goodput, tags=self.tags)
            for b in BUCKETS:
                tags = {**self.tags, "bucket": b}
                self.gauges["goodput_seconds"].set(state.seconds[b], tags=tags)
                self.gauges["goodput_worker_hours"].set(state.worker_s[b] / 3600, tags=tags)
        except Exception as e:  # noqa: BLE001 - as above
            log.debug("goodput gauges not set: %s", e)
