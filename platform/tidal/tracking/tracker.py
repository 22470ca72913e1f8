"""The tracker: owns the job's MLflow run for its whole life and runs the ledger
(tracking/ledger.py) that fills it, in a Ray actor on the driver's node.

It opens (or reopens) the run when it starts, polls the job's event log every `poll_s` (new
events are deduped, printed and sent to MLflow in batches) and, at `close`, ends the run with its
usage, artifacts and status (tracking/writer.py). Nothing in training calls it (rank 0 writes the
event log itself), so it may die at any time: Ray restarts it (`max_restarts=-1`) with the same
arguments, and the new one reopens the run the job file names and recovers from the log and the
mark the last one kept beside it. The driver calls `flush` and `close` at the end of the job;
those calls are retried by Ray across a restart (`max_task_retries=-1`), which is safe since both
are idempotent. If the actor cannot be reached at all, the driver builds a Tracker in its own
process (`background=False`) and closes it: the same code finishes the run.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from tidal.goodput.report import final_metrics, line, rows
from tidal.lease import LeaseCheck
from tidal.redact import redact_text, redact_uri
from tidal.spec.job import JobSpec
from tidal.storage import JOB_FILE, RunDir
from tidal.tracking.artifacts import HangStacks
from tidal.tracking.buffer import MetricsBuffer
from tidal.tracking.console import Console
from tidal.tracking.goodput_gauges import GoodputGauges
from tidal.tracking.ledger import Ledger
from tidal.tracking.quiet import quiet_libraries
from tidal.tracking.writer import RunWriter

log = logging.getLogger("tidal")


class Tracker:
    def __init__(self, spec: JobSpec, tags: dict[str, str] | None = None, retry_s: float = 5.0,
                 record: dict[str, Any] | None = None, system_metrics: bool = True,
                 poll_s: float = 0.5, background: bool = True, lease: dict[str, Any] | None = None) -> None:
        quiet_libraries()  # this may be its own process (a Ray actor)
        self.spec = spec
        # Two trackers of one job would send one event log into one run twice: the one whose
        # driver lost the job's lease to a newer start stops sending (tidal/lease.py).
        self.fence = LeaseCheck.from_config(spec.checkpoint.storage, spec.name, lease)
        run_dir = RunDir(spec.checkpoint.storage, spec.name)
        self.writer = RunWriter(spec, tags, record)
        run_id = self._start((run_dir.read_json(JOB_FILE) or {}).get("mlflow_run_id"))
        stacks = HangStacks(run_dir, self.writer, lambda: self.ledger.run_id)  # a hang's stacks, as it is found
        self.ledger = Ledger(MetricsBuffer(run_dir.fs, run_dir.path), run_dir, self.writer, run_id,
                             subscribers=[Console(spec.train.steps, max_restarts=spec.failure.max_restarts), stacks], retry_s=retry_s)
        # the team admission seated the job under, else the job's own (its spec's scheduling.team)
        self.gauges = GoodputGauges(spec.name, (tags or {}).get("tidal.team") or spec.scheduling.team or "")
        self.submitted = record is not None  # a Ray Job on a cluster, whose Prometheus reads the final gauges
        if system_metrics:
            self.writer.start_system_metrics(run_id)
        self.stopped = threading.Event()
        self.stopped_writing = False
        self.thread = threading.Thread(target=self._loop, args=(poll_s,), daemon=True, name="tidal-tracker")
        if background:
            self.thread.start()

    def _start(self, run_id: str | None) -> str | None:
        """The job's run, reopened or created; None while MLflow cannot be reached (the ledger
        creates it on first contact, and training does not wait)."""
        try:
            return self.writer.start(run_id)
        except Exception as e:  # noqa: BLE001 - an unreachable tracking server must not stop training
            print(f"[tidal] WARNING: MLflow at {redact_uri(self.spec.tracking.uri)} is unreachable ({type(e).__name__}): "
                  f"training starts anyway; the run is {'reopened' if run_id else 'created'} and filled in when MLflow "
                  "answers", flush=True)
            return run_id

    def run_id(self) -> str | None:
        return self.ledger.run_id

    def flush(self, force: bool = False) -> int:
        """Take in the event log and send what is pending; returns the entries left unsent, those
        still in the log included (the driver waits for them before it ends the run)."""
        if not self.current():
            return 0
        self.ledger.poll(force)
        self.gauges.update(self.ledger.goodput)
        return self.ledger.flush(force) + self.ledger.untaken

    def close(self, ok: bool, wall_s: float, ran: bool = True) -> tuple[str | None, dict[str, float], int]:
        """One more try to send, then end the run (usage, artifacts, status `ok`); `ran` False: no
        training ran in this launch (a finished job run again), so the goodput account ends at the
        job's last event. Returns (MLflow run id, last values seen, points still unsent)."""
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join()
        self.writer.stop_system_metrics()  # its last samples go with the final flush
        left = self.flush(force=True)
        run_id, latest = self.ledger.run_id, dict(self.ledger.latest)
        closed: dict[str, float] = {}

        def account() -> tuple[dict[str, float], list[dict[str, Any]]]:
            """The goodput account, ended as late as the run's last writes allow (the usage and the
            artifacts take seconds, and they are the job's time too)."""
            state = self.ledger.finish_goodput(time.time() if ran else None)
            self.gauges.update(state, force=True)
            if (said := line(state)) is not None:
                print(f"[tidal] {said}", flush=True)
            closed.update(final_metrics(state))
            return closed, rows(state)

        if run_id and self.current():
            summary = {"job": self.spec.name, "status": "FINISHED" if ok else "FAILED", "wall_s": wall_s, **latest}
            self.writer.finish(run_id, ok, summary, account)
        elif self.current():
            account()
        if self.submitted:  # this actor is ended right after: the final figures must be exported first
            self.gauges.settle()
        return run_id, {**latest, **closed}, left

    def current(self) -> bool:
        """Whether this tracker's driver still owns the job; says once when it stopped owning it."""
        if self.fence is None or self.fence.current():
            return True
        if not self.stopped_writing:
            self.stopped_writing = True
            self.writer.stop_system_metrics()
            print(f"[tidal] tracking stops: {self.fence.why()}", flush=True)
        return False

    def _loop(self, poll_s: float) -> None:
        # A fixed cadence, even while the log is quiet. Backing off (tried: 0.5 s doubling to 4 s, to
        # list an object store less often) delayed the first steps after a start or a restart,
        # when the log is quiet longest, in MLflow and on the console by up to the backoff.
        while not self.stopped.wait(poll_s):
            try:
                self.flush()
            except Exception as e:  # noqa: BLE001 - a storage hiccup must not end the tracker
                log.warning("[tidal] tracking: %s; retrying", redact_text(str(e)))
