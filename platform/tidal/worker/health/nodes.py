"""Rank 0's asks about the group's nodes: a persistent straggler's node out, a node that hung the job twice out, an avoided node back in.

Each is the group's health decision (worker/health/decide.py) carried out here, the only place on
the workers that writes the group's record (worker/health/avoidance.py).

At every log step rank 0 hands in the interval's straggler spread and where the ranks run
(worker/telemetry.py gathers both); an ask sets `target`, the size the log step's collective then
carries to every rank (worker/loop.py), so the group ends at that step's checkpoint and the driver
restarts it (launch/trainer.py). The hang court (worker/health/hang.py) counts a hang against its
culprit's node here (`avoid_hung_node`); the group the hang's restart starts then ends at its first
log step if it runs on that node.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol

from tidal.spec.job import JobSpec
from tidal.worker.health import avoidance
from tidal.worker.health.decide import NONE, HungNode, HungNodeInGroup, NodeBack, SlowNode, decide
from tidal.worker.health.stragglers import ExclusionWatch, Spread, StragglerWatch, exclusion_on


class Placed(Protocol):
    """Where a rank runs (worker/telemetry.Place)."""

    node: str
    node_id: str
    site: str


class NodeAsks:
    """One per worker; only rank 0's asks for anything (`rank0`)."""

    def __init__(self, spec: JobSpec, events: Any, world: int, rank0: bool) -> None:
        self.spec, self.events, self.world = spec, events, world
        f = spec.failure
        self.watch = StragglerWatch(f.straggler_ratio, f.straggler_intervals)
        self.exclude_on = exclusion_on(f.straggler_exclude, spec.elastic)
        on = self.exclude_on and rank0
        self.exclusion = ExclusionWatch(f.straggler_exclude_ratio, f.straggler_exclude_after_s) if on else None
        self.avoided = avoidance.read(spec) if on else None  # a node this job avoids now (record's state)
        # The group size rank 0 asks for (a straggler's node out, or back in); the log step's
        # collective carries it to every rank (worker/loop.py), NONE: train on.
        self.target = NONE
        self.excluded_node: str | None = None  # the node a straggler's exclusion took out, at that step

    def at_log_step(self, s: Spread | None, busy_s: list[float] | None, median: float, step: int,
                    places: Sequence[Placed]) -> dict[str, float]:
        """Rank 0: warn about a straggler, and ask for a new size where the decision says so; the
        keys rank 0's metrics carry when a straggler's node was taken out."""
        out: dict[str, float] = {}
        if s is not None and busy_s is not None:
            self._warn(s, busy_s, median, step, places)
            out |= self._exclude(s, step, places)
        self._exclude_hung(step, places)
        self._bring_back(step)
        return out

    def _warn(self, s: Spread, every: list[float], median: float, step: int, places: Sequence[Placed]) -> None:
        rank = self.watch.update(s)
        if rank is None:
            return
        p = places[rank]
        f = self.spec.failure
        self.events.say(
            f"WARNING: straggler: rank {rank} on node {p.node} ({p.site}, node id {p.node_id[:12]}) has been "
            f"{s.ratio:.2f}x slower than the median rank for {f.straggler_intervals} log intervals "
            f"({every[rank]:.3f}s busy per step against {median:.3f}s); the other ranks wait for it "
            f"(failure.straggler_ratio: {f.straggler_ratio:g})", step)

    def _exclude(self, s: Spread, step: int, places: Sequence[Placed]) -> dict[str, float]:
        """Take a persistent straggler's node out of the group (failure.straggler_exclude)."""
        if self.exclusion is None or self.target != NONE:
            return {}
        rank = self.exclusion.update(s, time.time())
        if rank is None:
            return {}
        sc, f = self.spec.scaling, self.spec.failure
        p = places[rank]
        d = decide(SlowNode(self.world, sum(q.node_id == p.node_id for q in places), sc.min_workers, True))
        if d.action != "avoid_node":
            self.events.say(f"straggler: rank {rank} on node {p.node} stays {s.ratio:.2f}x slower than the median, "
                            f"but without its node the group would fall below scaling.min_workers ({sc.min_workers}); "
                            f"training on at {self.world} worker(s)", step)
            return {}
        a = avoidance.Avoided(p.node_id, p.node, time.time() + f.straggler_avoid_s, rank, s.ratio, step, d.size)
        avoidance.write(self.spec, a)
        self.events.say(avoidance.describe(a, self.world, d.size, f.straggler_exclude_after_s, f.straggler_avoid_s),
                        step)
        self.target, self.excluded_node = float(d.size), p.node
        return {"straggler_excluded_rank": float(rank), "straggler_excluded": 1.0}

    def _exclude_hung(self, step: int, places: Sequence[Placed]) -> None:
        """A node that hung the job twice (`avoid_hung_node` wrote its record as the group ended)
        and runs a rank of this group: end the group at a checkpoint, so that the driver restarts
        it without that node, as for a straggler's."""
        a = self.avoided
        if a is None or a.state != "exclude" or a.cause != "hang" or self.target != NONE:
            return
        if any(p.node_id == a.node_id for p in places):
            d = decide(HungNodeInGroup(self.world, a.size))
            self.events.say(f"node {a.node} hung this job twice: checkpointing and restarting at {d.size} worker(s) "
                            "without it", step)
            self.target = float(d.size)

    def _bring_back(self, step: int) -> None:
        """In a group that avoids a node: once the avoidance is over, end the group so that the
        driver restarts it at up to max_workers, that node included."""
        a = self.avoided
        if a is None or a.state != "avoiding" or time.time() < a.until or self.target != NONE:
            return
        d = decide(NodeBack(self.world, self.spec.scaling.max_workers))
        avoidance.write(self.spec, replace(a, state=d.record or a.state))
        if d.action == "wait":  # nothing to grow into: the node is forgotten
            self.avoided = None
            return
        self.events.say(f"node {a.node} is no longer avoided (failure.straggler_avoid_s passed): checkpointing and "
                        f"restarting at up to {d.size} worker(s)", step)
        self.target = float(d.size)


def avoid_hung_node(spec: JobSpec, world: int, rank: int, node: str, node_id: str, hangs: int, on_node: int,
                    step: int) -> str:
    """A node whose rank hung the group `hangs` times is avoided like a straggler's (same switch,
    same avoid time, never below scaling.min_workers). The record is written now, as `exclude`;
    the group the hang's restart starts ends at its first log step if it runs there (rank 0,
    `NodeAsks._exclude_hung`), and the driver restarts it without the node."""
    f = spec.failure
    d = decide(HungNode(hangs, world, on_node, spec.scaling.min_workers, exclusion_on(f.straggler_exclude,
                                                                                       spec.elastic)))
    if d.action != "avoid_node":
        return (f"node {node} hung this job {hangs} times; it stays in the job (failure.straggler_exclude is off, "
                f"or without it the group would fall below scaling.min_workers)")
    avoidance.write(spec, avoidance.Avoided(node_id, node, time.time() + f.straggler_avoid_s, rank, 0.0, step, d.size,
                                            cause="hang"))
    return (f"node {node} (node id {node_id[:12]}) hung this job {hangs} times: the job avoids it for "
            f"{f.straggler_avoid_s:g}s (failure.straggler_avoid_s), restarting at {d.size} worker(s) without it")
