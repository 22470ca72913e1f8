"""The memory tier: every few steps each rank's state goes to host memory on its node and a peer node.

Every `checkpoint.memory.every_steps` steps each rank takes the state a persistent checkpoint
would hold for it (DeepSpeed's own `save_checkpoint`, through `SnapshotEngine`: its module and
optimizer partitions, the LR scheduler, the client state with Tidal's `TrainState`) and copies
each tensor once, straight into one of its two slots on its node's keeper: shared-memory segments
the keeper owns and the rank keeps mapped (tidal.worker.checkpoint.segment), laid out with a
small record of where each tensor lies (tidal.worker.checkpoint.flat_state). That copy is all
training waits for: nothing is serialized but the record, nothing goes through Ray's object store.
Off the training thread the rank commits the slot and its record to the keeper, which sends the
next node's copy itself (tidal.worker.checkpoint.keeper, a ring over the group's nodes, at a low
CPU priority). Data positions and RNG need nothing more: a step's samples and its seed follow
from the step number (tidal.worker.data, `seed_step`); streamed data and pipelines are left to
storage (`supported`).

With `every_steps: auto` the interval chooses itself (tidal.worker.checkpoint.interval): a group
snapshots at its first two steps, which measure what a snapshot costs, then at Young/Daly's
interval for that cost, the step time and the faults its driver's groups met (rank 0's keeper
counts the groups), agreed by every rank at each snapshot's agreement, at most the persistent
checkpoint interval.

A snapshot is complete only when every rank's shard of the same attempt and step is held by a
live keeper. Before each snapshot every rank waits for its previous one to be held and the ranks
agree (one small collective) whether it is: only then do the keepers drop anything older, so
they hold the newest complete snapshot and the one being written, and a crash mid-snapshot leaves
the previous complete one. Memory snapshots never replace persistent checkpoints, which keep
their own cadence; a step is durable only once its checkpoint is complete in storage.

On a restart rank 0 reads every keeper's listing (`newest_complete`; `route.newest` says which
snapshot is complete), and the one resume decision (tidal.worker.checkpoint.restore, with
`route.from_memory`) takes the newest of that and the newest complete checkpoint in storage. At
the world size that wrote it each rank rebuilds the files it loads (its own partition, and the
model states, as from storage) from a keeper holding them: on its own node by mapping the
segment, from another node through that keeper (Ray's object store); a rank whose process wrote
its shard (a survivor re-formed in place, failure.replace_in_place) reads it from the slot it still
holds mapped (`OwnCopy`: no keeper asked, its stamp checked as the keeper's is). DeepSpeed's own loader
takes the rebuilt states as objects (`safe_load.safe_loading`'s `served`): nothing is read from
storage or disk, and nothing unpickled but each file's small structure. Each tensor is a copy: a
later snapshot reuses the segment. At another size (`staged`) a rank rebuilds the shards its new
partition comes from, serializes them as a checkpoint holds them, and loads them by byte range,
as a resize from storage does (tidal.worker.checkpoint.repartition), through a pyarrow filesystem
over memory.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import shutil
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tidal import test_hooks
from tidal.errors import CheckpointError
from tidal.spec.job import JobSpec
from tidal.storage import Found
from tidal.worker.checkpoint import (
    fetch,
    flat_state,
    held_files,
    interval,
    keeper,
    route,
    safe_load,
    segment,
)
from tidal.worker.checkpoint.host_buffers import Buffers
from tidal.worker.checkpoint.route import Held, Plan
from tidal.worker.checkpoint.snapshot import LIVE, SnapshotEngine, write_delay

log = logging.getLogger("tidal")

SNAPSHOT_TAG = "snapshot"  # the tag folder DeepSpeed's save names its files under (a snapshot's step is in its state)
CALL_TIMEOUT_S = 120.0  # a keeper that does not answer a put or a get within this is taken as lost
LIST_TIMEOUT_S = 10.0
# Fault injection for tests and benchmarks: seconds a rank's hand-over pauses before the keepers
# get its shard, so a kill lands mid-snapshot ("S@R:N": rank R's of step N; `snapshot.write_delay`).
DELAY_ENV = test_hooks.MEMORY_SNAPSHOT_DELAY
# And one pause inside a restore from memory ("MARKER@S": the first rank to load creates the file
# MARKER and waits S seconds before fetching; once MARKER exists no rank pauses), for a kill there.
LOAD_PAUSE_ENV = test_hooks.MEMORY_LOAD_PAUSE


def supported(spec: JobSpec) -> str | None:
    """Why the memory tier cannot serve this job (None: it can)."""
    if spec.data.streaming:
        return "a streamed source's position is saved as files beside a persistent checkpoint only"
    if spec.parallelism.pipeline_stages > 1:
        return "pipeline checkpoints are written per stage; they resume from storage"
    return None


@dataclass(frozen=True)
class OwnCopy:
    """A shard this process wrote into one of its slots, still mapped here: its stamp, its layout
    record, the map and its block. A surviving rank's rollback reads it with no keeper call."""

    stamp: int
    record: dict[str, Any]
    mm: Any
    block: torch.Tensor


