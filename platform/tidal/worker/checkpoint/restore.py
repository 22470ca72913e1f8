"""Restore a checkpoint at any world size: agree on the resume point, convert once, load it the chosen way.

Resizing: DeepSpeed ZeRO checkpoints only load at the world size that wrote them; which way one
loads here is decided once, on rank 0 (tidal.worker.checkpoint.route). A plain
data-parallel ZeRO checkpoint is read by each new rank directly, only the byte ranges of the old
partitions that make up its new one (tidal.worker.checkpoint.repartition; ZeRO-3 parameter by parameter,
tidal.worker.checkpoint.repartition_zero3). For the others the new group
converts once to DeepSpeed's universal format, which keeps the optimizer state, each rank its
share (tidal.worker.checkpoint.universal_spread; tensor- or pipeline-parallel checkpoints on rank 0 alone,
tidal.worker.checkpoint.universal), and publishes it in storage beside the original as
`global_stepN_universal` (a marker written last makes it count), outside any collective.

Rank 0 lists and verifies the checkpoint once and hands every rank the list of its files, so a
rank's storage requests grow with its own files, not with the world. Each rank reads only the
files it loads (a ZeRO-3 rank only its slice of each universal parameter file, tidal.worker.checkpoint.share),
and only files the manifests list, into a private cache its node shares and keeps for the next
restart (tidal.worker.checkpoint.fetch), on every filesystem: DeepSpeed reads those checked copies, never
storage.

A checkpoint that fails to load is condemned only when it is proven corrupt
(tidal.worker.checkpoint.damage); any other failure fails the attempt and Ray's restart tries the
same checkpoint again. Too little local disk is the node's fault: a clear error, and the
checkpoint is kept.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from tidal.errors import CheckpointError
from tidal.spec.job import JobSpec
from tidal.storage import Found, RunDir, find_resume_point
from tidal.worker.checkpoint import (
    damage,
    fetch,
    memory,
    repartition,
    repartition_zero3,
    route,
    safe_load,
    universal,
    universal_spread,
)
from tidal.worker.checkpoint.route import Convert, Load, Route
from tidal.worker.checkpoint.save import TrainState, tag

log = logging.getLogger("tidal")
T = TypeVar("T")

def agree_on_resume_point(spec: JobSpec, generation: int = 0) -> tuple[Found, Route] | tuple[None, None]:
    """Rank 0 picks the newest complete checkpoint and how it loads (`route.decide`, once), and
    every rank takes both, with the checkpoint's list of files: rank 0 lists and verifies the
    checkpoint once, and no other rank reads a manifest, so a rank's storage requests grow with
    its own files, not with the world.

    Ranks must never pick their own: one that lists storage a moment later could see a
    checkpoint another rank did not, and they would load different steps.
    """
    # Before any load here, and any save after: the types this job's state may hold.
    safe_load.allow(spec.checkpoint.safe_globals)

    def pick() -> tuple[str, dict[str, Any], dict[str, int] | None, Route] | None:
        found = find_resume_point(spec)
        held, plan = _in_memory(spec, generation)
        load = route.from_memory(found.step if found else None, held, spec, dist.get_world_size())
        if load is not None:
            assert plan is not None
            # Not a path: what the resume line names (events.resumed), and the plan every rank loads.
            return f"the in-memory snapshot {plan.where()}", plan.state, None, Route(load, memory=plan)
        if found is None:
            return None
        step_tag = tag(found.step)
        chosen = route.decide(route.Layout.of(found.state, found.files, step_tag), spec, dist.get_world_size())
        if chosen.universal and not universal.ready(found, step_tag):
            universal.prepare(found, step_tag)  # before the others can read a stale status or marker
        return found.path, found.state, found.files, chosen

    picked = _on_rank0(pick)
    if picked is None:
        return None, None
    return Found(picked[0], RunDir(spec.checkpoint.storage, spec.name).fs, picked[1], picked[2]), picked[3]


def _in_memory(spec: JobSpec, generation: int) -> tuple[route.Held, memory.Plan] | tuple[None, None]:
    """The memory tier's newest complete snapshot (rank 0), if the job has the tier: its own
    keepers', under its driver's lease `generation` (tidal.worker.checkpoint.keeper.Owner)."""
    if spec.checkpoint.memory is None or memory.supported(spec) is not None:
        return None, None
    try:
        return memory.newest_complete(spec, generation)
    except Exception as e:  # noqa: BLE001 - the tier is an optimisation: storage is always there
        log.warning("could not list the memory tier's snapshots (%s: %s); resuming from storage", type(e).__name__, e)
        return None, None


def restore(engine: Any, found: Found, how: Route) -> TrainState:
    """Load `found` into `engine` the way rank 0 chose (`how`, tidal.worker.checkpoint.route): as
    saved, by byte range at the new size, or from a universal conversion made first.

    DeepSpeed reads a private copy of exactly this rank's listed files, checked weights-only
    there (tidal.worker.checkpoint.fetch): never the storage folder, whatever the filesystem."""
    state = TrainState.from_saved(found.state)
    if how.memory is not None:  # the memory tier's snapshot, from the keepers: nothing read from storage
        try:
            if how.load is Load.AS_SAVED:
                memory.load(engine, how.memory, _dp_rank(engine))
            else:
                _by_range_from_memory(engine, how.load, how.memory)
        except Exception as e:
            raise _memory_load_failed(how.memory, e) from e
        return state
    step_tag = tag(state.step)
    if how.load in (Load.RANGE_ZERO12, Load.RANGE_ZERO3):
        listed = tag_files(found, step_tag)
        read: dict[str, int] = {}  # what this rank reads: what a failure has it check
        try:
            cut = _cut(engine, how.load, int(found.state["world_size"]))
            read = repartition.reads(cut, listed)
            repartition.restore(engine, found, step_tag, listed, _identity(found, found.files or {}), cut)
        except fetch.LocalDiskFull:
            raise
        except Exception as e:
            raise damage.load_failed(found, read, step_tag, e) from e
        return state
    if how.universal:
        step_tag, listed, identity = _converted(found, step_tag, how.convert)
    else:
        listed, identity = tag_files(found, step_tag), _identity(found, found.files or {})
    files = rank_files(engine, listed, step_tag)
    share = _dp_share(engine) if how.load is Load.UNIVERSAL_ZERO3 else None
    with fetch.tag_folder(found.fs, found.path, step_tag, files, found.name, identity, share) as (load_dir, _):
        try:
            # DeepSpeed's universal loader unpickles with weights_only=False, its other loads go
            # through the engine's checkpoint engine (weights-only while inside safe_loading):
            # every file is checked first, the copy DeepSpeed will read.
            safe_load.check_files(f"{load_dir}/{step_tag}", files)
            with safe_load.safe_loading(engine):  # the model and optimizer states: weights-only
                load_path, _ = engine.load_checkpoint(load_dir, tag=step_tag,
                                                      load_optimizer_states=True, load_lr_scheduler_states=True)
            if load_path is None:
                raise CheckpointError(f"DeepSpeed found nothing to load under tag {step_tag}")
        except Exception as e:
            raise damage.load_failed(found, files, step_tag, e) from e
    if share is not None:
        _untie_steps(engine)
    return state


def _memory_load_failed(plan: route.Plan, error: Exception) -> Exception:
    """What a failed load of the memory snapshot `plan` raises: a snapshot that does not load is set
    aside in the keepers first (`memory.unloadable`), so the next attempt resumes from the
    next-newest complete snapshot or storage instead of failing on it again; a copy lost while it
    was read leaves it listed (it is no longer complete, or it loads on the next attempt)."""
    if not memory.unloadable(error):
        return error
    gone = memory.set_aside(plan)
    return CheckpointError(f"the in-memory snapshot of step {plan.step} did not load ({type(error).__name__}: "
                           f"{str(error)[:300]}); set aside ({gone} shard(s)): the next attempt resumes from the "
                           "next-newest complete snapshot or storage")


def _cut(engine: Any, load: Load, old_world: int) -> repartition.Cut:
    """This rank's part of a by-range resize from `old_world` ranks, for its ZeRO family."""
    return (repartition_zero3.cut if load is Load.RANGE_ZERO3 else repartition.zero12)(engine, old_world)


