"""What `tidal queue` shows: every job the cluster's admission knows, from its queue document.

Read from the document, not from the admission actor, so that a laptop reaching the cluster's
storage (TIDAL_STORAGE, s3://...) sees the queue without a Ray connection, and the view still
answers while the actor restarts. A job leaves the queue when it ends (`tidal list` shows Ray's
SUCCEEDED, FAILED or STOPPED).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tidal.admission.queue_doc import Entry, Queue, load_queue

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
    from tidal.admission.actor import queue_document, queue_named

    if not queue_named(environ):
        return []
    try:
        return rows(load_queue(queue_document(environ)))
    except Exception:  # noqa: BLE001 - unreadable from here (credentials, network): Ray's status stands
        return []


def queue_record(job: str, environ: Mapping[str, str]) -> dict[str, Any] | None:
    """`job`'s row in the cluster's queue, where readable here; None otherwise."""
    return next((r for r in queue_rows(environ) if r["job"] == job), None)


def table(records: list[dict[str, Any]]) -> str:
    if not records:
        return "the queue is empty: no job waits or runs under the cluster's admission"
    lines = [f"{'JOB':<24} {'TEAM':<12} {'PRIORITY':<9} {'STATE':<10} {'WORKERS':>9} {'POS':>4}  REASON"]
    for r in records:
        workers = f"{r['workers']}/{r['min_workers']}-{r['max_workers']}"
        lines.append(f"{r['job'][:24]:<24} {r['team'][:12]:<12} {r['priority']:<9} {r['state']:<10} {workers:>9} "
                     f"{r['position'] or '-':>4}  {r['reason']}")
    return "\n".join(lines)


__all__ = ["FIELDS", "queue_record", "queue_rows", "rows", "state", "table"]
