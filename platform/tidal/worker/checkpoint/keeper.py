"""The memory tier's keepers: one Ray actor per node per job that owns the shared memory ranks' snapshots live in.

A keeper is a detached actor pinned to its node (`NodeAffinitySchedulingStrategy(soft=False)`),
so it outlives the training workers. It owns two shared-memory segments per rank it keeps
(tidal.worker.checkpoint.segment), reused from snapshot to snapshot: a rank on its node copies its
state straight into one (the one copy training pays) and commits it with a small record of where
each tensor lies (tidal.worker.checkpoint.flat_state); the other slot keeps the newest complete
snapshot, so a crash mid-snapshot leaves it. Once it holds a rank's shard the keeper sends the
copy for the keeper of the next node of the group (a ring), one at a time, its threads at a low
CPU priority so its copies wait for spare cores: a worker's death leaves its node's copy, a node's
loss the peer's. A rank on the node restores by mapping the segment; one elsewhere fetches through
the keeper. A keeper lists what a rank committed until a rank says which snapshot is complete
(`prune_below`): then only that one and newer ones are listed. It never decides completeness:
rank 0 does, from every keeper's listing (tidal.worker.checkpoint.route.newest).

A cluster is shared, so a keeper is named for its job's identity (`Owner`): the job's name, its
storage (two jobs of one name on two storages are two jobs) and the lease generation of the
driver that runs it (tidal/lease.py), then the node. A job's restore lists only its own keepers,
so a snapshot is never loaded into another job. Only the lease holder ends keepers (`remove`):
those of its generation and older ones left by earlier drivers, never a newer driver's. A keeper
ends itself once nothing has touched it for its expiry (`heartbeat`, the driver's; a put counts
too): a dead driver's keepers free their node's memory (their segments end with their process).
Four calls may run at once (a snapshot's commits, a restore's listing and gets), so its slot table
is locked. Only Ray's public API is
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

from tidal.worker.checkpoint import segment

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


@dataclass
class Slot:
    """One of a rank's two segments on this node, and the snapshot it holds (None: nothing listed)."""

    fd: int
    size: int
    mm: Any
    block: Any
    held: tuple[str, int] | None = None  # (attempt, step)
    facts: dict[str, Any] | None = None
    record: dict[str, Any] | None = None
    stamp: int = 0


