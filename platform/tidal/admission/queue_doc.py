"""The cluster's queue, durable: one JSON document on the cluster's storage or the head's disk.

Whatever owns admission keeps its state here and only here, so that it can die, or the head can
restart, and the next owner reads back the same queue: queued jobs stay queued, running ones are
re-adopted. Writes go through `tidal.fs.write_json` (a temporary file renamed over the old one and
fsynced on a filesystem; one PUT on an object store), so a reader sees the old document or the
new one, never half.

The loop an owner runs: `load_queue` -> `admission.decide(capacity, running(q), waiting(q), ...)`
-> `apply(q, decision, now)` -> `save_queue`.

What is read back is untrusted input (issue #47): anyone who can write the cluster's storage can
write this file. Every entry is checked (types, job keys, team and priority names, sizes) and a
document that fails is `DamagedQueue`, which the owner sets aside and rebuilds from the live
drivers (admission/actor.py); it is never half-trusted.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from tidal import fs
from tidal.admission.decision import AdmissionDecision, QueuedJob, RunningJob
from tidal.admission.quotas import Quotas, resolve_scheduling
from tidal.errors import TidalError
from tidal.spec.job import JobSpec
from tidal.spec.scheduling import SCHEDULING_NAME
from tidal.spec.sections import NAME_PATTERN

log = logging.getLogger("tidal")
State = Literal["QUEUED", "RUNNING", "SUSPENDED"]
STATES = ("QUEUED", "RUNNING", "SUSPENDED")
VERSION = 1
# Inside TIDAL_STORAGE beside the jobs' folders; a job name cannot start with a dot.
QUEUE_FILE = ".tidal-queue/queue.json"
# A job's key: its Ray Jobs submission id (raysubmit_..., or the `<name>-<hex>` Tidal gives), else its name.
JOB_KEY = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"
HEAD_ID = r"^[0-9a-f]{0,64}$"  # a Ray node id in hex ("": none recorded yet)


def is_submission_id(value: Any) -> bool:
    """Whether `value` can be a driver's Ray Jobs submission id (read from a caller or storage)."""
    return isinstance(value, str) and re.fullmatch(JOB_KEY, value) is not None


class DamagedQueue(TidalError):
    """The queue document exists but cannot be trusted: not JSON, another version, or an entry
    that fails its checks. Never read as an empty queue (that would drop every job)."""


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
    holder: str = ""  # a digest of the token of the driver that holds the job's seat (never the token)
    submission: str = ""  # the Ray Jobs submission id of that driver (relaunched by it after a head restart)
    successor: str = ""  # parked (admission/parking.py): no driver; once admitted it starts as this Ray job


@dataclass(frozen=True)
class Queue:
    entries: tuple[Entry, ...] = field(default_factory=tuple)
    notice: str = ""  # a cluster-level message for `tidal queue` (a damaged document set aside)
    head: str = ""  # the Ray node id of the head whose admission saved it: another one means the head was lost

    def get(self, job: str) -> Entry | None:
        return self._index().get(job)

    def _index(self) -> dict[str, Entry]:
        index = self.__dict__.get("_by_job")
        if index is None:  # built once per (immutable) queue: a thousand jobs are looked up often
            index = {e.job: e for e in self.entries}
            object.__setattr__(self, "_by_job", index)
        return index


def queue_location(storage: str) -> str:
    """The queue document under a cluster's storage root (TIDAL_STORAGE)."""
    return f"{storage.rstrip('/')}/{QUEUE_FILE}"


def load_queue(location: str) -> Queue:
    """The queue at `location` (a path or URI); empty if none was saved yet. A document that
    exists but cannot be trusted raises `DamagedQueue`; storage that cannot be reached raises
    OSError (not damage: the document may be fine, read it again later)."""
    filesystem, path = fs.resolve(location)
    if not fs.exists(filesystem, path):
        return Queue()
    with filesystem.open_input_stream(path) as f:
        raw = f.read()
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise DamagedQueue(f"the queue document {location} is not JSON ({e})") from None
    return parse_queue(data, location)


