"""The memory tier's keepers: one Ray actor per node per job that holds ranks' snapshots in host memory.

A keeper is a detached actor pinned to its node (`NodeAffinitySchedulingStrategy(soft=False)`),
named for the job and the node, so it outlives the training workers: a worker's own objects die
with it, a keeper's copies do not (it keeps them in its own heap, not as references to a
worker's objects). Each rank hands its shard of a snapshot to its node's keeper and to the keeper
of the next node of its group (a ring): a worker's death leaves its node's copy, a node's loss
the peer's. A keeper keeps what it was given until a rank tells it which snapshot is complete
(`prune_below`): then only that one and newer ones stay (the newest complete one and the one
being written). It never decides completeness: rank 0 does, from every keeper's listing
(tidal.worker.checkpoint.route.newest).

The driver removes the job's keepers when the job ends, and any left from an earlier driver of
the same job when it starts (a driver that died could not). Only Ray's public API is used here,
and no torch: the driver imports this module.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

log = logging.getLogger("tidal")

NAMESPACE = "tidal-memory"
PREFIX = "tidal-keeper"
DEFAULT_SHARE = 0.5  # of the node's memory a keeper may hold when checkpoint.memory.max_gb is unset
RESERVE_SHARE = 0.1  # a put is refused when it would leave less than this share of the node's memory free


def name(job: str, node_id: str) -> str:
    return f"{PREFIX}:{job}:{node_id}"


def job_of(actor_name: str) -> str | None:
    """The job a keeper's name belongs to (None: not a keeper's name)."""
    head, _, rest = actor_name.partition(":")
    if head != PREFIX or ":" not in rest:
        return None
    return rest.rsplit(":", 1)[0]


class Keeper:
    """Holds shards of snapshots: (attempt, step, rank) -> the shard's files (name -> bytes) and
    its facts (world size, node of the rank, fingerprint...). Run as a Ray actor (`handle`)."""

    def __init__(self, job: str, node_id: str, limit_bytes: int | None) -> None:
        import psutil

        self.job, self.node_id = job, node_id
        total = psutil.virtual_memory().total
        self.limit = limit_bytes if limit_bytes is not None else int(total * DEFAULT_SHARE)
        self.reserve = int(total * RESERVE_SHARE)
        self.shards: dict[tuple[str, int, int], tuple[dict[str, Any], dict[str, bytes]]] = {}
        self.touched = time.time()

    def held_bytes(self) -> int:
        return sum(len(b) for _, files in self.shards.values() for b in files.values())

    def put(self, attempt: str, step: int, rank: int, facts: dict[str, Any], files: dict[str, Any],
            prune_below: int | None = None) -> str | None:
        """Keep one rank's shard of the snapshot of `step` (`files`: name -> bytes, or a numpy uint8
        view of them); first drop every shard older than `prune_below` (the newest snapshot known
        complete). Returns None, or why it was refused (the memory limit): the previous complete
        snapshot then stays the resume point."""
        import psutil

        self.touched = time.time()
        if prune_below is not None:
            for key in [k for k in self.shards if k[1] < prune_below]:
                del self.shards[key]
        self.shards.pop((attempt, step, rank), None)  # a retry of the same shard replaces it
        size = sum(len(b) for b in files.values())
        if self.held_bytes() + size > self.limit:
            return (f"the keeper on node {self.node_id[:8]} would hold {(self.held_bytes() + size) / 2**30:.2f} GiB, "
                    f"over its limit of {self.limit / 2**30:.2f} GiB (checkpoint.memory.max_gb)")
        if psutil.virtual_memory().available - size < self.reserve:
            return (f"node {self.node_id[:8]} has {psutil.virtual_memory().available / 2**30:.2f} GiB free, too little "
                    f"for a {size / 2**30:.2f} GiB shard and the {self.reserve / 2**30:.2f} GiB kept free")
        # Bytes of its own: a worker's numpy views are Ray's object-store copy, freed after this call.
        owned = {n: b if isinstance(b, bytes) else bytes(b) for n, b in files.items()}
        self.shards[(attempt, step, rank)] = ({**facts, "held_on": self.node_id}, owned)
        return None

    def listing(self) -> list[dict[str, Any]]:
        """Every shard held: its key, facts and file sizes (no bytes)."""
        return [{"attempt": a, "step": s, "rank": r, **facts, "sizes": {n: len(b) for n, b in files.items()}}
                for (a, s, r), (facts, files) in self.shards.items()]

    def get(self, attempt: str, step: int, rank: int, names: list[str]) -> dict[str, Any] | None:
        """The files `names` of a shard (each a numpy uint8 view of the bytes held), or None if it is
        not held (any more). As numpy arrays, Ray copies them once into its object store and the
        caller reads them there without a copy; as bytes they were pickled and unpickled whole."""
        import numpy as np

        shard = self.shards.get((attempt, step, rank))
        if shard is None or any(n not in shard[1] for n in names):
            return None
        return {n: np.frombuffer(shard[1][n], dtype=np.uint8) for n in names}

    def stats(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "bytes": self.held_bytes(), "shards": len(self.shards),
                "limit": self.limit, "touched": self.touched}


def handle(job: str, node_id: str, limit_bytes: int | None) -> Any:
    """The keeper of `job` on `node_id`, started there if it is not running yet."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor = ray.remote(Keeper).options(
        name=name(job, node_id), namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0,
        max_restarts=0, max_concurrency=4,  # a restore's gets go on while a snapshot's put lands
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
    return actor.remote(job, node_id, limit_bytes)


def keepers(job: str) -> dict[str, Any]:
    """The job's live keepers: actor name -> handle (a keeper whose node is gone is not listed, or
    fails when asked: callers skip those)."""
    import ray

    out = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry.get("namespace") != NAMESPACE or job_of(entry.get("name", "")) != job:
            continue
        with contextlib.suppress(ValueError):  # gone between the listing and the lookup
            out[entry["name"]] = ray.get_actor(entry["name"], namespace=NAMESPACE)
    return out


def remove(job: str) -> int:
    """Kill the job's keepers, freeing what they hold; returns how many."""
    import ray

    found = keepers(job)
    for actor in found.values():
        with contextlib.suppress(Exception):  # already dead with its node
            ray.kill(actor, no_restart=True)
    return len(found)
