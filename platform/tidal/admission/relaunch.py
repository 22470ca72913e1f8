"""After a head restart, the queue's jobs start again by themselves.

Ray's GCS fault tolerance (an external Redis: `RAY_REDIS_ADDRESS` on the head, KubeRay's
`gcsFaultToleranceOptions`) keeps the cluster's tables across a head restart: detached actors
come back (the admission actor among them, restarted on the new head) and the Jobs API keeps
every job's record, its entrypoint and runtime environment with its uploaded package. It keeps no
driver process: Tidal's drivers run on the head as Ray Jobs, so they all end with it, and their
records still say RUNNING.

Why by hand: Ray resubmits nothing after a head restart, and Kueue, which requeues workloads,
needs Kubernetes. The admission actor writes the head node it runs on into the queue document; a
restarted actor that finds another head there knows the head was lost. Each job the document
lists whose driver has not checked in within `RELAUNCH_GRACE_S` (a driver off the head survives
and checks in) is submitted again through the Jobs API, with its own record's entrypoint and
runtime environment, under its driver's successor id (`successor_id`: the id a parked driver's
job goes on as, fixed by the old id), so that the user's first id follows it (launch/chain.py), and
an actor that died between the submission and saving it finds it there instead of submitting twice:
- `TIDAL_QUEUE_JOB` gives the new driver the job's key, so it takes the job's place: a running job
  restarts at its size from its latest checkpoint, in its MLflow run; a waiting one keeps its turn;
- `TIDAL_RUN_WAIT=1` makes it wait for the old driver's lease (issue #46) instead of refusing, so
  a driver that did survive somewhere is never run beside;
- `TIDAL_RELAUNCHED=1` makes a replayed `--restart` a resume: the job goes on from its latest
  checkpoint in its MLflow run instead of starting over.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tidal.admission.naming import QUEUE_JOB_VAR
from tidal.admission.parking import CANCELLED, DROPPED, Cancelled, Gone, successor_id
from tidal.admission.queue_doc import Entry, Queue
from tidal.ray_auth import auth_headers, auth_token
from tidal.ray_private import HEAD_RESOURCE
from tidal.redact import redact_text

log = logging.getLogger("tidal")
RELAUNCH_GRACE_S = float(os.environ.get("TIDAL_RELAUNCH_GRACE_S", "15"))  # three heartbeats
WAIT_VAR = "TIDAL_RUN_WAIT"  # read by launch/trainer.run: the env form of `tidal run --wait`
# Set on every driver submitted again from an earlier one's record (a relaunch, a parked job's
# successor): the record's entrypoint is replayed verbatim, and a `--restart` in it was meant for
# the first start only: launch/trainer.run resumes instead of setting the job's folder aside again.
RELAUNCHED_VAR = "TIDAL_RELAUNCHED"
# A job whose record cannot be read or submitted (a new head's dashboard not up yet) is tried again
# every RETRY_S, ATTEMPTS times in all, then left to its lease.
ATTEMPTS = 6
RETRY_S = 10.0

Relauncher = Callable[[Entry], str]  # submits an entry's driver again; its new submission id


def head_node(nodes: Iterable[Mapping[str, Any]]) -> str:
    """The live head's node id among Ray's `nodes()` ("" if none is alive)."""
    return next((str(n["NodeID"]) for n in nodes if n.get("Alive")
                 and HEAD_RESOURCE in (n.get("Resources") or {})), "")


def head_lost(saved: Queue, head: str) -> bool:
    """Whether the queue was saved by admission on another head than `head`: that head is gone."""
    return bool(saved.head and head and saved.head != head)


def due(queue: Queue, pending: set[str], seen: Mapping[str, float], since: float, now: float,
        grace_s: float = RELAUNCH_GRACE_S) -> list[Entry]:
    """The pending jobs to submit again, oldest submission first: none before the grace is over
    (a driver that survived the head checks in by then), and none whose driver checked in since
    `since` (the restarted actor's start)."""
    if now - since < grace_s:
        return []
    return sorted((e for e in queue.entries if e.job in pending and seen.get(e.job, 0.0) < since),
                  key=lambda e: e.submitted_at)


def resubmission(info: Any, entry: Entry, submission_id: str) -> dict[str, Any]:
    """`JobSubmissionClient.submit_job`'s arguments for the job whose record is `info` (the Jobs
    API's JobDetails: it holds no entrypoint resources, and Tidal's submissions set none)."""
    runtime_env = dict(info.runtime_env or {})
    runtime_env["env_vars"] = {**(runtime_env.get("env_vars") or {}), QUEUE_JOB_VAR: entry.job, WAIT_VAR: "1",
                                RELAUNCHED_VAR: "1"}
    return {"entrypoint": info.entrypoint, "runtime_env": runtime_env, "metadata": dict(info.metadata or {}),
            "submission_id": submission_id}


JOBS_API_TIMEOUT_S = 30.0  # the longest the actor waits for one Jobs API call (a busy dashboard)


class _Bounded:
    """A JobSubmissionClient whose every call returns within JOBS_API_TIMEOUT_S: TimeoutError
    otherwise. Its public methods take no timeout (requests waits forever by default), so each
    call runs on a thread of a small pool of its own and is waited for that long; a call that
    hangs keeps only its thread."""

    def __init__(self, client: Any, timeout_s: float = JOBS_API_TIMEOUT_S) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._client, self._timeout_s = client, timeout_s
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tidal-jobs-api")

    def __getattr__(self, name: str) -> Any:
        from concurrent.futures import TimeoutError as Late

        call = getattr(self._client, name)
        if not callable(call):
            return call

        def bounded(*args: Any, **kwargs: Any) -> Any:
            try:
                return self._pool.submit(call, *args, **kwargs).result(timeout=self._timeout_s)
            except Late:
                raise TimeoutError(f"the cluster's Jobs API did not answer {name} within {self._timeout_s:.0f}s") from None
        return bounded


class JobsApi:
    """The Jobs API of the cluster whose GCS is at `address`, as the admission actor uses it (from
    inside the cluster, with the cluster's token); every call bounded in time (`_Bounded`)."""

    def __init__(self, address: str) -> None:
        from ray.job_submission import JobSubmissionClient

        self.client = _Bounded(JobSubmissionClient(address, headers=auth_headers(auth_token())))

    def relaunch(self, entry: Entry) -> str:
        """Submit a job's driver from the record of its last driver: again under a new id after a
        head restart, or, for a parked job (admission/parking.py), under its successor id."""
        old = entry.submission or entry.job
        info = lookup(self.client, old)
        if info is None:
            raise Gone(old)
        status = str(getattr(info.status, "value", info.status))
        if entry.successor and status in ("STOPPED", "FAILED"):
            # A parked driver ends SUCCEEDED: this one was stopped (or failed) after its park was
            # saved, and the job goes no further.
            raise Cancelled(entry.successor)
        new = entry.successor or successor_id(old)
        if not entry.successor:
            if _taken(self.client, new):
                return new  # submitted by an earlier life of the actor, which died before saving
            if status == "STOPPED":  # the user stopped it while the head was away (its record said RUNNING)
                raise Cancelled(new)
        try:
            new = self.client.submit_job(**resubmission(info, entry, new))
        except Exception:
            if entry.successor and _taken(self.client, entry.successor):
                return new  # submitted by an earlier life of the actor, which died before saving
            raise
        if not entry.successor:
            try:
                self.client.stop_job(old)  # its record said RUNNING for a driver the head took with it
            except Exception as e:  # noqa: BLE001 - the record is only a view; the job is relaunched
                log.debug("could not mark %s stopped: %s", old, e)
        return new

    def stopped(self, successor: str) -> bool:
        """Whether a stop of a parked job has taken its successor id (launch/chain.cancel)."""
        info = lookup(self.client, successor)
        return info is not None and CANCELLED in (info.metadata or {})

    def mark_dropped(self, successor: str, why: str) -> None:
        """Take a dropped parked job's successor id with a job that does nothing, saying why in its
        metadata: whoever follows the job (launch/chain.py) sees it FAILED, with the reason."""
        self.client.submit_job(entrypoint="echo '[tidal] this job left the queue without starting'",
                               submission_id=successor, entrypoint_num_cpus=0, metadata={DROPPED: why[:500]})

    def pin(self, submission: str, seconds: float) -> int:
        """Keep the packages of `submission`'s runtime environment in the GCS for `seconds`, with or
        without a job holding them (Ray deletes a package once no job does: the parked driver's
        end would take its package); how many were pinned."""
        from tidal.ray_private import pin_package

        uris = package_uris(self.client.get_job_info(submission).runtime_env or {})
        for uri in uris:
            pin_package(uri, int(seconds))
        return len(uris)


def package_uris(runtime_env: Mapping[str, Any]) -> list[str]:
    """The `gcs://` packages a runtime environment names (its working_dir and py_modules)."""
    named = [runtime_env.get("working_dir"), *(runtime_env.get("py_modules") or [])]
    return [u for u in named if isinstance(u, str) and u.startswith("gcs://")]


def lookup(client: Any, submission_id: str) -> Any | None:
    """The Jobs API's record of `submission_id`; None where the API says there is none (404). Any
    other failure (the API not answering) raises: no record is not the same as no answer."""
    try:
        return client.get_job_info(submission_id)
    except RuntimeError as e:  # Ray's client: "Request failed with status code 404: ..."
        if "status code 404" in str(e):
            return None
        raise


def _taken(client: Any, successor: str) -> bool:
    """Whether a job already holds `successor`'s id; `Cancelled` if it is the no-op job a stop of
    the parked job put there."""
    try:
        info = client.get_job_info(successor)
    except Exception:  # noqa: BLE001 - none there: the submission failed for another reason
        return False
    if CANCELLED in (info.metadata or {}):
        raise Cancelled(successor)
    return True


def current_head() -> str:
    """The head's node id, asked of the Ray this process is connected to ("" if none)."""
    import ray

    return head_node(ray.nodes()) if ray.is_initialized() else ""


def cluster_jobs_api() -> JobsApi:
    """The Jobs API of the cluster this process runs in (the admission actor's)."""
    import ray

    return JobsApi(ray.get_runtime_context().gcs_address)


class Relaunches:
    """What a restarted admission actor owes the jobs of a lost head: each listed job's driver,
    submitted again once the grace is over, unless it checked in (it survived)."""

    def __init__(self, saved: Queue, head: str, make: Callable[[], Relauncher], now: float) -> None:
        # a parked job had no driver to lose: it starts once admitted (admission/parking.py)
        self.pending = {e.job for e in saved.entries if not e.successor} if head_lost(saved, head) else set()
        self.since, self.tries, self.retry_at = now, dict.fromkeys(self.pending, 0), {}
        self._make, self._relauncher = make, None
        if self.pending:
            log.warning("the queue was saved by admission on head %s and this is head %s: the head was lost with its "
                        "drivers; the %d job(s) it lists start again unless their drivers check in within %.0fs",
                        saved.head[:12], head[:12], len(self.pending), RELAUNCH_GRACE_S)

    def run(self, queue: Queue, seen: Mapping[str, float], now: float) -> dict[str, str]:
        """Submit every due job again; each job started and its new submission id. A job that
        cannot be (its record gone) is tried ATTEMPTS times, RETRY_S apart, then left to its lease:
        it leaves the queue and must be submitted by hand, which the log says."""
        self.pending = {j for j in self.pending if seen.get(j, 0.0) < self.since and queue.get(j) is not None}
        started: dict[str, str] = {}
        for entry in due(queue, self.pending, seen, self.since, now):
            if self.retry_at.get(entry.job, 0.0) > now:
                continue
            try:
                self._relauncher = self._relauncher or self._make()
                started[entry.job] = self._relauncher(entry)
            except Cancelled:
                log.warning("job %s was stopped while the head was away: it is not started again", entry.job)
            except Exception as e:  # noqa: BLE001 - the Jobs API or the job's record: try again next tick
                self.tries[entry.job] += 1
                if self.tries[entry.job] < ATTEMPTS:
                    self.retry_at[entry.job] = now + RETRY_S
                    continue
                log.error("job %s could not be started again after the head restart (%s: %s); submit it again "
                          "(it resumes from its latest checkpoint)", entry.job, type(e).__name__, redact_text(str(e)))
            else:
                log.warning("job %s started again after the head restart as Ray job %s", entry.job, started[entry.job])
            self.pending.discard(entry.job)
        return started


__all__ = ["ATTEMPTS", "RELAUNCHED_VAR", "RELAUNCH_GRACE_S", "RETRY_S", "WAIT_VAR", "Relauncher", "Relaunches",
           "JobsApi", "cluster_jobs_api", "current_head", "due", "head_lost", "head_node",
           "package_uris", "resubmission"]
