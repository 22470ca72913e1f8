"""The memory tier: every few steps each rank's state goes to host memory on its node and a peer node.

Every `checkpoint.memory.every_steps` steps each rank takes the state a persistent checkpoint
would hold for it (DeepSpeed's own `save_checkpoint` into `SnapshotEngine`'s reused host buffers:
its module and optimizer partitions, the LR scheduler, the client state with Tidal's
`TrainState`), and, off the training thread, serializes each file as the persistent write would
(`torch.save`) and hands the bytes to its node's keeper, which sends the next node's copy
(tidal.worker.checkpoint.keeper, a ring over the group's nodes). Data positions and RNG need
nothing more: a step's samples and its seed follow from the step number (tidal.worker.data,
`seed_step`); streamed data and pipelines are left to storage (`supported`).

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
the world size that wrote it each rank fetches the files it loads (its own partition, and the
model states, as from storage) from a keeper, its own node's first, and DeepSpeed loads the very
bytes a persistent checkpoint of that step holds, served from memory (`safe_load.safe_loading`'s
`served`): nothing is read from storage or disk. At another size (`staged`) a rank fetches the
shards its new partition comes from and loads them by byte range, as a resize from storage does
(tidal.worker.checkpoint.repartition), reading them from memory through a pyarrow filesystem.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tidal import gil, test_hooks
from tidal.errors import CheckpointError
from tidal.spec.job import JobSpec
from tidal.storage import Found
from tidal.worker.checkpoint import fetch, held_files, interval, keeper, route, safe_load
from tidal.worker.checkpoint.host_buffers import Buffers
from tidal.worker.checkpoint.route import Held, Plan
from tidal.worker.checkpoint.snapshot import COPY, SnapshotEngine, _without_crc32, write_delay

log = logging.getLogger("tidal")

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


@dataclass
class Pending:
    """This rank's snapshot being handed to the keepers."""

    step: int
    thread: threading.Thread | None = None
    error: str | None = None  # why its own node's keeper does not hold it
    peer_error: str | None = None  # why the peer's does not
    stall_s: float = 0.0  # training waited this long for it
    hand_over_s: float = 0.0  # its hand-over ran this long beside training


class Tier:
    """One worker's side of the memory tier, opened once per worker group (a collective)."""

    def __init__(self, spec: JobSpec, rank: int, world: int, generation: int = 0) -> None:
        """`generation`: the lease generation of this group's driver (tidal/lease.py), part of the
        keepers' owner: a newer driver of the job has keepers of its own."""
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
        nodes: list[Any] = [None] * world
        dist.all_gather_object(nodes, node)  # where every rank runs: the ring of the group's nodes
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
        self.buffers = Buffers()
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

    def snapshot(self, engine: Any, state: Any, written_by: Any, say: Any) -> None:
        """Snapshot this rank's state at `state.step` (all ranks together: a collective)."""
        t0 = time.perf_counter()
        self._agree_previous(say, state.step)
        step = state.step
        root = Path(tempfile.mkdtemp(prefix="tidal-mem-"))  # DeepSpeed's few small files (latest, a script)
        snap = SnapshotEngine(root, self.buffers, COPY)
        saved_state = {**asdict(state), **asdict(written_by), "attempt": self.attempt}
        before, engine.checkpoint_engine = engine.checkpoint_engine, snap
        try:
            engine.save_checkpoint(str(root), tag=f"global_step{step}",
                                   client_state={"tidal": saved_state,
                                                 "universal_checkpoint_info": {"universal_checkpoint_version": 0.4}})
        finally:
            engine.checkpoint_engine = before
            shutil.rmtree(root, ignore_errors=True)
        zipfile = getattr(engine.checkpoint_engine, "zipfile_serialization", True)
        prefix = f"global_step{step}{os.sep}"
        taken = {rel.removeprefix(prefix): st for rel, st in snap.taken.items()}
        facts = {"world_size": self.world, "zero_stage": int(written_by.zero_stage),
                 "fingerprint": self.spec.fingerprint_hash(), "node": self.node,
                 "state": saved_state if self.rank == 0 else None}
        pending = Pending(step)
        pending.thread = threading.Thread(name="tidal-memory-snapshot", daemon=True,
                                          target=self._hand_over, args=(pending, taken, zipfile, facts, self.complete))
        self.pending = pending
        pending.thread.start()
        pending.stall_s = time.perf_counter() - t0
        self.stall_s += pending.stall_s

    def _agree_previous(self, say: Any, step: int) -> None:
        """Wait for this rank's previous snapshot to be held, then agree with every rank whether
        it is complete (held for every rank): only a complete one lets the keepers drop older ones.
        Under `auto`, every rank also takes the same next interval from what the ranks measured."""
        # The last field, the time trained, is rank 0's that every rank uses: each rank's own clock
        # could round the chosen interval differently, and ranks snapshotting at different steps
        # would meet in mismatched collectives.
        trained = time.time() - self.trained_since
        mine: tuple[Any, ...] = (None, None, None, None, self.step_s, trained)
        if self.pending is not None and self.pending.thread is not None:
            self.pending.thread.join()
            p = self.pending
            mine = (p.step, p.error, p.peer_error, p.stall_s + p.hand_over_s, self.step_s, trained)
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, mine)
        steps = {e[0] for e in everyone}
        if len(steps) == 1 and None not in steps and all(e[1] is None for e in everyone):
            self.complete = steps.pop()
        if self.auto:
            self._choose_interval(everyone, step, say)
        if self.rank == 0:
            for why in [e[1] for e in everyone if e[1]] + [e[2] for e in everyone if e[2]]:
                self._say_once(say, f"a memory snapshot was not kept ({why}); restarts resume from the previous "
                               "complete snapshot, or storage")
            if self.single_node and self.spec.checkpoint.memory.peer:
                self._say_once(say, "the memory tier has one node: its snapshots are lost with it (no peer copy)")

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

    def _hand_over(self, pending: Pending, taken: dict[str, Any], zipfile: bool, facts: dict[str, Any],
                   prune_below: int | None) -> None:
        """Serialize each file as a persistent write would, and have both keepers hold the bytes."""
        import ray

        t0 = time.perf_counter()
        try:
            files = {}
            # torch.save into memory holds the GIL throughout (about 0.35 s per 512 MB): said to the
            # heartbeat first, so that a large state is not taken for a stopped rank.
            with _without_crc32(), gil.holding():
                for rel, st in taken.items():
                    buf = io.BytesIO()
                    torch.save(st, buf, _use_new_zipfile_serialization=zipfile)
                    # A numpy view, not bytes: Ray copies it once into its object store, outside the
                    # pickle (bytes are pickled whole, a copy more, holding the GIL the training thread needs).
                    files[rel] = np.frombuffer(buf.getbuffer(), dtype=np.uint8)
            if delay := write_delay(test_hooks.read(DELAY_ENV), self.rank, pending.step):
                time.sleep(delay)
            ref = ray.put(files)
            args = (self.attempt, pending.step, self.rank, facts, ref, prune_below)
            # The peer's copy is sent by this node's keeper once it holds its own (a reference in a
            # list: Ray hands it over unresolved): this thread waits for one copy, not two.
            forward = [self.peer_name, ref] if self.peer is not None else None
            try:
                pending.error = ray.get(self.own.put.remote(*args, forward), timeout=CALL_TIMEOUT_S)
                if forward is not None:  # copies sent for earlier snapshots that the peer did not keep
                    told = ray.get(self.own.take_forward_errors.remote(), timeout=CALL_TIMEOUT_S)
                    pending.peer_error = told[-1] if told else None
            except Exception as e:  # noqa: BLE001 - the keeper is gone or stuck: this shard is not held
                pending.error = f"this node's keeper failed: {type(e).__name__}: {str(e)[:200]}"
                if self.peer is not None:  # then the peer's copy goes from here, as nothing else sends it
                    try:
                        pending.peer_error = ray.get(self.peer.put.remote(*args), timeout=CALL_TIMEOUT_S)
                    except Exception as e2:  # noqa: BLE001
                        pending.peer_error = f"the peer node's keeper failed: {type(e2).__name__}: {str(e2)[:200]}"
        except Exception as e:  # noqa: BLE001 - a snapshot that fails leaves the previous one
            pending.error = f"{type(e).__name__}: {str(e)[:200]}"
        pending.hand_over_s = time.perf_counter() - t0


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
    return route.newest(listings, spec.fingerprint_hash())


