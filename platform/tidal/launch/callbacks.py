"""Ray Train controller callbacks (they run in Ray's controller process, not in the workers)."""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any

from ray.train import UserCallback

from tidal.eval_best import spared
from tidal.launch.recovery import not_retried, signature
from tidal.ray_private import (
    recompute_reserved_resources,
    replace_lost_groups_together,
    worker_error,
)
from tidal.spec.job import JobSpec
from tidal.storage import RunDir
from tidal.tracking.emitter import Emitter
from tidal.tracking.quiet import PEER_LOST, quiet_controller
from tidal.worker.health.decide import LostWorker, decide

log = logging.getLogger("tidal")


class FailureNotifier(UserCallback):
    """Ray Train controller callback: records in the job's event log that the worker group failed
    (the tracker counts and prints it), written at once so a dead tracker cannot lose it."""

    def __init__(self, spec: JobSpec) -> None:
        self.storage, self.name = spec.checkpoint.storage, spec.name
        self.last_mistake: str | None = None  # the user's mistake the last attempt ended with (recovery.signature)
        # Ray Train's FailureConfig(max_failures=...): the failure past it is not restarted (-1: no limit)
        self.max_restarts, self.failures = spec.failure.max_restarts, 0
        self.in_place = spec.failure.replace_in_place

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickled in Ray Train's controller: lower its chatter there (tracking/quiet.py), which
        the setup hook does only when Tidal itself connected to Ray."""
        self.__dict__.update(state)
        quiet_controller()
        if self.in_place:  # several ranks lost at once are replaced alone too (ray_private: Ray 2.60 failed the run)
            replace_lost_groups_together()

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        errors = {r: worker_error(e) for r, e in worker_exceptions.items()}
        mistake = not_retried(errors, self.last_mistake)
        self.last_mistake = signature(errors)
        if mistake is not None:  # before the event: no restart to count or announce
            raise mistake  # an error Ray Train's controller did not expect: it ends the run, retrying nothing
        # A death its node's preemption caused is charged to Ray Train's max_preemption_failures (no limit), not here
        self.failures += not any(getattr(getattr(e, "health_check_failure", e), "preempted", False) for e in worker_exceptions.values())
        final = 0 <= self.max_restarts < self.failures  # Ray Train gives up: no "restart N" to announce
        events = Emitter(self.storage, self.name)
        events.failed({r: failure_line(e) for r, e in worker_exceptions.items()}, final=final,
                      in_place=not final and self.in_place and replaced_alone(
                          True, run_context.scaling_config.num_workers, len(worker_exceptions)))
        events.drain(timeout_s=10.0)  # a storage outage must not hold up Ray's restart


def replaced_alone(in_place: bool, workers: int | tuple[int, int], failed: int) -> bool:
    """Whether Ray Train replaces the `failed` workers alone: failure.replace_in_place's decision for a
    lost worker (worker/health/decide.py), and some of the group's fixed size left (Ray Train 2.60
    restarts the whole group when every worker failed, or when the group changes size)."""
    return (isinstance(workers, int) and 0 < failed < workers
            and decide(LostWorker(workers, in_place=in_place)).action == "replace")


def failure_line(e: BaseException) -> str:
    """Why a rank failed, for its `worker rank N failed: ...` line: its error's last line, or, for a
    rank whose collective lost its peer, that in Tidal's words. gloo's own is a transport error
    naming a socket and ending "GLHF! 🏖️", which reads as if this rank were the one at fault."""
    text = str(e).strip()
    if lost := PEER_LOST.search(text):
        return f"its collective lost a peer ({lost.group(0)}): another rank's process or node went away"
    if died := process_died(text):
        return died
    return text.splitlines()[-1][:300] if text else type(e).__name__


# Ray's text for an actor whose process ended with no Python error (a signal: SIGKILL, SIGSEGV ...):
# it lists "common causes", the OOM killer first, though it knows none of them.
DIED = re.compile(r"worker process has died\. Worker exit type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits")


def process_died(text: str) -> str | None:
    """What is known of a worker whose process died without a Python error: its pid and node."""
    if not DIED.search(text):
        return None
    pid, ip = re.search(r"^\s*pid: (\d+)", text, re.M), re.search(r"^\s*ip: (\S+)", text, re.M)
    where = f" (pid {pid.group(1)}" + (f" on node {ip.group(1)}" if ip else "") + ")" if pid else ""
    return (f"its process{where} died without a Python error: ended by a signal (SIGKILL from a kill or the "
            "kernel's OOM killer, SIGSEGV from a crash; Ray does not report which)")


class Retention(UserCallback):
    """After every checkpoint, delete old ones Ray never registered (so its num_to_keep never sees
    them: reported just before a crash, or written by an earlier driver). Runs in Ray's controller."""

    def __init__(self, spec: JobSpec) -> None:
        self.spec, self.storage, self.name, self.keep = spec, spec.checkpoint.storage, spec.name, spec.checkpoint.keep

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
        if checkpoint is None:
            return
        try:
            run_dir = RunDir(self.storage, self.name)
            run_dir.prune(self.keep, spare=spared(self.spec, run_dir))
        except OSError as e:  # retention can wait for the next checkpoint; training must not
            log.warning("checkpoint retention skipped this time: %s", e)


