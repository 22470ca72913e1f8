"""The memory tier's keepers: one Ray actor per node per job that holds ranks' snapshots in host memory.

A keeper is a detached actor pinned to its node (`NodeAffinitySchedulingStrategy(soft=False)`),
so it outlives the training workers: a worker's own objects die with it, a keeper's copies do not
(it keeps them in its own heap, not as references to a worker's objects). Each rank hands its
shard of a snapshot to its node's keeper, which sends the copy for the keeper of the next node of
the group (a ring) once it holds its own, one at a time, its threads at a low CPU priority so its
copies wait for spare cores: a worker's death leaves its node's copy, a node's loss the peer's. A keeper keeps what it
was given until a rank tells it which snapshot is complete (`prune_below`): then only that one
and newer ones stay (the newest complete one and the one being written). It never decides
completeness: rank 0 does, from every keeper's listing (tidal.worker.checkpoint.route.newest).

A cluster is shared, so a keeper is named for its job's identity (`Owner`): the job's name, its
storage (two jobs of one name on two storages are two jobs) and the lease generation of the
driver that runs it (tidal/lease.py), then the node. A job's restore lists only its own keepers,
so a snapshot is never loaded into another job. Only the lease holder ends keepers (`remove`):
those of its generation and older ones left by earlier drivers, never a newer driver's. A keeper
ends itself once nothing has touched it for its expiry (`heartbeat`, the driver's; a put counts
too): a dead driver's keepers free their node's memory. Four calls may run at once (a snapshot's
puts, a restore's listing and gets), so its shard table is locked. Only Ray's public API is
used here, and no torch: the driver imports this module.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("tidal")

NAMESPACE = "tidal-memory"
PREFIX = "tidal-keeper"
DEFAULT_SHARE = 0.5  # of the node's memory a keeper may hold when checkpoint.memory.max_gb is unset
RESERVE_SHARE = 0.1  # a put is refused when it would leave less than this share of the node's memory free
EXPIRY_S = 120.0  # a keeper nothing touched for this long ends itself (its driver is gone)
HEARTBEAT_S = 15.0  # how often a driver touches its keepers: well inside their expiry
KEEPER_NICE = 10  # a keeper's copying threads run this much below the training processes
FORWARD_TIMEOUT_S = 120.0  # a peer that does not keep a forwarded copy within this is taken as lost


@dataclass(frozen=True)
class Owner:
    """The job a keeper serves: its name, its storage (a digest: a URI may carry a credential, and
    an actor's name is visible to all) and its driver's lease generation."""

    job: str
    storage: str
    generation: int

    @classmethod
    def of(cls, spec: Any, generation: int) -> Owner:
        """The owner of `spec`'s keepers (a resolved spec: its storage absolute) under the lease
        `generation` (0: a group run without a lease)."""
        from tidal.redact import redact_uri

        # The user-info's name stays: in abfs://CONTAINER@ACCOUNT.dfs... it tells two storages apart.
        storage = redact_uri(spec.checkpoint.storage, lone_user=True).rstrip("/")
        return cls(spec.name, hashlib.sha256(storage.encode()).hexdigest()[:12], int(generation))


def name(owner: Owner, node_id: str) -> str:
    return f"{PREFIX}:{owner.job}:{owner.storage}:{owner.generation}:{node_id}"


def owner_of(actor_name: str) -> Owner | None:
    """The owner a keeper's name belongs to (None: not a keeper's name)."""
    head, _, rest = actor_name.partition(":")
    parts = rest.rsplit(":", 3)
    if head != PREFIX or len(parts) != 4 or not parts[2].isdigit():
        return None
    return Owner(parts[0], parts[1], int(parts[2]))


class Keeper:
    """Holds shards of snapshots: (attempt, step, rank) -> the shard's files (name -> bytes) and
    its facts (world size, node of the rank, fingerprint...). Run as a Ray actor (`handle`)."""

    def __init__(self, job: str, node_id: str, limit_bytes: int | None, expiry_s: float | None = None) -> None:
        import psutil

        self.job, self.node_id = job, node_id
        total = psutil.virtual_memory().total
        self.limit = limit_bytes if limit_bytes is not None else int(total * DEFAULT_SHARE)
        self.reserve = int(total * RESERVE_SHARE)
        self.shards: dict[tuple[str, int, int], tuple[dict[str, Any], dict[str, bytes]]] = {}
        self.incoming = 0  # bytes of puts admitted under the limit and still being copied in
        self.lock = threading.Lock()  # the shard table and `incoming`: four calls run at once
        self.touched = time.time()
        self.seen = time.monotonic()  # the expiry's clock: a wall clock stepped forward would end a live job's keeper
        self.groups, self.first_group = 0, self.touched  # worker groups of this driver opened on this node
        self.forwards: queue.Queue[tuple[str, tuple[Any, ...]]] = queue.Queue()  # peer copies to send, in order
        self.forward_errors: list[str] = []  # why peer copies were not kept, until a rank asks
        threading.Thread(target=self._send_forwards, daemon=True, name="tidal-keeper-forward").start()
        if expiry_s is not None:
            threading.Thread(target=self._expire, args=(expiry_s,), daemon=True, name="tidal-keeper-expiry").start()

    def touch(self) -> None:
        """A driver of the job is alive (`heartbeat`)."""
        self.touched, self.seen = time.time(), time.monotonic()

    def _expire(self, expiry_s: float) -> None:
        """End this actor once nothing has touched it for `expiry_s`: its driver is gone, and what it
        holds would otherwise stay in the node's memory until the same job ran again."""
        while time.monotonic() - self.seen < expiry_s:
            time.sleep(min(expiry_s / 4, 5.0))
        log.warning("memory tier: keeper %s on node %s untouched for %.0fs, ending itself", self.job,
                    self.node_id[:8], expiry_s)
        os._exit(0)  # a detached actor with max_restarts=0: Ray frees its name and memory

    def group_started(self) -> tuple[float, int]:
        """A worker group of this driver opened its memory tier (rank 0's node): (when the first did,
        how many have), the faults its snapshot interval allows for (tidal.worker.checkpoint.interval)."""
        with self.lock:
            self.groups += 1
            return self.first_group, self.groups

    def held_bytes(self) -> int:
        with self.lock:
            return self._held()

    def _held(self) -> int:
        return self.incoming + sum(len(b) for _, files in self.shards.values() for b in files.values())

    def put(self, attempt: str, step: int, rank: int, facts: dict[str, Any], files: dict[str, Any],
            prune_below: int | None = None, forward: list[Any] | None = None) -> str | None:
        """Keep one rank's shard of the snapshot of `step` (`files`: name -> bytes, or a numpy uint8
        view of them); first drop every shard older than `prune_below` (the newest snapshot known
        complete). Returns None, or why it was refused (the memory limit): the previous complete
        snapshot then stays the resume point. `forward`: [the peer keeper's name, a reference to
        `files` in Ray's object store]: this keeper sends the peer's copy, after its own, one at a
        time and at a low CPU priority, so the rank's hand-over waits for its own node's copy only."""
        _yield_to_training()
        why = self._keep(attempt, step, rank, facts, files, prune_below)
        if forward:
            self.forwards.put((forward[0], (attempt, step, rank, facts, forward[1], prune_below)))
        return why

    def take_forward_errors(self) -> list[str]:
        """Why the peer copies sent since the last call were not kept (said by the rank, once)."""
        with self.lock:
            errors, self.forward_errors = self.forward_errors, []
        return errors

    def _send_forwards(self) -> None:
        """Send the peer copies queued by `put`, one at a time: a reference, so the peer's raylet pulls
        the rank's object (no copy here); the peer keeps its own bytes, as for a rank's put."""
        import ray

        _yield_to_training()
        while True:
            peer, args = self.forwards.get()
            try:
                why = ray.get(ray.get_actor(peer, namespace=NAMESPACE).put.remote(*args), timeout=FORWARD_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - the peer (or the rank owning the object) is gone
                why = f"the peer node's keeper failed: {type(e).__name__}: {str(e)[:200]}"
            if why is not None:
                with self.lock:
                    self.forward_errors.append(why)

    def _keep(self, attempt: str, step: int, rank: int, facts: dict[str, Any], files: dict[str, Any],
              prune_below: int | None) -> str | None:
        import psutil

        self.touched, self.seen = time.time(), time.monotonic()
        size = sum(len(b) for b in files.values())
        with self.lock:  # admitted under the limit as one step: two puts never both fit in one gap
            if prune_below is not None:
                for key in [k for k in self.shards if k[1] < prune_below]:
                    del self.shards[key]
            self.shards.pop((attempt, step, rank), None)  # a retry of the same shard replaces it
            if self._held() + size > self.limit:
                return (f"the keeper on node {self.node_id[:8]} would hold {(self._held() + size) / 2**30:.2f} GiB, "
                        f"over its limit of {self.limit / 2**30:.2f} GiB (checkpoint.memory.max_gb)")
            if psutil.virtual_memory().available - size < self.reserve:
                return (f"node {self.node_id[:8]} has {psutil.virtual_memory().available / 2**30:.2f} GiB free, too "
                        f"little for a {size / 2**30:.2f} GiB shard and the {self.reserve / 2**30:.2f} GiB kept free")
            self.incoming += size
        try:  # the copy outside the lock: a restore's gets go on while a snapshot lands
            # Bytes of its own: a worker's numpy views are Ray's object-store copy, freed after this call.
            owned = {n: b if isinstance(b, bytes) else bytes(b) for n, b in files.items()}
        finally:
            with self.lock:
                self.incoming -= size
        with self.lock:
            self.shards[(attempt, step, rank)] = ({**facts, "held_on": self.node_id}, owned)
        return None

    def listing(self) -> list[dict[str, Any]]:
        """Every shard held: its key, facts and file sizes (no bytes)."""
        with self.lock:
            held = list(self.shards.items())
        return [{"attempt": a, "step": s, "rank": r, **facts, "sizes": {n: len(b) for n, b in files.items()}}
                for (a, s, r), (facts, files) in held]

    def get(self, attempt: str, step: int, rank: int, names: list[str]) -> dict[str, Any] | None:
        """The files `names` of a shard (each a numpy uint8 view of the bytes held), or None if it is
        not held (any more). As numpy arrays, Ray copies them once into its object store and the
        caller reads them there without a copy; as bytes they were pickled and unpickled whole."""
        import numpy as np

        with self.lock:
            shard = self.shards.get((attempt, step, rank))
        if shard is None or any(n not in shard[1] for n in names):
            return None
        return {n: np.frombuffer(shard[1][n], dtype=np.uint8) for n in names}

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {"node_id": self.node_id, "bytes": self._held(), "shards": len(self.shards),
                    "limit": self.limit, "touched": self.touched}


_LOWERED = threading.local()


def _yield_to_training() -> None:
    """Run this thread of the keeper at a low CPU priority (Linux: niceness is per thread), once: its
    copies wait for spare cores instead of taking them from the training processes beside it. Only
    the actor's own threads (its calls run on a pool beside the main thread): a process that holds a
    Keeper directly (a test) keeps its priority."""
    if threading.current_thread() is not threading.main_thread() and not getattr(_LOWERED, "done", False):
        _LOWERED.done = True
        with contextlib.suppress(OSError):
            os.nice(KEEPER_NICE)


def handle(owner: Owner, node_id: str, limit_bytes: int | None, expiry_s: float = EXPIRY_S) -> Any:
    """The keeper of `owner` on `node_id`, started there if it is not running yet; it ends itself
    once nothing has touched it for `expiry_s`."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor = ray.remote(Keeper).options(
        name=name(owner, node_id), namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0,
        max_restarts=0, max_concurrency=4,  # a restore's gets go on while a snapshot's put lands
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
    return actor.remote(owner.job, node_id, limit_bytes, expiry_s)


def keepers(owner: Owner) -> dict[str, Any]:
    """The live keepers of `owner` (this job, this storage, this driver's generation): actor name ->
    handle (a keeper whose node is gone is not listed, or fails when asked: callers skip those)."""
    return _found(lambda o: o == owner)


def named(job: str) -> dict[str, Any]:
    """Every live keeper of a job of this name, on any storage, of any driver (what a person
    looking for leftovers, or a test, asks)."""
    return _found(lambda o: o.job == job)


def _found(wanted: Any) -> dict[str, Any]:
    import ray

    out = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        owner = owner_of(entry.get("name", ""))
        if entry.get("namespace") != NAMESPACE or owner is None or not wanted(owner):
            continue
        with contextlib.suppress(ValueError):  # gone between the listing and the lookup
            out[entry["name"]] = ray.get_actor(entry["name"], namespace=NAMESPACE)
    return out


def remove(owner: Owner) -> int:
    """Kill the keepers of `owner`'s job and storage of its generation or older (an earlier driver's,
    which could not end its own), freeing what they hold; returns how many. Only the lease holder
    calls this: a newer driver's keepers (a higher generation) are never touched."""
    import ray

    found = _found(lambda o: (o.job, o.storage) == (owner.job, owner.storage) and o.generation <= owner.generation)
    for actor in found.values():
        with contextlib.suppress(Exception):  # already dead with its node
            ray.kill(actor, no_restart=True)
    return len(found)


@contextlib.contextmanager
def heartbeat(owner: Owner, every_s: float = HEARTBEAT_S) -> Iterator[None]:
    """While the block runs (a driver's job), touch `owner`'s keepers every `every_s` so that they
    do not expire; a driver that dies stops touching them and they end themselves."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(every_s):
            try:
                for actor in keepers(owner).values():
                    actor.touch.remote()  # not awaited: a keeper gone with its node is simply not touched
            except Exception as e:  # noqa: BLE001 - Ray unreachable for a moment: the next beat retries
                log.debug("memory tier: could not touch the keepers (%s: %s)", type(e).__name__, e)

    thread = threading.Thread(target=beat, daemon=True, name="tidal-keeper-heartbeat")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)