def load(engine: Any, plan: Plan, dp_rank: int) -> dict[str, int]:
    """Load the snapshot `plan` into `engine` as saved: this rank's files from the keepers (its
    node's first), served to DeepSpeed's own loader from memory. Returns the bytes fetched per file."""
    _pause_for_tests()
    got = _fetch(plan, list(fetch.rank_files(plan.files(), dp_rank)))
    with gil.holding():  # torch.load from memory holds the GIL as torch.save into it does
        states = {n: safe_load.safe_load(io.BytesIO(b), map_location="cpu") for n, b in got.items()}
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
    return {n: len(b) for n, b in got.items()}


@contextlib.contextmanager
def staged(plan: Plan, names: Iterable[str]) -> Iterator[Found]:
    """The files `names` of the snapshot `plan`, fetched from the keepers, as a `Found` laid out as a
    checkpoint's (`<path>/global_stepN/<name>`) that a by-range resize (tidal.worker.checkpoint.repartition)
    reads exactly as it reads storage: through a read-only pyarrow filesystem over the fetched buffers
    (tidal.worker.checkpoint.held_files), which are views of Ray's object store. Nothing is read from
    storage, and nothing is written to disk but what the resize itself writes (the node's copy of the
    model states, its sparse copies); they once went whole to a folder on the node's disk first."""
    _pause_for_tests()
    got = _fetch(plan, sorted(set(names)))
    root, step_tag = f"memory-{plan.step}", f"global_step{plan.step}"
    held = held_files.filesystem({f"{root}/{step_tag}/{name}": data for name, data in got.items()})
    files = {f"{step_tag}/{name}": size for name, size in plan.files().items()}
    yield Found(root, held, plan.state, files)


def _fetch(plan: Plan, names: list[str]) -> dict[str, Any]:
    """The bytes of the files `names` of the snapshot `plan` (read-only buffers), each from a keeper
    holding its shard, this node's first; CheckpointError if every copy of a shard went while it was
    being read."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    by_shard: dict[int, list[str]] = {}
    for n in names:
        by_shard.setdefault(next(r for r, files in plan.shards.items() if n in files), []).append(n)
    got: dict[str, Any] = {}
    for shard, wanted in sorted(by_shard.items()):
        options = sorted(plan.holders[shard].items(), key=lambda kv: kv[1] != node)  # this node's keeper first
        for name, _ in options:
            try:
                answer = ray.get(ray.get_actor(name, namespace=keeper.NAMESPACE).get.remote(
                    plan.attempt, plan.step, shard, wanted), timeout=CALL_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - that keeper is gone: try the next copy
                log.info("memory tier: keeper %s failed (%s)", name, type(e).__name__)
                continue
            if answer is not None:
                got.update(answer)
                break
        else:
            raise CheckpointError(f"the in-memory snapshot of step {plan.step} lost rank {shard}'s shard "
                                  "while it was being restored; the next attempt resumes from what is complete")
    return got


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