def _by_range_from_memory(engine: Any, load: Load, plan: route.Plan) -> None:
    """A by-range resize (`load`) of the memory tier's snapshot `plan`: the shards this
    rank's new partition comes from, fetched from the keepers to this node, read as from storage.
    A failure here proves nothing about any checkpoint: it fails the attempt, and the next one
    resumes from the newest complete copy."""
    cut = _cut(engine, load, len(plan.shards))
    with memory.staged(plan, repartition.reads(cut, plan.files())) as local:
        # The sizes of the files as serialized here (a snapshot's listing gives its block's): what is read
        prefix = f"{tag(plan.step)}/"
        listed = {**plan.files(), **{rel.removeprefix(prefix): n for rel, n in (local.files or {}).items()}}
        repartition.restore(engine, local, tag(plan.step), listed, plan.attempt, cut, keep=False)


def _identity(found: Found, listed: dict[str, int], extra: str = "") -> str:
    """What tells this checkpoint's content from another's under the same folder name: the attempt
    that wrote it and its whole file list with sizes (not the rank's: ranks of a node share a copy)."""
    blob = json.dumps([found.state.get("attempt"), sorted(listed.items()), extra])
    return hashlib.sha1(blob.encode()).hexdigest()


def _converted(found: Found, step_tag: str, convert: Convert | None) -> tuple[str, dict[str, int], str]:
    """The universal tag of `step_tag`, converted `convert`'s way if not yet, its files (relative
    to it -> size) and identity; rank 0 verifies the published conversion once and hands its list
    to every rank. A conversion that fails on checkpoint files proven corrupt quarantines the
    checkpoint (rank 0, which read them)."""
    try:
        if convert is Convert.SPREAD:
            out_tag = universal_spread.ensure(found, step_tag, dist.get_rank(), dist.get_world_size())
        else:
            out_tag = universal.ensure(found, step_tag, dist.get_rank())
    except fetch.LocalDiskFull:
        raise
    except CheckpointError as e:
        if (verdict := damage.conversion_failed(found, step_tag, lambda: tag_files(found, step_tag), e)) is not None:
            raise verdict from e
        raise
    doc = _on_rank0(lambda: universal.published(found, step_tag))
    files = dict(doc["files"])
    return out_tag, files, _identity(found, files, str(doc.get("id", "")))


