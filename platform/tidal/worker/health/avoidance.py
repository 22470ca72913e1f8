"""Nodes a job avoids after taking a straggler out, and when the group restarts for it: the group's
record both halves share, the rank 0 that decides and the driver that restarts the group.

`write` is the record's one writer: rank 0 carries out the group's health decision through it
(worker/health/nodes.py: a straggler's node out, a node that hung twice, a node back), and the
driver moves it on when the group it asked for restarts (`restart_for`).

A node is avoided with a Ray label selector on the node id every node carries
(`ray.io/node-id`, negated: `!<id>`) in the job's `ScalingConfig`. Labels rather than a custom
resource or placement constraints: a resource would have to be taken from the node (every job
would lose it, and Ray cannot take a resource from a running node), and a placement group's
strategies cannot exclude a node; a selector is the job's own, and the node stays for every other.

The record (`tidal-avoid.json` in the job's folder) moves through three states:
`exclude` (rank 0 found the straggler: the group ends at a checkpoint), `avoiding` (the driver
restarted it with the selector until `until`) and `return` (the time passed: rank 0 ended the
group again, and the driver restarts it without the selector, then forgets the record).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from typing import Literal

from tidal.spec.job import JobSpec
from tidal.storage import RunDir

RECORD = "tidal-avoid.json"
NODE_ID_LABEL = "ray.io/node-id"  # Ray's default label on every node
State = Literal["exclude", "avoiding", "return", "done"]


@dataclass(frozen=True)
class Avoided:
    node_id: str
    node: str  # its IP, as operators know it
    until: float  # time.time() at which the job may use it again
    rank: int
    ratio: float
    step: int  # the log step that found it
    size: int  # the group's size without the node: the most workers while it is avoided
    state: State = "exclude"
    cause: str = "straggler"  # or "hang": a node whose rank hung the group twice (worker/health/nodes.py)


def read(spec: JobSpec) -> Avoided | None:
    raw = RunDir(spec.checkpoint.storage, spec.name).read_json(RECORD)
    try:
        return Avoided(**raw) if raw else None
    except TypeError:  # a record of another Tidal: no avoidance rather than a failed start
        return None


def write(spec: JobSpec, avoided: Avoided) -> None:
    RunDir(spec.checkpoint.storage, spec.name).write_json(RECORD, asdict(avoided))


def label_selector(avoided: Avoided | None, now: float | None = None) -> dict[str, str] | None:
    """The ScalingConfig label selector keeping the job off the node, while it is avoided."""
    now = time.time() if now is None else now
    if avoided is None or avoided.state in ("return", "done") or now >= avoided.until:
        return None
    return {NODE_ID_LABEL: f"!{avoided.node_id}"}


def most_workers(most: int, avoided: Avoided | None, now: float | None = None) -> int:
    """The group's largest size while a node is avoided: the size decided without it. Ray Train's
    elastic sizing counts the cluster's free resources, not which nodes a label selector allows,
    so without this cap it asked for the avoided node's worker too and never started (seen)."""
    return min(most, avoided.size) if label_selector(avoided, now) is not None else most


def restart_for(spec: JobSpec) -> Avoided | None:
    """The driver's question when a group ended before the job did: did it end to take a node out
    or to bring it back? Then the record moves on (`avoiding`, or `done`) and is returned."""
    avoided = read(spec)
    if avoided is None or avoided.state not in ("exclude", "return"):
        return None
    write(spec, replace(avoided, state="avoiding" if avoided.state == "exclude" else "done"))
    return avoided


def describe(a: Avoided, world: int, size: int, after_s: float, avoid_s: float) -> str:
    until = time.strftime("%H:%M:%S UTC", time.gmtime(a.until))
    return (f"straggler: rank {a.rank} on node {a.node} (node id {a.node_id[:12]}) has been {a.ratio:.2f}x slower "
            f"than the median rank for {after_s:g}s (failure.straggler_exclude_after_s): checkpointing and "
            f"restarting at {size} worker(s) instead of {world} without that node, at the same global batch; this "
            f"job avoids it for {avoid_s:g}s (until {until})")