class Keeper:
    """Holds shards of snapshots in shared-memory segments it owns (tidal.worker.checkpoint.segment):
    two slots per rank whose snapshots it keeps, each reused from snapshot to snapshot, so the newest
    complete one survives a crash while the next is written into the other. A rank on this node
    writes its slot itself (one copy) and `commit`s it; a peer copy arrives as the block (`put`).
    Run as a Ray actor (`handle`)."""

    def __init__(self, job: str, node_id: str, limit_bytes: int | None, expiry_s: float | None = None) -> None:
        total = segment.total_memory()
        self.job, self.node_id = job, node_id
        self.limit = limit_bytes if limit_bytes is not None else int(total * DEFAULT_SHARE)
        self.reserve = int(total * RESERVE_SHARE)
        self.slots: dict[int, list[Slot | None]] = {}  # rank -> its two slots
        self.complete: tuple[str, int] | None = None  # the newest snapshot a rank or a restore said is complete
        self.attempt: str | None = None  # the attempt (worker group) whose ranks here committed last
        self.lock = threading.Lock()  # the slot table: four calls run at once
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
        holds would otherwise stay in the node's memory until the same job ran again (its segments
        go with its process)."""
        while time.monotonic() - self.seen < expiry_s:
            time.sleep(min(expiry_s / 4, 5.0))
        log.warning("memory tier: keeper %s on node %s untouched for %.0fs, ending itself", self.job,
                    self.node_id[:8], expiry_s)
        os._exit(0)  # a detached actor with max_restarts=0: Ray frees its name, the kernel its segments

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
        return sum(s.size for slots in self.slots.values() for s in slots if s is not None)

    def pid(self) -> int:
        return os.getpid()

    def slots_of(self, rank: int) -> tuple[list[segment.Ref | None], int | None]:
        """`rank`'s two segments (None: not made yet) and which of them holds the newest snapshot
        known complete (a rank of a new group must not write there before it has one of its own)."""
        with self.lock:
            slots = self.slots.get(rank, [None, None])
            return [None if s is None else segment.Ref(os.getpid(), s.fd, s.size) for s in slots], self._kept(rank)

    def _kept(self, rank: int) -> int | None:
        """The slot of `rank` to keep: the newest complete snapshot's, else the newest held."""
        slots = self.slots.get(rank, [None, None])
        held = [(i, s) for i, s in enumerate(slots) if s is not None and s.held is not None and self._intact(s)]
        for i, s in held:
            if s.held == self.complete:
                return i
        return max(held, key=lambda x: x[1].held[1])[0] if held else None  # type: ignore[index]

    def make(self, rank: int, index: int, size: int) -> segment.Ref | str:
        """A segment of at least `size` bytes for `rank`'s slot `index` (a new one if it is smaller),
        or why the node cannot give it (its memory limit or its free memory, naming the setting)."""
        with self.lock:
            slots = self.slots.setdefault(rank, [None, None])
            old = slots[index]
            if old is not None and old.size >= size:
                return segment.Ref(os.getpid(), old.fd, old.size)
            held = self._held() - (old.size if old is not None else 0)
            if (why := segment.room(size, held, self.limit, self.reserve)) is not None:
                return f"node {self.node_id[:8]}: {why}"
            slots[index] = None
            if old is not None:
                self._drop(old)
            try:
                fd = segment.create(size, f"tidal-{self.job}-{rank}-{index}")
            except segment.NoRoom as e:
                return f"node {self.node_id[:8]}: {e}; lower checkpoint.memory.max_gb or give the node more memory"
            mm, block = segment.map_fd(fd, size)
            slots[index] = Slot(fd, size, mm, block)
            return segment.Ref(os.getpid(), fd, size)

    @staticmethod
    def _drop(slot: Slot) -> None:
        slot.block = None
        segment.close_quietly(slot.mm)
        with contextlib.suppress(OSError):
            os.close(slot.fd)

    @staticmethod
    def _intact(slot: Slot) -> bool:
        return slot.held is not None and segment.read_stamp(slot.mm) == slot.stamp

    def commit(self, attempt: str, step: int, rank: int, index: int, facts: dict[str, Any], record: dict[str, Any],
               prune_below: int | None = None, forward: str | None = None) -> str | None:
        """A rank on this node wrote its shard of the snapshot of `step` into its slot `index` (and
        stamped it): hold it, first dropping from the listing every snapshot older than `prune_below`
        (the newest one known complete). Returns None, or why it is not held. `forward`: the peer
        keeper's name, to which this keeper then sends the block, after its own, one at a time and
        at a low CPU priority: the rank's hand-over waits for nothing but this call."""
        _yield_to_training()
        self.touch()
        with self.lock:
            self._prune(attempt, prune_below)
            slot = self.slots.get(rank, [None, None])[index]
            expected = segment.stamp(attempt, step, rank)
            if slot is None or segment.read_stamp(slot.mm) != expected or int(record["total"]) > slot.size:
                return f"the snapshot of step {step} was not found whole in its segment on node {self.node_id[:8]}"
            slot.held, slot.facts, slot.record, slot.stamp = (attempt, step), {**facts, "held_on": self.node_id}, record, expected
            self.attempt = attempt
        if forward:
            self.forwards.put((forward, (attempt, step, rank, index, prune_below)))
        return None

    def _prune(self, attempt: str, prune_below: int | None) -> None:
        if prune_below is None:
            return
        self.complete = (attempt, prune_below)
        for slots in self.slots.values():
            for s in slots:
                if s is not None and s.held is not None and s.held[1] < prune_below:
                    s.held = None

    def mark_complete(self, attempt: str, step: int) -> None:
        """A restore found this snapshot complete: the slot a new group keeps until it has its own."""
        with self.lock:
            self.complete = (attempt, step)

    def set_aside(self, attempt: str, step: int) -> int:
        """A rank failed to load this snapshot for a reason in the snapshot itself: it is listed no
        more (the next restart resumes from the next-newest complete one, or storage), its slots are
        reused. Returns how many shards were set aside here."""
        with self.lock:
            if self.complete == (attempt, step):
                self.complete = None
            gone = [s for slots in self.slots.values() for s in slots if s is not None and s.held == (attempt, step)]
            for s in gone:
                s.held = None
            return len(gone)

    def put(self, attempt: str, step: int, rank: int, facts: dict[str, Any], record: dict[str, Any],
            block: list[Any], prune_below: int | None = None) -> str | None:
        """Keep a peer node's rank's shard (its `record` and its block, `[a reference or the array]`):
        copied into a slot of this keeper's, not the one holding that rank's newest complete snapshot."""
        import numpy as np
        import ray

        _yield_to_training()
        self.touch()
        if self.attempt is not None and attempt != self.attempt:
            # An earlier group's copy that arrived after this node's ranks of a newer one committed:
            # its rank may now live here and write the same slot.
            return f"a copy of an earlier attempt's snapshot of step {step}, not kept"
        data = block[0]
        if isinstance(data, ray.ObjectRef):
            data = ray.get(data, timeout=FORWARD_TIMEOUT_S)
        size = int(record["total"])
        with self.lock:
            self._prune(attempt, prune_below)
            index = 1 - self._kept(rank) if self._kept(rank) is not None else 0
            slot = self.slots.get(rank, [None, None])[index]
            if slot is not None:
                slot.held = None
        made = self.make(rank, index, size)
        if isinstance(made, str):
            return made
        with self.lock:
            slot = self.slots[rank][index]
            assert slot is not None
            segment.write_stamp(slot.mm, 0)
            slot.block[:size] = np.frombuffer(data, dtype=np.uint8, count=size)
            slot.stamp = segment.stamp(attempt, step, rank)
            segment.write_stamp(slot.mm, slot.stamp)
            slot.held, slot.facts, slot.record = (attempt, step), {**facts, "held_on": self.node_id}, record
        return None

    def take_forward_errors(self) -> list[str]:
        """Why the peer copies sent since the last call were not kept (said by the rank, once)."""
        with self.lock:
            errors, self.forward_errors = self.forward_errors, []
        return errors

    def _send_forwards(self) -> None:
        """Send the peer copies queued by `commit`, one at a time: the slot's block into Ray's object
        store (one copy, here, at a low priority), checked still whole after, then to the peer."""

        _yield_to_training()
        while True:
            peer, (attempt, step, rank, index, prune_below) = self.forwards.get()
            try:
                why = self._forward(peer, attempt, step, rank, index, prune_below)
            except Exception as e:  # noqa: BLE001 - the peer is gone
                why = f"the peer node's keeper failed: {type(e).__name__}: {str(e)[:200]}"
            if why is not None:
                with self.lock:
                    self.forward_errors.append(why)

    def _forward(self, peer: str, attempt: str, step: int, rank: int, index: int, prune_below: int | None) -> str | None:
        import ray

        with self.lock:
            slot = self.slots.get(rank, [None, None])[index]
            if slot is None or slot.held != (attempt, step) or not self._intact(slot):
                return None  # overwritten by a newer snapshot already: that one is sent instead
            facts, record, view = slot.facts, slot.record, slot.block[:int(slot.record["total"])]
        ref = ray.put(view)
        if segment.read_stamp(slot.mm) != segment.stamp(attempt, step, rank):
            return None  # the slot was reused while it was copied: this copy is torn, not sent
        facts = {k: v for k, v in (facts or {}).items() if k != "held_on"}
        return ray.get(ray.get_actor(peer, namespace=NAMESPACE).put.remote(
            attempt, step, rank, facts, record, [ref], prune_below), timeout=FORWARD_TIMEOUT_S)

    def listing(self) -> list[dict[str, Any]]:
        """Every shard held whole: its key, facts and file sizes (no bytes)."""
        with self.lock:
            held = [(r, s) for r, slots in self.slots.items() for s in slots if s is not None and self._intact(s)]
            return [{"attempt": s.held[0], "step": s.held[1], "rank": r, **(s.facts or {}),  # type: ignore[index]
                     "sizes": {n: int(f["end"]) - int(f["start"]) for n, f in (s.record or {"files": {}})["files"].items()}} for r, s in held]

    def where(self, attempt: str, step: int, rank: int) -> tuple[segment.Ref, dict[str, Any], int] | None:
        """Where a rank on this node maps a shard: its segment, its record and its stamp (None: not held)."""
        with self.lock:
            for s in self.slots.get(rank, []):
                if s is not None and s.held == (attempt, step) and self._intact(s):
                    return segment.Ref(os.getpid(), s.fd, s.size), s.record or {}, s.stamp
        return None

    def get(self, attempt: str, step: int, rank: int, names: list[str]) -> tuple[dict[str, Any], list[Any]] | None:
        """For a rank on another node: the shard's record and, in a list, a reference to the bytes of
        the files `names` (one range of the block, copied once into Ray's object store and checked
        whole after), or None if it is not held (any more)."""
        import ray

        with self.lock:
            slot = next((s for s in self.slots.get(rank, []) if s is not None and s.held == (attempt, step)
                         and self._intact(s)), None)
            if slot is None or any(n not in (slot.record or {})["files"] for n in names):
                return None
            files = slot.record["files"]  # type: ignore[index]
            start, end = min(files[n]["start"] for n in names), max(files[n]["end"] for n in names)
            view, expected = slot.block[start:end], slot.stamp
        ref = ray.put(view)
        if segment.read_stamp(slot.mm) != expected:
            return None
        return {**slot.record, "base": start}, [ref]  # type: ignore[dict-item]

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {"node_id": self.node_id, "bytes": self._held(),
                    "shards": sum(1 for slots in self.slots.values() for s in slots if s is not None and s.held),
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
