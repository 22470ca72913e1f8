"""The tracker: a thin shell that runs the ledger (tracking/ledger.py) in a Ray actor.

It lives on the driver's node (where a SQLite store lives) and polls the job's event log
every `poll_s`: new events are deduped, printed and sent to MLflow in batches. Nothing in
training calls it (rank 0 writes the event log itself), so it may die at any time: Ray
restarts it (`max_restarts=-1`), and the new one recovers from the log and the mark the last
one kept beside it. The driver calls `flush` and `close` at the end of the job; those calls
are retried by Ray across a restart (`max_task_retries=-1`), which is safe since both are
idempotent.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

from tidal.spec.job import JobSpec
from tidal.storage import RunDir
from tidal.tracking.buffer import MetricsBuffer
from tidal.tracking.console import Console
from tidal.tracking.ledger import Ledger
from tidal.tracking.mlflow import MlflowSink

log = logging.getLogger("tidal")


class Tracker:
    def __init__(self, spec: JobSpec, run_id: str | None, tags: dict[str, str] | None = None,
                 retry_s: float = 5.0, record: dict[str, Any] | None = None, system_metrics: bool = True,
                 poll_s: float = 0.5, background: bool = True) -> None:
        self.spec = spec
        run_dir = RunDir(spec.checkpoint.storage, spec.name)
        self.ledger = Ledger(MetricsBuffer(run_dir.fs, run_dir.path), run_dir, MlflowSink(spec, tags, record), run_id,
                             subscribers=[Console(spec.train.steps)],
                             retry_s=retry_s)
        self.monitor = self._start_system_metrics(run_id) if system_metrics else None
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, args=(poll_s,), daemon=True, name="tidal-tracker")
        if background:
            self.thread.start()

    def flush(self, force: bool = False) -> int:
        """Take in the event log and send what is pending; returns the points left unsent."""
        self.ledger.poll()
        return self.ledger.flush(force)

    def close(self) -> tuple[str | None, dict[str, float], int]:
        """(MLflow run id, last values seen, points still unsent) after one more try to send."""
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join()
        if self.monitor is not None:
            # MLflow publishes a sample only after a full interval; keep a short run's samples too.
            with contextlib.suppress(Exception):
                self.monitor.publish_metrics(self.monitor.aggregate_metrics())
            self.monitor.finish()
        left = self.flush(force=True)
        return self.ledger.run_id, dict(self.ledger.latest), left

    def _loop(self, poll_s: float) -> None:
        while not self.stopped.wait(poll_s):
            try:
                self.flush()
            except Exception as e:  # noqa: BLE001 - a storage hiccup must not end the tracker
                log.warning("[tidal] tracking: %s; retrying", e)

    def _start_system_metrics(self, run_id: str | None) -> Any:
        """MLflow's system metrics (CPU, memory, GPU, disk, network) of the driver's node."""
        if run_id is None:
            return None
        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            monitor = SystemMetricsMonitor(run_id, sampling_interval=10, resume_logging=True,
                                           node_id="driver", tracking_uri=self.spec.tracking.uri)
            monitor.start()
            return monitor
        except Exception as e:  # noqa: BLE001 - optional telemetry; say why it is missing
            log.warning("MLflow system metrics are off: %s", e)
            return None
