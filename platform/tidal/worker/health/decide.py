"""What a fault or a signal does to the worker group, and at what size: one pure decision.

Every cause that changes the group goes through `decide`: a new size from the cluster's admission,
a persistent straggler's node, a node whose rank hung the job twice (or such a node found in a new
group), the end of a node's avoidance, a lost worker and a hang. The answer is an `action`, the
group's size after it, and the next state of the group's record of an avoided node
(worker/health/avoidance.py, which writes it). The callers carry it out: rank 0 at its log step
(worker/health/nodes.py; worker/loop.py for admission's word), the hang court
(worker/health/hang.py), Ray Train for a lost worker or a hang (it restarts the group, or replaces
the lost worker alone: worker/loop.py re-forms the survivors; for a hang, once the court ended its
silent culprits).

Actions: `wait` (train on at the size), `restart` (the group restarts at `size`: larger, or the
same after a fault), `shrink` (restarts smaller; 0 suspends the job), `avoid_node` (restarts at
`size` without a node), `replace` (failure.replace_in_place: the lost rank, or a hang's silent culprit once ended, is replaced alone, the others keep
their processes and re-form the group with it, worker/health/rendezvous.py; anything that goes wrong there
restarts the group).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tidal.worker.health.stragglers import size_without

NONE = -1.0  # no size asked for: the log step's collective carries it (admission's, or the job's own)
AVOID_AFTER = 2  # hangs a node's rank caused before the job avoids the node

Action = Literal["wait", "restart", "shrink", "avoid_node", "replace"]
RecordState = Literal["exclude", "return", "done"]


@dataclass(frozen=True)
class Admission:
    """The cluster's admission gives the job `target` workers (NONE: no word) for a group launched at `launched`."""

    target: float
    launched: int


@dataclass(frozen=True)
class SlowNode:
    """A rank stayed slower than the median long enough (failure.straggler_exclude_after_s); its
    node holds `on_node` of the group's `world` ranks. `exclude`: failure.straggler_exclude's switch."""

    world: int
    on_node: int
    min_workers: int
    exclude: bool


@dataclass(frozen=True)
class HungNode:
    """A hang was explained and its culprit's node has now caused `hangs` hangs of the job."""

    hangs: int
    world: int
    on_node: int
    min_workers: int
    exclude: bool


@dataclass(frozen=True)
class HungNodeInGroup:
    """A new group runs a rank on a node recorded (as `exclude`, by a hang) to be avoided at `size`."""

    world: int
    size: int


@dataclass(frozen=True)
class NodeBack:
    """The avoidance of a node is over (failure.straggler_avoid_s) in a group of `world` workers."""

    world: int
    max_workers: int


@dataclass(frozen=True)
class LostWorker:
    """A worker's process died (or its node went), seen by a rank whose collective lost it. `in_place`:
    failure.replace_in_place; `reforming`: that rank re-formed the group after a loss and has trained no
    step in it since (the fault may be its own process's state: a replacement failing on meeting it)."""

    world: int
    in_place: bool = False
    reforming: bool = False


@dataclass(frozen=True)
class Hang:
    """The watchdog found the group hung. `in_place`: failure.replace_in_place; `ended`: every culprit was
    silent (its heartbeat stopped) and its process is now ended, so Ray Train sees lost workers it can
    replace alone; `node_due`: a culprit's node reached the hangs that may avoid it (only a restart does)."""

    world: int
    in_place: bool = False
    ended: bool = False
    node_due: bool = False


Signal = Admission | SlowNode | HungNode | HungNodeInGroup | NodeBack | LostWorker | Hang


@dataclass(frozen=True)
class Decision:
    action: Action
    size: int  # the group's size after the action (for `wait`, the size it has)
    record: RecordState | None = None  # the avoided node's record's next state; None: unchanged


def decide(signal: Signal) -> Decision:
    """What happens to the group for `signal`, and its size after."""
    match signal:
        case Admission(target, launched):
            if target == NONE or int(target) == launched:
                return Decision("wait", launched)
            return Decision("shrink" if int(target) < launched else "restart", int(target))
        case SlowNode(world, on_node, min_workers, exclude):
            size = size_without(world, on_node, min_workers)
            if not exclude or size is None:  # off, or the group would fall below scaling.min_workers
                return Decision("wait", world)
            return Decision("avoid_node", size, "exclude")
        case HungNode(hangs, world, on_node, min_workers, exclude):
            # A hang restarts the group in any case (Ray Train, after the hanging rank exits); its
            # culprit's node is avoided once it caused AVOID_AFTER hangs (said once: at that count).
            size = size_without(world, on_node, min_workers)
            if hangs != AVOID_AFTER or not exclude or size is None:
                return Decision("restart", world)
            return Decision("avoid_node", size, "exclude")
        case HungNodeInGroup(_, size):
            return Decision("avoid_node", size)
        case NodeBack(world, max_workers):
            if world >= max_workers:  # nothing to grow into: the node is forgotten
                return Decision("wait", world, "done")
            return Decision("restart", max_workers, "return")
        case LostWorker(world, in_place, reforming) if in_place and not reforming and world > 1:
            # Ray Train replaces the lost worker alone (same size, its bundle); the survivors re-form with it
            return Decision("replace", world)
        case Hang(world, in_place, ended, node_due) if in_place and ended and not node_due and world > 1:
            # The culprits' processes are gone as a killed worker's: the live ranks, whose collective lost
            # them, re-form in place. A rank alive but stuck cannot be: its training thread never raises.
            return Decision("replace", world)
        case LostWorker(world) | Hang(world):
            return Decision("restart", world)  # Ray Train restarts the group from the last checkpoint
    raise TypeError(f"not a health signal: {signal!r}")


def group_target(admission: float, own: float, launched_max: int) -> tuple[float, str]:
    """The one size this group is asked to restart at, and who asked ("admission", "own", or "" with
    NONE: train on). Rank 0 decides it before the log step's collective, which carries only this.

    Admission's word wins when it gives the group a new size; otherwise the job's own ask stands
    (worker/health/nodes.py: a persistent straggler's node out, or back once avoided; a node that hung
    the job twice). Under admission the driver restarts those too, at most at the seat's size and
    without the avoided node (launch/trainer.py). Before, admission's target replaced the job's own
    whenever the job was under admission, so a straggler was announced but never taken out.
    """
    if decide(Admission(admission, launched_max)).action != "wait":
        return admission, "admission"
    return (own, "own") if own != NONE else (NONE, "")


def resize_to(target: float, launched_max: int | None) -> int | None:
    """The size to restart at, when the agreed `target` differs from the size this group was
    launched for; None: train on."""
    if launched_max is None:
        return None
    d = decide(Admission(target, launched_max))
    return None if d.action == "wait" else d.size
