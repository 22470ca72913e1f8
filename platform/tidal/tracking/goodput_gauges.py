"""The goodput account as Prometheus gauges, by job and team, through Ray's metrics (exported as
ray_tidal_<name>): the Grafana dashboard's goodput panels. The tracker (a Ray actor on the
driver's node) sets them as it reads the job's event log, at most every EVERY_S, and at the end;
a submitted job's tracker then waits for one export of Ray's metrics (`settle`) before it is
ended, so that the final figures reach Prometheus."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from tidal.goodput.account import BUCKETS, State

log = logging.getLogger("tidal")
JOB_LABEL = "tidal_job"  # as worker/telemetry.py's gauges (a scraped `job` label would yield to Prometheus's)
GOODPUT_GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "goodput": ("productive share of the job's wall time so far (tidal/goodput)", (JOB_LABEL, "team")),
    "goodput_seconds": ("seconds of the job's wall time in each goodput bucket", (JOB_LABEL, "team", "bucket")),
    "goodput_worker_hours": ("worker-hours of the job in each goodput bucket", (JOB_LABEL, "team", "bucket")),
    "goodput_cost": ("cost of the job in each goodput bucket, where its nodes carry price labels",
                     (JOB_LABEL, "team", "bucket")),
}
EVERY_S = 5.0  # Prometheus scrapes every 10 s or so
# Ray's core workers push their metrics to the node's agent every `metrics_report_interval_ms`
# (10 s by default; RAY_metrics_report_interval_ms): a value set less than that before the
# process ends may never be exported.
REPORT_INTERVAL_ENV = "RAY_metrics_report_interval_ms"
# RAY_enable_metrics_collection=false (Ray reads "true" or "1" as on): Ray exports nothing, so a
# job's end waits for nothing.
COLLECTION_ENV = "RAY_enable_metrics_collection"
REPORT_INTERVAL_DEFAULT_S = 10.0
SETTLE_MAX_S = 15.0  # the most a job's end waits for it


def gauge_values(state: State, tags: dict[str, str]) -> list[tuple[str, dict[str, str], float]]:
    """(gauge, tags, value) for the account so far: the goodput, and per bucket its seconds,
    worker-hours and, where a price was known, cost."""
    if state.goodput is None:
        return []
    out = [("goodput", tags, state.goodput)]
    for b in BUCKETS:
        by = {**tags, "bucket": b}
        out += [("goodput_seconds", by, state.seconds[b]), ("goodput_worker_hours", by, state.worker_s[b] / 3600)]
        if state.priced:
            out.append(("goodput_cost", by, state.cost[b]))
    return out


def settle_s(since_set: float, interval_ms: str | None, collecting: str | None = None) -> float:
    """How long to wait, `since_set` seconds after the final values were set, for one export
    (none where Ray's metrics collection is off: `collecting`, the value of COLLECTION_ENV)."""
    if collecting is not None and collecting.strip().lower() not in ("true", "1"):
        return 0.0
    try:
        interval = float(interval_ms) / 1000 if interval_ms else REPORT_INTERVAL_DEFAULT_S
    except ValueError:
        interval = REPORT_INTERVAL_DEFAULT_S
    return min(SETTLE_MAX_S, max(0.0, interval - since_set))


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
            for name, tags, value in gauge_values(state, self.tags):
                self.gauges[name].set(value, tags=tags)
        except Exception as e:  # noqa: BLE001 - as above
            log.debug("goodput gauges not set: %s", e)

    def settle(self) -> None:
        """Wait until Ray has exported the values set last (its process is ended right after)."""
        if self.gauges is not None and self.last:
            time.sleep(settle_s(time.monotonic() - self.last, os.environ.get(REPORT_INTERVAL_ENV),
                                os.environ.get(COLLECTION_ENV)))