def load_or_set_aside(location: str) -> Queue:
    """The saved queue; a damaged one is set aside with a cluster-level notice and the queue
    starts empty, to be rebuilt by the live drivers as they check in (never a crash loop)."""
    try:
        return load_queue(location)
    except DamagedQueue as e:
        parked = _parked_in(location)
        aside = f"{location}.damaged-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}"
        try:
            filesystem, path = fs.resolve(location)
            filesystem.move(path, fs.resolve(aside)[1])
        except OSError as moved:
            aside = f"(could not be moved: {moved})"
        kept = (f"; its {len(parked)} parked job(s), which have no driver to check in, were kept "
                f"({', '.join(p.job for p in parked)})" if parked else "")
        notice = (f"{e}; it was set aside as {aside} and the queue is being rebuilt from the jobs' drivers as "
                  f"they check in: running jobs keep their size, waiting jobs take a new place in the queue{kept}")
        log.error("%s", notice)
        return Queue(entries=parked, notice=notice)


def _parked_in(location: str) -> tuple[Entry, ...]:
    """The parked jobs of a damaged document that pass every check, each once. A parked job has no
    driver to check in again (admission/parking.py): dropped with the document, it was lost, and
    whoever followed its first id waited forever. The rest are rebuilt from their drivers."""
    try:
        filesystem, path = fs.resolve(location)
        with filesystem.open_input_stream(path) as f:
            data = json.loads(f.read())
    except (OSError, ValueError):
        return ()
    kept: dict[str, Entry] = {}
    for d in data.get("jobs", []) if isinstance(data, dict) and isinstance(data.get("jobs"), list) else []:
        try:
            entry = _entry(d)
        except (TypeError, ValueError):
            continue
        if entry.successor and entry.state != "RUNNING" and entry.job not in kept:
            kept[entry.job] = entry
    return tuple(kept.values())


def parse_queue(data: Any, source: str) -> Queue:
    """A queue document (as saved, or as the admission actor sends it) checked entry by entry."""
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("jobs"), list):
        raise DamagedQueue(f"the queue document {source} is of another version or shape (expected version {VERSION} "
                           "with a list of jobs)")
    try:
        entries = tuple(_entry(d) for d in data["jobs"])
    except (TypeError, ValueError) as e:
        raise DamagedQueue(f"the queue document {source} holds a malformed job ({e})") from None
    keys = [e.job for e in entries]
    if len(set(keys)) != len(keys):
        raise DamagedQueue(f"the queue document {source} lists a job twice")
    notice, head = data.get("notice", ""), data.get("head", "")
    if not isinstance(notice, str):
        raise DamagedQueue(f"the queue document {source} has a notice that is not text")
    if not isinstance(head, str) or not re.fullmatch(HEAD_ID, head):
        raise DamagedQueue(f"the queue document {source} names a head {head!r:.80} that is not a Ray node id")
    return Queue(entries, notice[:2000], head)


def save_queue(location: str, queue: Queue) -> None:
    filesystem, path = fs.resolve(location)
    fs.write_json(filesystem, path, document(queue), indent=None)  # compact: read with `tidal queue`


def document(queue: Queue) -> dict[str, Any]:
    return {"version": VERSION, "jobs": [row(e) for e in queue.entries], "notice": queue.notice, "head": queue.head}


def row(entry: Entry) -> dict[str, Any]:
    """An entry as the document holds it. Its fields are scalars, so a shallow copy is what
    `dataclasses.asdict` gives, at a tenth of its cost (it ran per entry per save: most of a
    save's time at 1,000 jobs)."""
    return dict(vars(entry))


def entry_for(spec: JobSpec, job: str, quotas: Quotas | None, now: float) -> Entry:
    """A submitted job's queue entry: its team and priority, else the cluster's defaults (refused,
    listing the choices, where the quota file does not define them), and its size in the file's unit."""
    team, priority = resolve_scheduling(spec.scheduling.team, spec.scheduling.priority, quotas)
    s = spec.scaling
    return Entry(job, spec.name, team, priority, s.min_workers, s.max_workers, now,
                 slots_per_worker=(quotas or Quotas()).slots_per_worker(s.cpus_per_worker, s.gpus_per_worker))