def tag_files(found: Found, step_tag: str) -> dict[str, int]:
    """The files of the folder `step_tag` of `found` (relative to it -> size) that its manifests
    list (`universal.step_files`, relative to the tag folder here)."""
    prefix = f"{step_tag}/"
    return {rel[len(prefix):]: size for rel, size in universal.step_files(found, step_tag).items()}


def rank_files(engine: Any, listed: dict[str, int], step_tag: str) -> dict[str, int]:
    """Of `listed` (a tag folder's files), those this rank's engine loads (tidal.worker.checkpoint.fetch.rank_files)."""
    if step_tag.endswith("_universal"):  # DeepSpeed reads the old rank 0's model states whatever the rank
        return fetch.rank_files(listed, 0, _held_params(engine))
    return fetch.rank_files(listed, _dp_rank(engine))


# DeepSpeed internals, checked against 0.19.8: a ZeRO optimizer's data-parallel group, and for
# ZeRO-1/2 (`stage_1_and_2.py`) its `bit16_groups` and `param_names`, whose parameters with an
# `_hp_mapping` are those `load_hp_checkpoint_state_from_checkpoint_dir` reads `zero/<name>/` for.
def _dp_rank(engine: Any) -> int:
    group = getattr(engine.optimizer, "dp_process_group", None)
    return dist.get_rank(group=group) if group is not None else dist.get_rank()


def _dp_share(engine: Any) -> tuple[int, int]:
    """(data-parallel world, rank) of a ZeRO-3 engine, whose universal loader keeps only this
    rank's slice of each parameter's optimizer files (tidal.worker.checkpoint.share)."""
    group = getattr(engine.optimizer, "dp_process_group", None)
    return dist.get_world_size(group=group), _dp_rank(engine)


def _untie_steps(engine: Any) -> None:
    """Give each ZeRO-3 sub-group its own optimizer step counter after a universal load.

    DeepSpeed's `load_hp_checkpoint_state_from_checkpoint_dir_stage3` (0.19.8) sets one `step`
    tensor object on every sub-group, and torch's Adam adds 1 to it in place per sub-group: with
    k sub-groups (a large model's partitions split at `sub_group_size`), every step after the
    resize advanced the count by k, and Adam's bias correction went wrong from the second step.
    """
    inner = getattr(getattr(engine, "optimizer", None), "optimizer", None)  # the torch optimizer under ZeRO's
    seen: set[int] = set()
    for group_state in getattr(inner, "state", {}).values():
        step = group_state.get("step")
        if isinstance(step, torch.Tensor):
            if id(step) in seen:
                group_state["step"] = step.clone()
            seen.add(id(step))


def _held_params(engine: Any) -> set[str] | None:
    """Names of the parameters whose fragments this rank's ZeRO-1/2 optimizer holds; None (all)
    for others (ZeRO-3 loads every parameter's whole state and keeps its slice)."""
    groups, names = getattr(engine.optimizer, "bit16_groups", None), getattr(engine.optimizer, "param_names", None)
    if groups is None or names is None:
        return None
    return {names[p] for group in groups for p in group if getattr(p, "_hp_mapping", None) is not None}


def _on_rank0(fn: Callable[[], T]) -> T:
    """Run `fn` on rank 0 only and hand its result, or its failure, to every rank."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box = [(True, fn())]
        except Exception as e:  # noqa: BLE001 - re-raised below on every rank
            box = [(False, str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}")]
    dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise CheckpointError(value)
    return value
