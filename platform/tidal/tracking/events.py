"""The events of a job's event log, as typed values: what workers and the controller emit
(tracking/emitter.py), and what the ledger tells its subscribers (tracking/ledger.py), such as
the console.

On storage an event is a JSON object with a `kind` (the wire format of `tidal-mlflow-buffer`,
unchanged: a log written by an older Tidal still reads); `entry()` writes it, `parse()` reads it.
Fields the ledger adds when it passes an event on (`replay`, `lost`, `restarts`, `reported`)
have defaults: the emitter never sets them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class Event:
    KIND: ClassVar[str] = ""

    def entry(self) -> dict[str, Any]:
        """The event as the log stores it."""
        return {"kind": self.KIND, **dataclasses.asdict(self)}


@dataclass(frozen=True)
class StepMetrics(Event):
    """A log step's metrics from rank 0; `replay` when the step was trained before a restart."""

    KIND: ClassVar[str] = "metrics"
    step: int
    values: dict[str, float]
    replay: bool = False


@dataclass(frozen=True)
class CheckpointSaved(Event):
    """A checkpoint rank 0 wrote at `step`: its size and timings in `values`."""

    KIND: ClassVar[str] = "checkpoint"
    step: int
    values: dict[str, float]
    replay: bool = False


@dataclass(frozen=True)
class Resumed(Event):
    """A worker group started from `checkpoint`; `lost`: steps reached before that must be redone."""

    KIND: ClassVar[str] = "resumed"
    step: int
    checkpoint: str
    old_world: int
    world: int
    lost: int = 0


@dataclass(frozen=True)
class Note(Event):
    """A line for the person watching the job."""

    KIND: ClassVar[str] = "note"
    step: int
    text: str


@dataclass(frozen=True)
class WorkersFailed(Event):
    """Workers that failed (rank -> why); `final`: the failure that used up failure.max_restarts, after
    which Ray Train restarts nothing; `in_place`: Ray Train replaces them alone and the other ranks
    keep their processes (failure.replace_in_place). The ledger adds the restart count and the step reached."""

    KIND: ClassVar[str] = "failure"
    step: int
    failures: dict[str, str]
    final: bool = False
    restarts: float = 0
    reported: int = 0
    in_place: bool = False


@dataclass(frozen=True)
class Resized(Event):
    """The world size changed between log steps (the ledger sees it in the metrics)."""

    KIND: ClassVar[str] = "resized"
    step: int
    old_world: int
    world: int
    after_failure: bool


@dataclass(frozen=True)
class TrackingDown(Event):
    """MLflow stopped answering: metrics wait in the event log at `where`."""

    KIND: ClassVar[str] = "sink_down"
    error: str
    where: str


@dataclass(frozen=True)
class TrackingBack(Event):
    """MLflow answers again after `down_s`; `sent` buffered points went out."""

    KIND: ClassVar[str] = "sink_back"
    down_s: float
    sent: int


@dataclass(frozen=True)
class Launched(Event):
    """A driver started the job (`values`: `t0`, when it was called; `queue_s`, how long it waited
    for the cluster's admission). Written by the driver; the goodput account's first second."""

    KIND: ClassVar[str] = "launched"
    step: int
    values: dict[str, float]


@dataclass(frozen=True)
class GroupStarted(Event):
    """A worker group is set up and trains from `step` (`values`: `world`, `setup_s` since the
    train function began, `restore_s` of it spent loading the checkpoint)."""

    KIND: ClassVar[str] = "group_started"
    step: int
    values: dict[str, float]


@dataclass(frozen=True)
class GroupEnding(Event):
    """The group stops training after `step` on purpose: `reason` is a resize, a straggler's node
    out or back (`straggler`), a preemption's drain, or the job's end (`data`, `early_stop`)."""

    KIND: ClassVar[str] = "group_ending"
    step: int
    reason: str


@dataclass(frozen=True)
class GroupEnded(Event):
    """The driver saw its worker group end with no failure (Ray Train's `fit()` returned: a
    resize, a suspension, a straggler's node, or the job's end): from here no workers are held
    until the next group starts."""

    KIND: ClassVar[str] = "group_ended"
    step: int


@dataclass(frozen=True)
class HangFound(Event):
    """A hung worker group explained (worker/health/hang.py): `folder` (under the job's folder) holds every
    rank's stacks and the verdict, which the tracker stores in the MLflow run; `culprits`: the ranks
    named; `text`: the verdict; `stalled_s`: seconds from the last finished step to the detection
    (the time the hang cost before it was found)."""

    KIND: ClassVar[str] = "hang"
    step: int
    folder: str
    culprits: list[int]
    text: str
    stalled_s: float = 0.0


KINDS: dict[str, type[Event]] = {cls.KIND: cls for cls in
                                 (StepMetrics, CheckpointSaved, Resumed, Note, WorkersFailed, Resized, TrackingDown,
                                  TrackingBack, Launched, GroupStarted, GroupEnding, GroupEnded, HangFound)}


def parse(entry: Mapping[str, Any]) -> Event | None:
    """The typed event of a log entry or ledger notice; None for a kind this Tidal does not know
    (a newer writer's), which a reader skips. Keys the event does not hold (`id`, `ts`) are left out."""
    cls = KINDS.get(str(entry.get("kind", "")))
    if cls is None:
        return None
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in entry.items() if k in names})
