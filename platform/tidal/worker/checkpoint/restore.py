"""Restore a checkpoint at any world size: agree on the resume point, convert, load, condemn only proven damage.

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

A checkpoint that fails to load is quarantined only when it is proven corrupt (a size that
differs from its manifest, a file that does not unpickle); any other failure fails the attempt
and Ray's restart tries the same checkpoint again. A pickle naming a type outside the allow-list
of tidal.worker.checkpoint.safe_load is refused rather than run, and proves nothing against the
checkpoint (an entry removed from the spec, a library upgrade that moved a type): the job ends
with what to do, and nothing is condemned. Too little local disk is the node's fault: a clear
error, and the checkpoint is kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import re
import zipfile
from collections.abc import Callable
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.fs as pafs
import torch
import torch.distributed as dist

from tidal import fs
from tidal.errors import CheckpointError
from tidal.spec.job import JobSpec
from tidal.storage import (
    DAMAGED,
    TRUNCATED,
    Found,
    RunDir,
    check_complete,
    find_resume_point,
    quarantine,
)
from tidal.worker.checkpoint import (
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
from tidal.worker.checkpoint.save import TrainState, libraries_changed, tag

log = logging.getLogger("tidal")
T = TypeVar("T")
CHUNK = 8 * 2**20  # a damage check holds at most this much of a file at once

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
        if how.load is Load.AS_SAVED:
            memory.load(engine, how.memory, _dp_rank(engine))
        else:
            _by_range_from_memory(engine, how)
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
            raise _load_failed(found, read, step_tag, e) from e
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
            raise _load_failed(found, files, step_tag, e) from e
    if share is not None:
        _untie_steps(engine)
    return state


def _cut(engine: Any, load: Load, old_world: int) -> repartition.Cut:
    """This rank's part of a by-range resize from `old_world` ranks, for its ZeRO family."""
    return (repartition_zero3.cut if load is Load.RANGE_ZERO3 else repartition.zero12)(engine, old_world)


def _by_range_from_memory(engine: Any, how: Route) -> None:
    """A by-range resize (`how.load`) of the memory tier's snapshot `how.memory`: the shards this
    rank's new partition comes from, fetched from the keepers to this node, read as from storage.
    A failure here proves nothing about any checkpoint: it fails the attempt, and the next one
    resumes from the newest complete copy."""
    plan = how.memory
    listed = plan.files()
    cut = _cut(engine, how.load, len(plan.shards))
    with memory.staged(plan, repartition.reads(cut, listed)) as local:
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
        if (refused := _refused(e)) is not None:
            raise safe_load.refusal(refused, found.path, libraries_changed(found.state)) from e
        if dist.get_rank() != 0:
            raise
        try:
            corrupt = _safe_corruption(found, tag_files(found, step_tag), step_tag)
        except safe_load.UnsafeCheckpointFile as refused_here:
            raise safe_load.refusal(refused_here, found.path, libraries_changed(found.state)) from e
        if corrupt is None:
            raise
        quarantine(found, corrupt)
        raise CheckpointError(f"converting {found.name} to a universal checkpoint failed ({corrupt}; "
                              f"quarantined): {e}") from e
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


def _load_failed(found: Found, files: dict[str, int], step_tag: str, error: BaseException) -> Exception:
    """Condemn a checkpoint only when it is proven corrupt; any other failure (out of memory, a
    network error, a bug) fails this attempt, and Ray's restart tries the same checkpoint again. A
    pickle refused by the allow-list condemns nothing and ends the job (`safe_load.refusal`)."""
    why = f"{type(error).__name__}: {error}"
    if (refused := _refused(error)) is not None:
        return safe_load.refusal(refused, found.path, libraries_changed(found.state))
    try:
        corrupt = _safe_corruption(found, files, step_tag)
    except safe_load.UnsafeCheckpointFile as e:  # the check met a refused pickle this rank did not load
        return safe_load.refusal(e, found.path, libraries_changed(found.state))
    if corrupt is None:
        return CheckpointError(
            f"loading {found.name} failed ({why}). Its files are intact (every size matches its manifest and "
            "every file unpickles), so it is kept: the next attempt loads it again.")
    if step_tag.endswith("_universal"):
        with contextlib.suppress(FileNotFoundError):  # another rank may have discarded it first
            found.fs.delete_file(f"{found.path}/{universal_marker(step_tag)}")
        return CheckpointError(f"the universal conversion of {found.name} is damaged ({corrupt}); it is "
                               "discarded and made again on the next attempt")
    quarantine(found, corrupt)
    return CheckpointError(f"{found.name} is corrupt ({corrupt}) and was quarantined; the next attempt "
                           "resumes from the checkpoint before it")


def _refused(error: BaseException) -> safe_load.UnsafeCheckpointFile | None:
    """The allow-list refusal behind `error`, if one is: raised here, or by another rank of a spread
    conversion (which reports it as text, tidal.worker.checkpoint.universal_spread)."""
    seen: BaseException | None = error
    for _ in range(8):
        if seen is None:
            break
        if isinstance(seen, safe_load.UnsafeCheckpointFile):
            return seen if seen.refused else None
        seen = seen.__cause__ or seen.__context__
    text = str(error)
    if f"{safe_load.UnsafeCheckpointFile.__name__}: " in text:
        told = text.split(f"{safe_load.UnsafeCheckpointFile.__name__}: ", 1)[1]
        if named := re.search(r"its pickle names ([\w.]+), a type", told):
            return safe_load.UnsafeCheckpointFile(told, named[1])
    return None


