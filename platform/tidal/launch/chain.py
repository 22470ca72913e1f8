"""A submitted job across its drivers: a queued job's driver can leave while the job waits, and
the job goes on as another Ray job once admitted (admission/parking.py).

The first submission id stays the job's name: `tidal status`, `tidal logs`, `tidal stop`,
`tidal list` and `Job` follow the chain from it here. The link is the record the parked driver
printed last (`parked_as`, launch/trainer.py), so any reader of the Jobs API finds it, and
nothing is kept on the submitting machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from tidal.admission.parking import CANCELLED, DROPPED, successor_id
from tidal.admission.relaunch import lookup
from tidal.output import parse_record

PARKED_KEY = "parked_as"
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


@dataclass(frozen=True)
class Link:
    """One Ray job of a Tidal job: its id and state. `started` is False for the successor a parked
    job waits to start as (no such Ray job yet: the job is QUEUED); a stop of a parked job makes
    it a no-op marked cancelled (STOPPED)."""

    submission_id: str
    state: str
    started: bool = True
    reason: str | None = None  # why a job that never started failed (admission dropped it)


def parked_as(client: Any, submission_id: str) -> str | None:
    """The Ray job that `submission_id`'s job went on as, if its driver parked."""
    return parse_record(client.get_job_logs(submission_id)).get(PARKED_KEY) or None


def walk(client: Any, submission_id: str, known: dict[str, str] | None = None) -> list[Link]:
    """The job's Ray jobs from `submission_id` on, its newest last. A driver that ended goes on as
    `successor_id(its id)` where that job exists (whatever the driver's end: a head restart loses
    its logs, and a driver can fail after parking), or, where its last record says it parked, as
    that id not yet started (QUEUED). `known` caches the links found (a link never changes)."""
    known = {} if known is None else known
    links: list[Link] = []
    sid, state = submission_id, str(client.get_job_status(submission_id).value)
    # Each link's id is its predecessor's with `-p`, so a chain cannot loop: it ends at a job that
    # has not ended, one with no successor, or an id at the Jobs API's length limit (its own
    # successor id). No count limit: a job that parks or is relaunched often (every wait, every
    # head loss) is followed to its end (a limit of 32 links reported SUCCEEDED at the 33rd).
    while state in TERMINAL:
        successor = known.get(sid) or successor_id(sid)
        if successor == sid:
            break
        info = lookup(client, successor)
        if info is None and (known.get(sid) or (state == "SUCCEEDED" and parked_as(client, sid))):
            known[sid] = successor
            return [*links, Link(sid, "PARKED"), Link(successor, "QUEUED", started=False)]
        if info is None:
            break
        known[sid] = successor
        links.append(Link(sid, "PARKED"))
        sid, state = successor, str(info.status.value)
        if CANCELLED in (info.metadata or {}):
            return [*links, Link(sid, "STOPPED")]
        if DROPPED in (info.metadata or {}):
            return [*links, Link(sid, "FAILED", reason=f"it left the cluster's queue without starting: "
                                                         f"{info.metadata[DROPPED]}")]
    return [*links, Link(sid, state)]


def went_on_as(client: Any, submission_id: str, poll_s: float) -> str | None:
    """The Ray job that `submission_id`'s driver goes on as, once admission has started it (waiting
    for it as long as the job waits in the queue); None if the driver did not park, or the job was
    stopped while it waited."""
    successor = successor_id(submission_id)
    info = lookup(client, successor)
    if info is None and not parked_as(client, submission_id):
        return None
    while info is None:
        time.sleep(poll_s)
        info = lookup(client, successor)
    return None if CANCELLED in (info.metadata or {}) or DROPPED in (info.metadata or {}) else successor


def cancel(client: Any, successor: str, job: str) -> bool:
    """Make sure admission never starts the job as `successor`: take that id with a job that does
    nothing, marked cancelled (the Jobs API refuses a second job under one id). If admission took
    it first, the job has started: stop that Ray job. True if something was stopped or taken."""
    try:
        client.submit_job(entrypoint=f"echo '[tidal] job {job} was stopped: this id is taken so that it never starts'",
                          submission_id=successor, entrypoint_num_cpus=0, metadata={CANCELLED: job})
        return True
    except RuntimeError:
        info = lookup(client, successor)
        if info is None:
            raise
        return CANCELLED in (info.metadata or {}) or bool(client.stop_job(successor))


def merge_rows(rows: list[dict[str, Any]], successors: dict[str, str], stopped: set[str]) -> list[dict[str, Any]]:
    """`tidal list`'s rows with each parked job's row showing where it is now (its successor's
    state and progress; QUEUED before it starts, STOPPED if `stopped` holds it: a stop while it
    waited) and its successors' rows folded into it."""
    by_id = {r["id"]: r for r in rows}
    folded: set[str] = set()
    out = []
    for row in rows:
        if row["id"] in folded or row["id"] in successors.values():
            continue
        now, sid, seen = row, row["id"], {row["id"]}
        while True:
            nxt = successors.get(sid)
            if not nxt or nxt in seen:  # `successors` is read from the cluster: a cycle there ends here
                break
            seen.add(nxt)
            folded.add(nxt)
            now = by_id.get(nxt) or {"status": "STOPPED" if nxt in stopped else "QUEUED"}
            sid = nxt
        out.append({**row, **{k: v for k, v in now.items() if k not in ("id", "name", "start_time")}}
                   if now is not row else row)
    return out


__all__ = ["PARKED_KEY", "Link", "cancel", "lookup", "merge_rows", "parked_as", "walk", "went_on_as"]
