"""The cluster's queue, durable: one JSON document on the cluster's storage or the head's disk.

Whatever owns admission keeps its state here and only here, so that it can die, or the head can
restart, and the next owner reads back the same queue: queued jobs stay queued, running ones are
re-adopted. Writes go through `tidal.fs.write_json` (a temporary file renamed over the old one and
fsynced on a filesystem; one PUT on an object store), so a reader sees the old document or the
new one, never half.

The loop an owner runs: `load_queue` -> `admission.decide(capacity, running(q), waiting(q), ...)`
-> `apply(q, decision, now)` -> `save_queue`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from tidal import fs
from tidal.admission.policy import AdmissionDecision, QueuedJob, RunningJob
from tidal.admission.quotas import Quotas, resolve_scheduling
from tidal.errors import TidalError
from tidal.spec.job import JobSpec

State = Literal["QUEUED", "RUNNING", "SUSPENDED"]
STATES = ("QUEUED", "RUNNING", "SUSPENDED")
VERSION = 1
# Inside TIDAL_STORAGE beside the jobs' folders; a job name cannot start with a dot.
QUEUE_FILE = ".tidal-queue/queue.json"


@dataclass(frozen=True)
class Entry:
    """One submitted job as the queue knows it."""

    job: str
    name: str
    team: str
    priority: str
    min_workers: int
    max_workers: int
    submitted_at: float
    state: State = "QUEUED"
    workers: int = 0  # what admission gives it (its group restarts at this size)
    workers_now: int = 0  # what its group runs at, as its rank 0 last said
    slots_per_worker: int = 1
    last_resize: float = 0.0
    reason: str = ""
    position: int | None = None


@dataclass(frozen=True)
class Queue:
    entries: tuple[Entry, ...] = field(default_factory=tuple)

    def get(self, job: str) -> Entry | None:
        return next((e for e in self.entries if e.job == job), None)


def queue_location(storage: str) -> str:
    """The queue document under a cluster's storage root (TIDAL_STORAGE)."""
    return f"{storage.rstrip('/')}/{QUEUE_FILE}"


def load_queue(location: str) -> Queue:
    """The queue at `location` (a path or URI); empty if none was saved yet. A document that
    exists but cannot be read is an error, never an empty queue: that would drop every job."""
    filesystem, path = fs.resolve(location)
    if not fs.exists(filesystem, path):
        return Queue()
    data = fs.read_json(filesystem, path)
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("jobs"), list):
        raise TidalError(f"the queue state {location} is unreadable or of another version (expected version "
                         f"{VERSION}); move it aside to start an empty queue, after noting the jobs it lists")
    try:
        return Queue(tuple(_entry(d) for d in data["jobs"]))
    except (TypeError, ValueError) as e:
        raise TidalError(f"the queue state {location} holds a malformed job ({e}); move it aside to start an "
                         "empty queue") from None


def save_queue(location: str, queue: Queue) -> None:
    filesystem, path = fs.resolve(location)
    fs.write_json(filesystem, path, {"version": VERSION, "jobs": [asdict(e) for e in queue.entries]})


def entry_for(spec: JobSpec, job: str, quotas: Quotas | None, now: float) -> Entry:
    """A submitted job's queue entry: its team and priority, else the cluster's defaults (refused,
    listing the choices, where the quota file does not define them), and its size in the file's unit."""
    team, priority = resolve_scheduling(spec.scheduling.team, spec.scheduling.priority, quotas)
    s = spec.scaling
    return Entry(job, spec.name, team, priority, s.min_workers, s.max_workers, now,
                 slots_per_worker=(quotas or Quotas()).slots_per_worker(s.cpus_per_worker, s.gpus_per_worker))


def submitted(queue: Queue, entry: Entry) -> Queue:
    """The queue with a new job, QUEUED; a job id already there is refused (a resubmission)."""
    if queue.get(entry.job):
        raise TidalError(f"job {entry.job!r} is already in the queue; submit it under a new id")
    return Queue((*queue.entries, replace(entry, state="QUEUED", workers=0)))


def finished(queue: Queue, job: str) -> Queue:
    """The queue without a job that ended (SUCCEEDED, FAILED or STOPPED: Ray keeps those)."""
    return Queue(tuple(e for e in queue.entries if e.job != job))


def running(queue: Queue) -> list[RunningJob]:
    return [RunningJob(e.job, e.team, e.priority, e.min_workers, e.max_workers, e.workers, e.last_resize,
                       e.slots_per_worker, e.submitted_at) for e in queue.entries if e.state == "RUNNING"]


def waiting(queue: Queue) -> list[QueuedJob]:
    """QUEUED and SUSPENDED jobs; a suspended job keeps its submission time, so its place."""
    return [QueuedJob(e.job, e.team, e.priority, e.min_workers, e.max_workers, e.submitted_at, e.slots_per_worker)
            for e in queue.entries if e.state != "RUNNING"]


def apply(queue: Queue, decision: AdmissionDecision, now: float) -> Queue:
    """The queue once `decision` is carried out: states, workers, reasons and positions."""
    changes: dict[str, dict[str, Any]] = {}
    for a in decision.admit:
        changes[a.job] = {"state": "RUNNING", "workers": a.workers, "last_resize": now, "reason": "",
                          "position": None}
    for r in (*decision.shrink, *decision.grow):
        changes[r.job] = {"workers": r.workers, "last_resize": now, "reason": r.reason}
    for s in decision.suspend:
        changes[s.job] = {"state": "SUSPENDED", "workers": 0, "last_resize": now, "reason": s.reason,
                          "position": None}
    for w in decision.waiting:
        changes.setdefault(w.job, {}).update(reason=w.reason, position=w.position)
    return Queue(tuple(replace(e, **changes.get(e.job, {})) for e in queue.entries))


def _entry(d: Mapping[str, Any]) -> Entry:
    entry = Entry(**d)
    if entry.state not in STATES:
        raise ValueError(f"state {entry.state!r} is not one of {', '.join(STATES)}")
    return entry


__all__ = ["QUEUE_FILE", "STATES", "Entry", "Queue", "apply", "entry_for", "finished", "load_queue", "queue_location",
           "running", "save_queue", "submitted", "waiting"]
