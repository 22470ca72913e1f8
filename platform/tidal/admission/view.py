"""What `tidal queue` shows: every job the cluster's admission knows, from its queue document.

Two ways to it, the same rows: the document itself, where this machine reaches the cluster's
storage (TIDAL_STORAGE, s3://...: no Ray connection, and it answers while the actor restarts);
or, from a laptop with only the dashboard's address (`--address`, RAY_ADDRESS), through the Jobs
API: a small job on the head (`python -m tidal.admission.view`) asks the admission actor for the
document as last saved (or reads it where the head names it) and prints it; no storage mount or
credentials are needed here. A job leaves the queue when it ends (`tidal list` shows Ray's
SUCCEEDED, FAILED or STOPPED).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Mapping
from typing import Any

from tidal.admission.queue_doc import Entry, Queue, load_queue, parse_queue
from tidal.errors import ClusterError
from tidal.jobs_api import AGENT_WAIT_S, submit_accepted

MARK = "TIDAL_QUEUE_DOCUMENT "  # the line of the head job's output that holds the document
REMOTE_TIMEOUT_S = 120.0

FIELDS = ("job", "name", "team", "priority", "state", "workers", "min_workers", "max_workers", "reason", "position")


def state(e: Entry) -> str:
    """QUEUED, RUNNING, SHRUNK (running below max_workers after admission took workers) or SUSPENDED."""
    if e.state == "RUNNING" and e.workers < e.max_workers and e.reason.startswith("shrunk"):
        return "SHRUNK"
    return e.state


def rows(queue: Queue) -> list[dict[str, Any]]:
    """One object per job: running ones first, then the queue in order. `workers` is what the
    job runs at now (its rank 0's last word: 0 before its first group started, or once its
    driver said the group ended); `target_workers` is what admission gives it."""
    out = [{"job": e.job, "name": e.name, "team": e.team, "priority": e.priority, "state": state(e),
            "workers": e.workers_now, "min_workers": e.min_workers, "max_workers": e.max_workers,
            "reason": e.reason, "position": e.position, "target_workers": e.workers, "submitted_at": e.submitted_at}
           for e in queue.entries]
    return sorted(out, key=lambda r: (r["position"] is not None, r["position"] or 0, r["submitted_at"]))


def queue_rows(environ: Mapping[str, str]) -> list[dict[str, Any]]:
    """The cluster's queue where this machine can read its document (TIDAL_QUEUE or TIDAL_STORAGE
    set here); [] where it cannot: the queue is extra detail, Ray's own status still answers."""
    from tidal.admission.naming import queue_document, queue_named

    if not queue_named(environ):
        return []
    try:
        return rows(load_queue(queue_document(environ)))
    except Exception:  # noqa: BLE001 - unreadable from here (credentials, network): Ray's status stands
        return []


def queue_record(job: str, environ: Mapping[str, str]) -> dict[str, Any] | None:
    """`job`'s row in the cluster's queue, where readable here; None otherwise."""
    return next((r for r in queue_rows(environ) if r["job"] == job), None)


def remote_queue(client: Any, timeout_s: float = REMOTE_TIMEOUT_S) -> Queue:
    """The cluster's queue through the Jobs API (`client`: a JobSubmissionClient, auth set): a
    job on the head prints the document; its output is read back and the job deleted. The
    document is checked like one read from storage (it is the cluster's word, not this machine's)."""
    sid = f"tidal-queue-{secrets.token_hex(4)}"
    submit_accepted(client, AGENT_WAIT_S, entrypoint="python -m tidal.admission.view", submission_id=sid,
                    entrypoint_num_cpus=0, metadata={"tidal.queue": "1"})
    deadline = time.time() + timeout_s
    try:
        while str(client.get_job_status(sid).value) not in ("SUCCEEDED", "FAILED", "STOPPED"):
            if time.time() > deadline:
                raise ClusterError(f"the cluster did not answer `tidal queue` within {timeout_s:.0f}s (job {sid}); "
                                   "is the head busy? try again, or pass --storage")
            time.sleep(0.5)
        logs = client.get_job_logs(sid)
    finally:
        try:
            client.stop_job(sid)
            client.delete_job(sid)
        except Exception:  # noqa: BLE001 - a finished job's leftovers: the answer stands
            pass
    line = next((ln for ln in reversed(logs.splitlines()) if ln.startswith(MARK)), None)
    if line is None:
        raise ClusterError(f"the cluster's answer to `tidal queue` held no queue (job {sid}); its output ends: "
                           f"{logs[-500:]!r}. Is Tidal installed on the head?")
    return parse_queue(json.loads(line[len(MARK):]), f"the cluster (job {sid})")


def head_document(environ: Mapping[str, str]) -> dict[str, Any]:
    """On the head (the job `remote_queue` submits): the actor's document as last saved; where no
    actor runs, the document where the head's environment names it; else an empty queue."""
    import ray

    from tidal.admission.handle import admitter
    from tidal.admission.naming import queue_document

    ray.init(log_to_driver=False)
    actor = admitter()
    if actor is not None:
        return dict(ray.get(actor.document.remote(), timeout=60))
    if environ.get("TIDAL_QUOTAS"):
        from tidal.admission.queue_doc import document

        return document(load_queue(queue_document(environ)))
    return {"version": 1, "jobs": [], "notice": "this cluster has no admission (its nodes name no TIDAL_QUOTAS)"}


def table(records: list[dict[str, Any]], notice: str = "") -> str:
    first = [f"NOTICE: {notice}", ""] if notice else []
    if not records:
        return "\n".join([*first, "the queue is empty: no job waits or runs under the cluster's admission"])
    lines = [*first, f"{'JOB':<24} {'TEAM':<12} {'PRIORITY':<9} {'STATE':<10} {'WORKERS':>9} {'POS':>4}  REASON"]
    for r in records:
        workers = f"{r['workers']}/{r['min_workers']}-{r['max_workers']}"
        lines.append(f"{r['job'][:24]:<24} {r['team'][:12]:<12} {r['priority']:<9} {r['state']:<10} {workers:>9} "
                     f"{r['position'] or '-':>4}  {r['reason']}")
    return "\n".join(lines)


if __name__ == "__main__":
    import os

    print(MARK + json.dumps(head_document(os.environ)), flush=True)


__all__ = ["FIELDS", "MARK", "head_document", "queue_record", "queue_rows", "remote_queue", "rows", "state", "table"]