def submitted(queue: Queue, entry: Entry, adopted: bool = False) -> Queue:
    """The queue with a new job, QUEUED (or, `adopted`, as the entry says: a job found running
    after the queue was lost); a job id already there is refused (a resubmission)."""
    if queue.get(entry.job):
        raise TidalError(f"job {entry.job!r} is already in the queue; submit it under a new id")
    return replace(queue, entries=(*queue.entries, entry if adopted else replace(entry, state="QUEUED", workers=0)))


def finished(queue: Queue, job: str) -> Queue:
    """The queue without a job that ended (SUCCEEDED, FAILED or STOPPED: Ray keeps those)."""
    return replace(queue, entries=tuple(e for e in queue.entries if e.job != job))


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
    return replace(queue, entries=tuple(replace(e, **changes[e.job]) if e.job in changes else e
                                        for e in queue.entries))


def changed(queue: Queue, job: str, **changes: Any) -> Queue:
    """The queue with `job`'s entry changed."""
    return replace(queue, entries=tuple(replace(e, **changes) if e.job == job else e for e in queue.entries))


def with_world(queue: Queue, world: Mapping[str, int]) -> Queue:
    """The queue with each job's size as its rank 0 last said."""
    now = {j: w for j, w in world.items() if (e := queue.get(j)) is not None and e.workers_now != w}
    if not now:
        return queue
    return replace(queue, entries=tuple(replace(e, workers_now=now[e.job]) if e.job in now else e
                                        for e in queue.entries))


_TEXT = {"job": JOB_KEY, "name": NAME_PATTERN, "team": SCHEDULING_NAME, "priority": SCHEDULING_NAME}
_COUNTS = ("min_workers", "max_workers", "workers", "workers_now", "slots_per_worker")


def _entry(d: Any) -> Entry:
    """One job read from the document, every field checked: it names files, runs and metrics."""
    if not isinstance(d, Mapping):
        raise TypeError("a job is not an object")
    unknown = set(d) - {f.name for f in fields(Entry)}
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(sorted(map(str, unknown)))}")
    entry = Entry(**d)
    for key, pattern in _TEXT.items():
        value = getattr(entry, key)
        if not isinstance(value, str) or not re.match(pattern, value):
            raise ValueError(f"{key} {value!r:.80} is not a usable name")
    for key in _COUNTS:
        value = getattr(entry, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{key} of job {entry.job!r} is {value!r:.40}, not a whole number >= 0")
    if entry.min_workers < 1 or entry.max_workers < entry.min_workers or entry.slots_per_worker < 1:
        raise ValueError(f"job {entry.job!r} has sizes that cannot be (min_workers {entry.min_workers}, "
                         f"max_workers {entry.max_workers}, slots_per_worker {entry.slots_per_worker})")
    for key in ("submitted_at", "last_resize"):
        value = getattr(entry, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise ValueError(f"{key} of job {entry.job!r} is not a time")
    if entry.submission and not is_submission_id(entry.submission):
        raise ValueError(f"submission {entry.submission!r:.80} of job {entry.job!r} is not a Ray submission id")
    if entry.successor and not is_submission_id(entry.successor):
        raise ValueError(f"successor {entry.successor!r:.80} of job {entry.job!r} is not a Ray submission id")
    if entry.state not in STATES:
        raise ValueError(f"state {entry.state!r:.40} is not one of {', '.join(STATES)}")
    if not isinstance(entry.reason, str) or not isinstance(entry.holder, str) or not (
            entry.position is None or (isinstance(entry.position, int) and not isinstance(entry.position, bool))):
        raise ValueError(f"job {entry.job!r} has a reason, holder or position of the wrong type")
    return entry


__all__ = ["JOB_KEY", "QUEUE_FILE", "STATES", "DamagedQueue", "Entry", "Queue", "apply", "changed", "document", "entry_for",
           "finished", "is_submission_id", "load_or_set_aside", "load_queue", "row", "parse_queue", "queue_location", "running", "save_queue", "submitted", "waiting", "with_world"]