# This process's own shards, by slot: outlive the Tier that wrote them, as the process outlives a
# group re-formed in place, so that its next session's restore finds them (`_own_copy`).
_own: dict[int, OwnCopy] = {}
# Where this process's last restore from memory read each shard, for the next Tier's line (`Tier.__init__`).
_restored: list[str] = []


@dataclass
class Pending:
    """This rank's snapshot being handed to the keepers."""

    step: int
    slot: int = 0  # which of this rank's two segments on its node holds it
    done: threading.Event = field(default_factory=threading.Event)  # its hand-over has ended
    error: str | None = None  # why its own node's keeper does not hold it
    peer_error: str | None = None  # why the peer's does not
    stall_s: float = 0.0  # training waited this long for it
    everyone: list[tuple[Any, ...]] | None = None  # what every rank said of it (`Tier._gathered`)
    hand_over_s: float = 0.0  # its hand-over ran this long beside training
    # Rank 0's: whether its events up to this step are in the job's log (waits a while for them)
    logged: Callable[[], bool] | None = None

    def join(self, timeout: float | None = None) -> bool:
        """Wait for its hand-over to end (False: `timeout` passed first)."""
        return self.done.wait(timeout)


class Tier:
    """One worker's side of the memory tier, opened once per worker group (a collective)."""

    def __init__(self, spec: JobSpec, rank: int, world: int, generation: int = 0, say: Any = None) -> None:
        """`generation`: the lease generation of this group's driver (tidal/lease.py), part of the
        keepers' owner: a newer driver of the job has keepers of its own. `say`: a line for the
        person watching (rank 0's), where this group's ranks restored from memory from."""
        import ray

        mem = spec.checkpoint.memory
        assert mem is not None
        self.spec, self.rank, self.world = spec, rank, world
        # `auto`: the interval follows the measured cost and the faults seen (tidal.worker.checkpoint.interval)
        self.auto = mem.every_steps == "auto"
        self.every = interval.FIRST_EVERY if mem.every_steps == "auto" else int(mem.every_steps)
        self.next_due: int | None = None  # auto: the step of the next snapshot (the group's first step first)
        self.step_s: float | None = None  # auto: this rank's recent step time
        self.ticked: float | None = None
        node = ray.get_runtime_context().get_node_id()
        gathered: list[Any] = [None] * world
        # where every rank runs (the ring of the group's nodes), and where its restore read from memory
        dist.all_gather_object(gathered, (node, restored_from()))
        nodes = [g[0] for g in gathered]
        if rank == 0 and say is not None and any(g[1] for g in gathered):
            say("restored from memory: " + "; ".join(f"rank {r} from {g[1]}" for r, g in enumerate(gathered) if g[1]))
        ring = sorted(set(nodes))
        self.node = node
        self.peer_node = ring[(ring.index(node) + 1) % len(ring)] if mem.peer and len(ring) > 1 else None
        limit = int(mem.max_gb * 2**30) if mem.max_gb is not None else None
        owner = keeper.Owner.of(spec, generation)
        self.own = keeper.handle(owner, node, limit)
        self.peer = keeper.handle(owner, self.peer_node, limit) if self.peer_node else None
        self.peer_name = keeper.name(owner, self.peer_node) if self.peer_node else None
        # The attempt's id, and under auto the faults this driver's groups have seen (rank 0's keeper counts them).
        seen = self._groups_seen() if self.auto and rank == 0 else (time.time(), 1)
        box = [(uuid.uuid4().hex[:12], *seen) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        self.attempt: str = box[0][0]
        self.faults, self.trained_since = int(box[0][2]) - 1, float(box[0][1])
        self.single_node = len(ring) == 1
        self.side = dist.new_group(backend="gloo")  # the hand-over threads' agreement: never the training's collectives
        self.fingerprint = spec.fingerprint_hash()  # once: its pydantic dump costs a snapshot milliseconds
        # DeepSpeed's few small files (a script) go to one folder for the tier's life, not one made and
        # removed per snapshot: under load each folder's creation and removal cost the stall milliseconds.
        self.root = Path(tempfile.mkdtemp(prefix="tidal-mem-"))
        weakref.finalize(self, shutil.rmtree, self.root, True)
        # One hand-over thread for the tier's life, fed each snapshot in turn: starting a thread per
        # snapshot had training wait, under load, for the new thread to be scheduled (`Thread.start`).
        self.handing: queue.Queue[tuple[Any, ...] | None] = queue.Queue()
        threading.Thread(name="tidal-memory-snapshot", daemon=True, target=_hand_overs,
                         args=(weakref.ref(self), self.handing)).start()
        # This rank's two slots on its node (a segment each, the keeper's), mapped here once: the
        # next snapshot goes to the one not holding the newest complete snapshot (`kept`).
        self.maps: list[tuple[segment.Ref, Any, torch.Tensor] | None] = [None, None]
        refs, self.kept = ray.get(self.own.slots_of.remote(rank), timeout=CALL_TIMEOUT_S)
        for i, ref in enumerate(refs):
            if ref is not None:
                with contextlib.suppress(OSError):
                    self.maps[i] = _slot(ref)
        self.pending: Pending | None = None
        self.complete: int | None = None  # the newest snapshot this group agreed is held by every rank
        self.said: set[str] = set()
        self.stall_s = 0.0  # seconds this rank's training waited for snapshots since `take_stall`

    def _groups_seen(self) -> tuple[float, int]:
        """(when this driver's first group started, how many have started) as this node's keeper saw them."""
        import ray

        try:
            first, groups = ray.get(self.own.group_started.remote(), timeout=LIST_TIMEOUT_S)
            return float(first), int(groups)
        except Exception as e:  # noqa: BLE001 - the prior alone then sets the interval
            log.info("memory tier: the keeper did not say how many groups started (%s)", type(e).__name__)
            return time.time(), 1

    def due(self, step: int) -> bool:
        if not self.auto:
            return step % self.every == 0
        now = time.perf_counter()
        if self.ticked is not None:  # the time between two calls: one step, a snapshot's stall included
            last = now - self.ticked
            self.step_s = last if self.step_s is None else 0.8 * self.step_s + 0.2 * last
        self.ticked = now
        if self.next_due is None:
            self.next_due = step  # the group's first step: a snapshot at once, which measures its cost
        return step >= self.next_due

    def take_stall(self) -> float:
        s, self.stall_s = self.stall_s, 0.0
        return s

    def snapshot(self, engine: Any, state: Any, written_by: Any, say: Any,
                 logged: Callable[[], bool] | None = None) -> None:
        """Snapshot this rank's state at `state.step` (all ranks together: a collective): DeepSpeed's
        own save hands over what it would write, each tensor is copied once straight into this
        rank's slot on its node's keeper (a shared-memory segment), and a small record of the
        layout is committed to the keeper off the training thread. `logged` (rank 0's): whether
        the job's event log holds every step up to this one; a snapshot it does not is never committed."""
        t0, cpu0 = time.perf_counter(), time.thread_time()
        self._agree_previous(say, state.step)
        step = state.step
        snap = SnapshotEngine(self.root, Buffers(), LIVE)  # the live state dicts: copied below, before training goes on
        saved_state = {**asdict(state), **asdict(written_by), "attempt": self.attempt}
        # One tag folder for every snapshot (its files' names, not their content, hold the tag): made once.
        _save_into(engine, snap, str(self.root), SNAPSHOT_TAG,
                   {"tidal": saved_state, "universal_checkpoint_info": {"universal_checkpoint_version": 0.4}})
        prefix = f"{SNAPSHOT_TAG}{os.sep}"
        planned = flat_state.plan({rel.removeprefix(prefix): st for rel, st in snap.taken.items()})
        facts = {"world_size": self.world, "zero_stage": int(written_by.zero_stage),
                 "fingerprint": self.fingerprint, "node": self.node,
                 "state": saved_state if self.rank == 0 else None}
        pending = Pending(step, slot=1 - self.kept if self.kept is not None else 0, logged=logged)
        pending.error = self._write(pending, planned)
        self.pending = pending
        pending.stall_s = time.perf_counter() - t0
        self.stall_s += pending.stall_s
        # What it cost this rank, in its keeper's listing: wall time, and the training thread's CPU
        # time (what a loaded machine's other work does not inflate; benchmarks.memory_tier reads it).
        facts["stall_s"], facts["stall_cpu_s"] = pending.stall_s, time.thread_time() - cpu0
        # Handed over whatever happened: every rank's hand-over ends in the same gather (on `side`).
        self.handing.put((pending, planned.record, facts, self.complete))

    def close(self, timeout: float | None = None) -> None:
        """End the tier's hand-over thread once the snapshot in flight is handed over (its keepers keep
        it): a group re-formed in place opens a tier of its own in the same process."""
        self.handing.put(None)
        if self.pending is not None:
            self.pending.join(timeout)

    def _write(self, pending: Pending, planned: flat_state.Planned) -> str | None:
        """Copy the planned state into this rank's slot `pending.slot` and stamp it; None, or why not
        (the node could not give the segment)."""
        import ray

        mapped = self.maps[pending.slot]
        if mapped is None or mapped[0].size < planned.total:
            self.maps[pending.slot] = None  # the old map goes before a larger segment is made
            _own.pop(pending.slot, None)
            try:
                ref = ray.get(self.own.make.remote(self.rank, pending.slot, planned.total), timeout=CALL_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - the keeper is gone or stuck: this shard is not held
                return f"this node's keeper failed: {type(e).__name__}: {str(e)[:200]}"
            if isinstance(ref, str):
                return ref
            mapped = self.maps[pending.slot] = _slot(ref)
        _, mm, block = mapped
        _own.pop(pending.slot, None)
        segment.write_stamp(mm, 0)  # torn until stamped again: neither listed nor served meanwhile
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # a copy is memory-bound: a second thread only fights training's other core
        try:
            flat_state.write(planned, block)
        finally:
            torch.set_num_threads(threads)
        stamped = segment.stamp(self.attempt, pending.step, self.rank)
        segment.write_stamp(mm, stamped)
        _own[pending.slot] = OwnCopy(stamped, planned.record, mm, block)
        return None

    def _agree_previous(self, say: Any, step: int) -> None:
        """Take what every rank agreed of this rank's previous snapshot: whether it is complete (held
        for every rank): only a complete one lets the keepers drop older ones, and the next snapshot
        goes into the other slot. The agreement ran in the previous hand-over, off the training
        thread (`_hand_over`); here it is joined, long done unless a rank's hand-over is slow. Under
        `auto`, every rank also takes the same next interval from what the ranks measured."""
        everyone: list[tuple[Any, ...]] = [(None, None, None, None, None, 0.0)] * self.world
        if self.pending is not None:
            self.pending.join()
            everyone = self.pending.everyone or everyone
        steps = {e[0] for e in everyone}
        if len(steps) == 1 and None not in steps and all(e[1] is None for e in everyone):
            self.complete = steps.pop()
            assert self.pending is not None
            self.kept = self.pending.slot  # kept until the next one is complete: the next goes to the other
        if self.auto:
            self._choose_interval(everyone, step, say)
        if self.rank == 0:
            for why in [e[1] for e in everyone if e[1]] + [e[2] for e in everyone if e[2]]:
                self._say_once(say, f"a memory snapshot was not kept ({why}); restarts resume from the previous "
                               "complete snapshot, or storage")
            if self.single_node and self.spec.checkpoint.memory.peer:
                self._say_once(say, "the memory tier has one node: its snapshots are lost with it (no peer copy)")

    def _gathered(self, mine: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        """Every rank's (step, error, peer error, cost, step time, time trained), on the tier's own gloo
        group (`side`, so that a hand-over thread's collective never meets the training's): the
        numbers in one all_gather of a small tensor, the reasons, rare, in a second gather only when
        a rank has one."""
        step, error, peer_error, cost, step_s, trained = mine
        nums = torch.tensor([math.nan if v is None else float(v) for v in (step, cost, step_s, trained)]
                            + [float(error is not None), float(peer_error is not None)], dtype=torch.float64)
        out = [torch.empty_like(nums) for _ in range(self.world)]
        dist.all_gather(out, nums, group=self.side)
        rows = [o.tolist() for o in out]
        texts: list[Any] = [(None, None)] * self.world
        if any(r[4] or r[5] for r in rows):
            dist.all_gather_object(texts, (error, peer_error), group=self.side)

        def num(v: float) -> float | None:
            return None if math.isnan(v) else v

        return [(None if math.isnan(r[0]) else int(r[0]), t[0], t[1], num(r[1]), num(r[2]), r[3])
                for r, t in zip(rows, texts, strict=True)]

    def _choose_interval(self, everyone: list[Any], step: int, say: Any) -> None:
        """The next snapshot's step, the same on every rank: the slowest rank's cost and step time."""
        costs, steps = [e[3] for e in everyone], [e[4] for e in everyone]
        cost = None if None in costs else max(costs)
        step_s = None if None in steps else max(steps)
        trained = max(0.0, everyone[0][5])  # rank 0's, so that every rank chooses the same
        self.every = interval.every_steps(cost, step_s, self.faults, trained, self.spec.checkpoint.every_steps)
        self.next_due = step + self.every
        if cost is not None and step_s is not None and self.rank == 0:
            self._say_once(say, f"memory snapshots every {self.every} step(s), chosen (checkpoint.memory.every_steps: "
                           f"auto) for a snapshot costing {cost:.2f}s, {step_s:.2f}s steps and a fault every "
                           f"{interval.mtbf_s(self.faults, trained) / 3600:.1f} h; the interval follows them")

    def _say_once(self, say: Any, line: str) -> None:
        key = line.split("(", 1)[0]
        if key not in self.said:
            self.said.add(key)
            say(line)

    def _hand_over(self, pending: Pending, record: dict[str, Any], facts: dict[str, Any],
                   prune_below: int | None) -> None:
        """Commit the written slot to this node's keeper, which then sends the peer's copy itself;
        then agree with every rank on what each holds (`_gathered`), off the training thread."""
        import ray

        t0 = time.perf_counter()
        try:
            if delay := write_delay(test_hooks.read(DELAY_ENV), self.rank, pending.step):
                time.sleep(delay)
            args = (self.attempt, pending.step, self.rank, pending.slot, facts, record, prune_below, self.peer_name)
            # A complete snapshot is a resume point: no step before it is trained again, so one whose
            # metrics were still in rank 0's process would lose them with it (as a checkpoint would: _save)
            if pending.error is None and pending.logged is not None and not pending.logged():
                pending.error = f"the job's event log did not yet hold every step up to {pending.step}"
            try:
                if pending.error is None:
                    pending.error = ray.get(self.own.commit.remote(*args), timeout=CALL_TIMEOUT_S)
                if self.peer_name is not None:  # copies sent for earlier snapshots that the peer did not keep
                    told = ray.get(self.own.take_forward_errors.remote(), timeout=CALL_TIMEOUT_S)
                    pending.peer_error = told[-1] if told else None
            except Exception as e:  # noqa: BLE001 - the keeper is gone or stuck: this shard is not held
                pending.error = f"this node's keeper failed: {type(e).__name__}: {str(e)[:200]}"
        except Exception as e:  # noqa: BLE001 - a snapshot that fails leaves the previous one
            pending.error = f"{type(e).__name__}: {str(e)[:200]}"
        pending.hand_over_s = time.perf_counter() - t0
        self._prepare_other(pending.slot, int(record["total"]))
        # The last field, the time trained, is rank 0's that every rank uses (`_choose_interval`).
        mine = (pending.step, pending.error, pending.peer_error, pending.stall_s + pending.hand_over_s,
                self.step_s, time.time() - self.trained_since)
        try:
            pending.everyone = self._gathered(mine)
        except Exception as e:  # noqa: BLE001 - a rank gone: the group ends; this snapshot counts for nothing
            log.info("memory tier: the snapshot agreement failed (%s: %s)", type(e).__name__, str(e)[:200])


    def _prepare_other(self, slot: int, size: int) -> None:
        """Have the keeper make this rank's other slot, never made yet, and map it here, off the
        training thread: the next snapshot, which goes there, then pays a copy, not the segment's
        allocation and page tables (about 1 s at 1 GB here). The training thread reads `maps` only
        after joining this thread."""
        import ray

        other = 1 - slot
        if self.maps[other] is not None:
            return
        try:
            ref = ray.get(self.own.make.remote(self.rank, other, size), timeout=CALL_TIMEOUT_S)
            if not isinstance(ref, str):
                self.maps[other] = _slot(ref)
        except Exception as e:  # noqa: BLE001 - the next snapshot makes it itself, or says why not
            log.info("memory tier: could not prepare the next slot (%s: %s)", type(e).__name__, str(e)[:200])


def _hand_overs(tier: Any, handing: queue.Queue[tuple[Any, ...] | None]) -> None:
    """A tier's hand-over thread: each snapshot's hand-over in turn, until the tier is closed or gone
    (`tier`: a weak reference, so that the thread never keeps a dropped tier and its maps alive)."""
    while (item := handing.get()) is not None:
        pending = item[0]
        try:
            if (owner := tier()) is None:
                return
            owner._hand_over(*item)
            del owner
        finally:
            pending.done.set()


def _slot(ref: segment.Ref) -> tuple[segment.Ref, Any, torch.Tensor]:
    """One of this rank's slots, mapped here: its reference, the map, and its data block as a tensor."""
    mm, block = segment.mapped(ref)
    return ref, mm, torch.from_numpy(block)


def _save_into(engine: Any, snap: SnapshotEngine, root: str, tag: str, client_state: dict[str, Any]) -> None:
    """What `engine.save_checkpoint` hands its checkpoint engine, handed to `snap`: the same files'
    states, by the same DeepSpeed calls, without the save's four collectives (two barriers and the
    tag check's two all-reduces, which order file writes this save does not make) and its `latest`
    file. Checked against DeepSpeed 0.19.8's `save_checkpoint`; a mixture-of-experts model takes the
    whole save, whose expert files are laid out another way."""
    before, engine.checkpoint_engine = engine.checkpoint_engine, snap
    # DeepSpeed's recovery script is a file for a checkpoint's folder, which a snapshot has not: its
    # copy (opening and writing a file on every snapshot) cost the stall milliseconds under load.
    engine._copy_recovery_script = _no_script
    try:
        if getattr(engine, "has_moe_layers", False):
            engine.save_checkpoint(root, tag=tag, client_state=client_state)
            return
        if engine._optimizer_has_ckpt_event_prologue():
            engine.optimizer.checkpoint_event_prologue()
        engine._save_checkpoint(root, tag, client_state=client_state)
        if engine.save_zero_checkpoint:
            engine._save_zero_checkpoint(root, tag)
        if engine._optimizer_has_ckpt_event_epilogue():
            engine.optimizer.checkpoint_event_epilogue()
    finally:
        engine.checkpoint_engine = before
        del engine._copy_recovery_script  # DeepSpeed's own again, for the persistent checkpoints


def _no_script(save_path: str) -> None:
    """No recovery script beside a snapshot (`_save_into`)."""


def newest_complete(spec: JobSpec, generation: int = 0) -> tuple[Held, Plan] | tuple[None, None]:
    """The newest snapshot every rank of which a live keeper of the job holds (rank 0, on restore):
    of this job's keepers only (its name, its storage, its driver's lease `generation`), so a
    snapshot of another job of the same name is never a candidate."""
    import ray

    held = keeper.keepers(keeper.Owner.of(spec, generation))
    calls = {n: h.listing.remote() for n, h in held.items()}
    listings: dict[str, list[dict[str, Any]]] = {}
    for name, call in calls.items():
        try:
            listings[name] = ray.get(call, timeout=LIST_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - a keeper whose node is gone: its copies are too
            log.info("memory tier: keeper %s did not answer (%s)", name, type(e).__name__)
    found, plan = route.newest(listings, spec.fingerprint_hash())
    if plan is not None:  # each keeper keeps its slot until the next group has a complete one of its own
        for name in listings:
            held[name].mark_complete.remote(plan.attempt, plan.step)
    return found, plan


def load(engine: Any, plan: Plan, dp_rank: int) -> dict[str, int]:
    """Load the snapshot `plan` into `engine` as saved: this rank's files rebuilt from the keepers'
    segments (mapped, on this node; fetched through the keeper from another), served to DeepSpeed's
    own loader as objects (`safe_load.safe_loading`'s `served`): nothing is unpickled but each file's
    small structure. Returns the bytes read per file."""
    _pause_for_tests()
    states, sizes = _states(plan, list(fetch.rank_files(plan.files(), dp_rank)))
    step_tag = f"global_step{plan.step}"
    folder = tempfile.mkdtemp(prefix="tidal-mem-load-")
    try:
        # DeepSpeed finds its checkpoint by listing the tag folder before it reads what is served.
        os.makedirs(os.path.join(folder, step_tag))
        for n in states:
            open(os.path.join(folder, step_tag, n), "wb").close()
        with safe_load.safe_loading(engine, served=states):
            load_path, _ = engine.load_checkpoint(folder, tag=step_tag, load_optimizer_states=True,
                                                  load_lr_scheduler_states=True)
        if load_path is None:
            raise CheckpointError(f"DeepSpeed found nothing to load in the in-memory snapshot of step {plan.step}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return sizes


@contextlib.contextmanager
def staged(plan: Plan, names: Iterable[str]) -> Iterator[Found]:
    """The files `names` of the snapshot `plan`, rebuilt from the keepers and written as a checkpoint
    of its step would hold them (torch.save, in memory), as a `Found` laid out as a checkpoint's
    (`<path>/global_stepN/<name>`, its `files` their sizes) that a by-range resize
    (tidal.worker.checkpoint.repartition) reads exactly as it reads storage: through a read-only
    pyarrow filesystem over those buffers (tidal.worker.checkpoint.held_files). Nothing is read from
    storage, and nothing is written to disk but what the resize itself writes."""
    _pause_for_tests()
    states, _ = _states(plan, sorted(set(names)))
    root, step_tag = f"memory-{plan.step}", f"global_step{plan.step}"
    got = {name: flat_state.to_bytes(st) for name, st in states.items()}
    held = held_files.filesystem({f"{root}/{step_tag}/{name}": data for name, data in got.items()})
    yield Found(root, held, plan.state, {f"{step_tag}/{name}": len(data) for name, data in got.items()})


class ShardLost(CheckpointError):
    """Every copy of a shard went while a restore read it: the snapshot may be sound, its copies are not."""


def unloadable(error: BaseException) -> bool:
    """Whether a failed load from memory says the snapshot itself does not load (DeepSpeed refused
    its states, a structure did not unpickle): then it is set aside (`set_aside`), or every restart
    would choose it again, fail again and spend the job's restarts. Not for a copy that went while
    it was read (a keeper or its node lost, a call timed out, a segment gone): the snapshot is kept,
    and the next restart lists what is still complete."""
    import ray

    return not isinstance(error, ShardLost | TimeoutError | ConnectionError | OSError | ray.exceptions.RayError)


def set_aside(plan: Plan) -> int:
    """Have every keeper holding a shard of `plan` list it no more; returns how many shards were set aside."""
    import ray

    calls = []
    for name in sorted({n for holders in plan.holders.values() for n in holders}):
        with contextlib.suppress(ValueError):  # a keeper gone with its node: nothing to set aside there
            calls.append(ray.get_actor(name, namespace=keeper.NAMESPACE).set_aside.remote(plan.attempt, plan.step))
    gone = 0
    for call in calls:
        with contextlib.suppress(Exception):
            gone += int(ray.get(call, timeout=LIST_TIMEOUT_S))
    return gone


def _states(plan: Plan, names: list[str]) -> tuple[dict[str, Any], dict[str, int]]:
    """The states of the files `names` of the snapshot `plan` (each tensor a copy, nothing aliasing a
    segment a later snapshot reuses) and their bytes, each from a keeper holding its shard, this
    node's first; CheckpointError if every copy of a shard went while it was being read."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    by_shard: dict[int, list[str]] = {}
    for n in names:
        by_shard.setdefault(next(r for r, files in plan.shards.items() if n in files), []).append(n)
    states: dict[str, Any] = {}
    sources: set[str] = set()
    for shard, wanted in sorted(by_shard.items()):
        if (own := _own_copy(plan, shard, wanted)) is not None:
            states.update(own)
            sources.add("its own copy")
            continue
        options = sorted(plan.holders[shard].items(), key=lambda kv: kv[1] != node)  # this node's keeper first
        for name, where in options:
            try:
                actor = ray.get_actor(name, namespace=keeper.NAMESPACE)
                got = (_mapped(actor, plan, shard, wanted) if where == node else _fetched(actor, plan, shard, wanted))
            except Exception as e:  # noqa: BLE001 - that keeper is gone: try the next copy
                log.info("memory tier: keeper %s failed (%s: %s)", name, type(e).__name__, str(e)[:200])
                continue
            if got is not None:
                states.update(got)
                sources.add("this node's keeper" if where == node else f"the keeper of node {where[:8]}")
                break
        else:
            raise ShardLost(f"the in-memory snapshot of step {plan.step} lost rank {shard}'s shard "
                                  "while it was being restored; the next attempt resumes from what is complete")
    _restored[:] = sorted(sources)
    return states, {n: plan.files()[n] for n in names}


def restored_from() -> str | None:
    """Where this process's last restore from memory read its shards ("its own copy", "this node's
    keeper", ...), once: None if it has not restored from memory since the last call."""
    said = " and ".join(_restored) or None
    _restored.clear()
    return said


def _own_copy(plan: Plan, shard: int, names: list[str]) -> dict[str, Any] | None:
    """The files `names` of `shard` of the snapshot `plan` from a slot this process wrote and still
    maps (a survivor's rollback): only where its stamp is the plan's (that attempt, step and rank),
    checked before and after the copy out, as a keeper's is; None sends the read to the keepers."""
    want = segment.stamp(plan.attempt, plan.step, shard)
    for own in list(_own.values()):
        try:
            if own.stamp != want or segment.read_stamp(own.mm) != want or not set(names) <= own.record["files"].keys():
                continue
            out = {n: flat_state.read(own.record, n, own.block) for n in names}
            if segment.read_stamp(own.mm) == want:
                return out
        except (ValueError, OSError):  # its map was closed: the keeper's copy serves
            continue
    return None


def _mapped(actor: Any, plan: Plan, shard: int, names: list[str]) -> dict[str, Any] | None:
    """The files `names` of a shard held on this node: its segment mapped, each tensor copied out,
    the stamp checked before and after (a slot reused meanwhile is not served)."""
    import ray

    found = ray.get(actor.where.remote(plan.attempt, plan.step, shard), timeout=CALL_TIMEOUT_S)
    if found is None:
        return None
    ref, record, stamp = found
    mm, block = segment.mapped(ref, populate=False)
    if segment.read_stamp(mm) != stamp:
        return None
    out = {n: flat_state.read(record, n, torch.from_numpy(block)) for n in names}
    return out if segment.read_stamp(mm) == stamp else None


def _fetched(actor: Any, plan: Plan, shard: int, names: list[str]) -> dict[str, Any] | None:
    """The files `names` of a shard held on another node, through its keeper (Ray's object store)."""
    import ray

    answer = ray.get(actor.get.remote(plan.attempt, plan.step, shard, names), timeout=CALL_TIMEOUT_S)
    if answer is None:
        return None
    record, [ref] = answer
    data = ray.get(ref, timeout=CALL_TIMEOUT_S)
    block = torch.frombuffer(bytearray(0), dtype=torch.uint8) if len(data) == 0 else torch.from_numpy(
        np.frombuffer(data, dtype=np.uint8).copy() if not data.flags.writeable else data)
    return {n: flat_state.read(record, n, block, base=int(record["base"])) for n in names}


def _pause_for_tests() -> None:
    """`LOAD_PAUSE_ENV`'s one pause, for a kill inside a restore from memory."""
    if pause := test_hooks.read(LOAD_PAUSE_ENV):
        marker, _, seconds = pause.rpartition("@")
        try:
            with open(marker, "x"):
                pass
            time.sleep(float(seconds))
        except FileExistsError:
            pass