class ClusterView(UserCallback):
    """After a worker failure in an elastic job, has Ray look at the cluster's nodes again at once,
    so the next worker group is sized for the nodes still alive. Runs in Ray's controller.

    Why by hand: Train V2's elastic policy sizes a new group from what Ray's autoscaling
    coordinator reserved for it, and the coordinator looks at the cluster only every 20 s
    (`TICK_INTERVAL_S`). After a node died, the next group was sized for the dead node too; its
    placement group never became ready, and the controller retried every start timeout
    (tidal/launch/recovery.py) until the coordinator's next look: 4 timeouts of 5 s, 27.7 s from
    a node's removal to the first step at the smaller size (benchmarks/node_loss.py). The
    coordinator can look again on request (`get_reserved_resources(..., recompute=True)`), but
    nothing in Ray asks it to after a failure, and it has no public API: if the call fails, the
    start timeout is still there to fall back on. A node can be known dead a few seconds after its
    workers' failure (GCS's health checks), so it looks again every `every_s` for `for_s`.
    """

    def __init__(self, every_s: float = 2.0, for_s: float = 30.0) -> None:
        self.every_s, self.for_s = every_s, for_s
        self.until = 0.0
        self.lock = threading.Lock()  # `until` and whether a thread runs change together
        self.thread: threading.Thread | None = None

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        refresh_cluster_view()  # before the controller sizes the next group, in this same loop step
        with self.lock:
            self.until = time.monotonic() + self.for_s
            if self.thread is None:
                self.thread = threading.Thread(target=self._again, daemon=True, name="tidal-cluster-view")
                self.thread.start()

    def _again(self) -> None:
        while True:
            time.sleep(self.every_s)
            refresh_cluster_view()
            with self.lock:  # a failure meanwhile extends `until` and finds this thread still running
                if time.monotonic() >= self.until:
                    self.thread = None
                    return

    def __getstate__(self) -> dict[str, Any]:  # built in the driver, sent to the controller
        return {"every_s": self.every_s, "for_s": self.for_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)


def refresh_cluster_view(timeout_s: float = 5.0) -> bool:
    """Has Ray's autoscaling coordinator re-read the cluster's nodes and re-reserve its requests now
    (a requester it does not know gets nothing and changes nothing). False if it could not."""
    try:
        recompute_reserved_resources("tidal", timeout_s)
        return True
    except Exception as e:  # noqa: BLE001 - no coordinator yet, or another Ray: the start timeout remains
        log.debug("could not refresh Ray's view of the cluster: %s: %s", type(e).__name__, e)
        return False