def _checks_listing() -> bool:
    """Whether this rank checks the whole listing after a failed load (rank 0, once); every other
    rank checks the files it read, so its requests do not grow with the world that wrote them."""
    return dist.get_rank() == 0


def _safe_corruption(found: Found, files: dict[str, int], step_tag: str) -> str | None:
    try:
        return _corruption(found, files, step_tag)
    except safe_load.UnsafeCheckpointFile:
        raise  # not damage: the caller says what to do (`safe_load.refusal`)
    except Exception as e:  # noqa: BLE001 - the check could not run: nothing is proven
        log.warning("could not check %s for damage (%s: %s); keeping it", found.name, type(e).__name__, e)
        return None


def _corruption(found: Found, files: dict[str, int], step_tag: str) -> str | None:
    """What proves the checkpoint's files damaged: a size that differs from its manifest, an
    unsafe name, or one of `files` (those this rank read, all listed) whose bytes in storage do
    not unpickle. Rank 0 checks the whole listing (every manifest, or the conversion's marker)
    once; every other rank the sizes of the files it read. None when none holds: a read error, a missing import or a lack of memory says
    nothing about the checkpoint, so it is not condemned for them. Storage is read, not a local
    copy: a copy damaged on this node proves nothing about the checkpoint. Each file is streamed
    (its archive's entries checked in chunks, its pickle read without the tensors' bytes), never
    read whole into memory."""
    if not _checks_listing():
        if (problem := _sizes_differ(found, files, step_tag)) is not None:
            return problem
    elif step_tag.endswith("_universal"):
        if not fs.published(found.fs, f"{found.path}/{step_tag}", f"{found.path}/{universal_marker(step_tag)}"):
            return "its files differ from the conversion's manifest"
    else:
        problem, _ = check_complete(found.fs, found.path)
        if problem is not None and problem.endswith(DAMAGED):
            return problem
    for rel in sorted(r for r in files if r.endswith(".pt")):
        with found.fs.open_input_file(fs.join(f"{found.path}/{step_tag}", rel)) as f:
            damage = file_damage(f)
        if damage is not None:
            return f"{rel} {damage}"
    return None


def _sizes_differ(found: Found, files: dict[str, int], step_tag: str) -> str | None:
    """A file of `files` (those this rank read, relative to the tag folder -> listed size) that
    storage holds at another size, or not at all: one request per file."""
    names = sorted(files)
    infos = found.fs.get_file_info([fs.join(f"{found.path}/{step_tag}", rel) for rel in names])
    for info, rel in zip(infos, names, strict=True):
        if info.type != pafs.FileType.File or info.size != files[rel]:
            got = "missing" if info.type != pafs.FileType.File else f"{info.size} bytes"
            return f"{step_tag}/{rel} is {got}, expected {files[rel]} bytes {TRUNCATED}"
    return None


def file_damage(f: Any) -> str | None:
    """What is wrong with the bytes of one checkpoint file (`f`: a seekable binary file), or None.

    The zip archive's CRCs are checked where it has them, entry by entry in chunks (torch.save
    writes one per entry by default, which catches flipped bits inside tensors too; Tidal's own
    saves write none, see tidal.worker.checkpoint.snapshot._without_crc32), then the pickle is unpickled
    weights-only onto the meta device, which reads the records' headers, not the tensors' bytes.
    A read error propagates rather than counting as damage; a missing class (a library upgrade)
    or a lack of memory is no proof either."""
    if zipfile.is_zipfile(f):
        try:
            f.seek(0)
            bad = _failed_crc(zipfile.ZipFile(f))
        except zipfile.BadZipFile as e:
            return f"is not a readable archive ({e})"
        if bad is not None:
            return f"fails its checksum (entry {bad})"
    f.seek(0)
    if isinstance(f, pa.NativeFile):  # torch's non-zip reader needs readline, which pyarrow's files lack
        f = io.BufferedReader(f)
    try:
        # Weights-only: a pickle naming a type outside the allow-list is refused, never run, and is
        # no proof of damage (it propagates: the caller ends the job); a pickle torch.save never
        # writes (an opcode the weights-only unpickler does not know, no type named) is damage.
        safe_load.safe_load(f, map_location="meta")
    except safe_load.UnsafeCheckpointFile as e:
        if e.refused:  # a type torch named: the allow-list's verdict, not the bytes'
            raise
        return f"does not unpickle ({str(e)[:200]})"  # no global named: bytes torch.save never writes
    except (ImportError, AttributeError, MemoryError, OSError):
        raise
    except Exception as e:  # noqa: BLE001 - any other failure is the bytes'
        return f"does not unpickle ({type(e).__name__}: {str(e)[:200]})"
    return None


def _failed_crc(archive: zipfile.ZipFile) -> str | None:
    """The first entry whose bytes differ from their CRC-32, skipping entries written without
    one (0, as torch.save writes them with its CRCs turned off; a real CRC of 0 is 1 in 2**32)."""
    for info in archive.infolist():
        if info.CRC == 0:
            continue
        try:
            with archive.open(info) as entry:  # zipfile checks the CRC-32 as it reads
                while entry.read(CHUNK):
                    pass
        except zipfile.BadZipFile:
            return info.filename
    return None


def universal_marker(step_tag: str) -> str:
    """Written after a universal conversion's last file: without it the conversion does not count."""
    return universal.marker(step_tag)


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
