"""A job's seat on a shared cluster: registered with the cluster's admission, QUEUED until it may
start, checked in while it runs, given back when it ends (admission/actor.py owns the decisions).

Every face goes through here (`tidal run`, the SDK, `tidal submit`, plain `ray job submit --
tidal run`): `launch/trainer.run` holds a seat around its training. Where the cluster names no
quota file there is no admission and `seat` yields None: Ray's own first come, first served.

A submitted job's driver that still waits after TIDAL_PARK_AFTER_S parks the job and ends
(admission/parking.py): the queue holds no driver per waiting job.

The admission actor being unreachable is never a reason to fail: a waiting job keeps waiting,
saying so (and for how long) in its log; a running one trains on at its size. Its driver holds
a token only it knows: the actor lets only the token's holder give the seat back.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

from tidal.admission.handle import admitter
from tidal.admission.handle import method as actor_method
from tidal.admission.naming import ACTOR, NAMESPACE, admission_enabled, job_key
from tidal.admission.parking import Parked, may_park, park_after_s, successor_id
from tidal.admission.queue_doc import entry_for
from tidal.admission.quotas import cluster_quotas
from tidal.errors import TidalError
from tidal.lease import submission_id
from tidal.spec.job import JobSpec

log = logging.getLogger("tidal")
POLL_S = 1.0
HEARTBEAT_S = 5.0
CALL_TIMEOUT_S = 15.0
SAY_SILENCE_S = 60.0  # while the actor does not answer, the wait is said again this often


class Seat:
    """One job's place in the cluster's queue; `workers` is the size admission gives it."""

    def __init__(self, spec: JobSpec) -> None:
        self.job = job_key(spec.name, storage=spec.checkpoint.storage)
        entry = entry_for(spec, self.job, cluster_quotas(os.environ), time.time())
        self.token = secrets.token_hex(16)
        # What the actor is told: it computes the slots and the submission time itself.
        self.registration = {"job": self.job, "name": spec.name, "team": entry.team, "priority": entry.priority,
                             "min_workers": entry.min_workers, "max_workers": entry.max_workers,
                             "cpus_per_worker": spec.scaling.cpus_per_worker,
                             "gpus_per_worker": spec.scaling.gpus_per_worker, "token": self.token,
                             "submission": submission_id()}
        self.entry = {"team": entry.team, "priority": entry.priority, "name": spec.name}
        park_after_s(os.environ)  # a bad TIDAL_PARK_AFTER_S is refused now, not once the job waits
        self.handle: Any = None
        self.workers = 0
        self.waited_s = 0.0  # QUEUED before the first start
        self._stop = threading.Event()
        self._said = ""
        self.parked, self.successor = False, ""

    def wait(self, poll_s: float = POLL_S, park: bool = False) -> int:
        """Until admission gives this job workers (printing its state, position and reason as
        they change, and how long the actor has been silent, if it is); the size to run at.
        `park`: a Ray Job's driver that has waited long enough leaves instead (raises `Parked`;
        admission/parking.py), once the actor has recorded where the job goes on."""
        answered, registered = time.time(), False
        started, submission = answered, self.registration["submission"]
        while True:
            # world 0: no group runs while the driver waits (before its first, or after one ended)
            status = self._call("status", self.job, 0) if registered else {}
            if status == {}:
                # Register first, also for a job the queue knows (a driver started again, by hand or by
                # admission after a head restart): this driver becomes its holder, so its `finished`
                # counts. Again when not known any more (the queue was rebuilt).
                status = self._call("submit", self.registration)
                registered = bool(status)
            if status and status.get("error"):
                raise TidalError(f"the cluster's admission refused job {self.job!r}: {status['error']}")
            if self.successor and status and self.successor in (status.get("successor"), status.get("submission")):
                # a park whose answer was lost had landed: the job is admission's to start, not this driver's
                raise Parked(self.successor, status.get("position"))
            if status and status.get("state") == "RUNNING" and status.get("workers", 0) > 0:
                self.workers = int(status["workers"])
                return self.workers
            if status:
                answered = time.time()
                if park and may_park(os.environ, submission, answered - started):
                    self._park(status)
            self._say(status, time.time() - answered)
            time.sleep(poll_s)

    def _park(self, status: dict[str, Any]) -> None:
        """Raise `Parked` if the actor records this job as parked (else wait on: it is being
        admitted, or the document could not be saved)."""
        # One id for every try: a try whose answer was lost (a timeout) but which landed is confirmed.
        self.successor = successor = successor_id(self.registration["submission"] or self.job)
        if self._call("park", self.job, self.token, successor):
            raise Parked(successor, status.get("position"))

    def tags(self) -> dict[str, str]:
        """For the job's MLflow run: whose quota it counted against, and how long it queued."""
        return {"tidal.team": self.entry["team"], "tidal.priority": self.entry["priority"],
                "tidal.queue_wait_s": f"{self.waited_s:.1f}"}

    def config(self) -> dict[str, Any]:
        """What the workers need (worker/health/directive.py): whom to ask, and the size they start for."""
        return {"job": self.job, "launched_max": self.workers}

    def keep_alive(self) -> None:
        """Check in every few seconds while the job runs: a driver silent for the lease is gone.
        Unknown to the actor (its queue document was damaged and rebuilt): register again, as a
        job running at its size."""
        def beat() -> None:
            while not self._stop.wait(HEARTBEAT_S):
                if self._call("status", self.job) == {}:
                    self._call("submit", {**self.registration, "running_workers": self.workers})
        threading.Thread(target=beat, daemon=True, name="tidal-seat").start()

    def release(self) -> None:
        self._stop.set()
        self._call("finished", self.job, self.token)

    def _call(self, method: str, *args: Any) -> Any:
        """A call to the admission actor; None while it cannot be reached (it restarts by itself;
        one is started if none runs)."""
        import ray

        try:
            self.handle = self.handle or admitter(create=True)
            return ray.get(actor_method(self.handle, method).remote(*args), timeout=CALL_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - admission restarting: ask again on the next poll
            log.debug("admission %s failed: %s: %s", method, type(e).__name__, e)
            self.handle = None
            return None

    def _say(self, status: dict[str, Any] | None, silent_s: float) -> None:
        if not status:
            # said again each SAY_SILENCE_S: a person reading the log sees it is still so
            said = round(silent_s // SAY_SILENCE_S * SAY_SILENCE_S, 3)
            line = (f"WAITING: the cluster's admission (Ray actor {ACTOR!r} in namespace {NAMESPACE!r}) has not "
                    f"answered{f' for {said:g}s' if said else ''}; the job keeps its place and waits (the actor "
                    "restarts by itself; see `ray list actors` or the dashboard's Actors tab)")
        else:
            where = f"position {status['position']}: " if status.get("position") else ""
            line = f"{status['state']}: {where}{status.get('reason') or 'waiting for admission'}"
        if line != self._said:
            print(f"[tidal] job {self.entry['name']!r} {line}", flush=True)
            self._said = line


@contextlib.contextmanager
def seat(spec: JobSpec) -> Iterator[Seat | None]:
    """Hold the job's seat while it trains: None where the cluster has no admission."""
    if not admission_enabled(os.environ):
        yield None
        return
    s = Seat(spec)
    try:
        t0 = time.time()
        s.wait(park=True)
        s.waited_s = time.time() - t0
        s.keep_alive()
        yield s
    except Parked:
        s.parked = True  # the seat stays the job's: admission starts its next driver
        raise
    finally:
        if not s.parked:
            s.release()


__all__ = ["Parked", "Seat", "seat"]
