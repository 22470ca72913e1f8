"""The tracker as a Ray actor on the driver's node, started without waiting for it.

MLflow takes seconds to import and a store a moment to open a run; both happen in the actor's
process while Ray starts the controller and the workers, instead of before them. The driver
never imports MLflow on this path (this module does not), and no worker needs the run id: it
lives in the job file (tracking/tracker.py says why nothing in training may wait on tracking).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import ray

from tidal.spec.job import JobSpec

# How long the driver's end waits for the tracker to answer at all (`TrackerActor.ping`) before it
# takes the actor as gone and ends the run itself: a restarted tracker imports MLflow and reopens its
# store in seconds, but one whose constructor ends its process (pyarrow aborting in C++ on a store it
# cannot reach) is restarted by Ray without end (max_restarts=-1), and every call to it waits for good.
PING_TIMEOUT_S = 120.0

class TrackerActor:
    """tracking.tracker.Tracker, built in the actor's own process (Ray needs a class it can name
    without importing MLflow in the driver)."""

    def __init__(self, spec: JobSpec, tags: dict[str, str], record: dict[str, Any] | None,
                 lease: dict[str, Any] | None = None) -> None:
        from tidal.redact import install as install_redaction
        from tidal.tracking.console import hold_tidal_lines
        from tidal.tracking.tracker import Tracker

        # This process's own output goes to Ray's worker log files on the head, which no other
        # redaction reaches: mask it as the driver's and the workers' is (tests/test_secrets_e2e.py
        # found the tracking URI's password there). MLflow's "View run ... at: <URI>" line, printed
        # when a run ends, is off: the driver's end summary says where the run is.
        install_redaction()
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
        self.lines = hold_tidal_lines()  # the driver prints them, without Ray's actor prefix
        self.tracker = Tracker(spec, tags, record=record, lease=lease)

    def ping(self) -> bool:
        """True once this actor is up: the driver's bounded check before its calls that may take long."""
        return True

    def take_lines(self) -> list[str]:
        """The `[tidal]` lines printed here since the last call (tidal.launch.console_pump)."""
        return self.lines.take()

    def run_id(self) -> str | None:
        return self.tracker.run_id()

    def flush(self, force: bool = False) -> int:
        return self.tracker.flush(force)

    def close(self, ok: bool, wall_s: float) -> tuple[str | None, dict[str, float], int]:
        return self.tracker.close(ok, wall_s)

    def run_url(self) -> str | None:
        """How a person opens the run (tracking/reader.py), built here, where MLflow is loaded: the
        driver importing MLflow for this one link cost each `tidal run` about 1 s after its job ended."""
        from tidal.tracking.reader import safe_run_url

        run_id = self.tracker.run_id()
        return safe_run_url(self.tracker.spec, run_id) if run_id else None


def start_tracker(spec: JobSpec, tags: dict[str, str], record: dict[str, Any] | None,
                  on_run_id: Callable[[str | None], None],
                  lease: dict[str, Any] | None = None) -> tuple[Any, ray.ObjectRef]:
    """(the actor, a reference to its MLflow run id); `on_run_id` is called with the id once the
    tracker has opened the run (None: MLflow was unreachable; the tracker creates it later).
    `lease`: the driver's generation (tidal/lease.py); the tracker writes nothing once a newer
    start owns the job.

    Pinned to this (the driver's) node, where a SQLite store lives. Ray restarts it whenever it
    dies and retries the driver's calls to it: it recovers from the job's event log.
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = ray.remote(num_cpus=0, scheduling_strategy=here, max_restarts=-1,
                       max_task_retries=-1)(TrackerActor).remote(spec, tags, record, lease)
    run_id = actor.run_id.remote()
    run_id.future().add_done_callback(lambda f: on_run_id(None if f.exception() else f.result()))
    return actor, run_id
