"""Restore a checkpoint at any world size: agree on the resume point, convert, load, condemn only proven damage.

Resizing: DeepSpeed ZeRO checkpoints only load at the world size that wrote them. For another
size rank 0 converts once to DeepSpeed's universal format, which keeps the optimizer state, and
publishes it in storage beside the original as `global_stepN_universal` (a marker written last
makes it count), while the other ranks wait for it outside any collective (tidal.worker.universal).

Each rank reads only the files it loads, and only files the checkpoint's manifests list: from
an object store into a cache its node shares (tidal.worker.fetch), from a filesystem in place.

A checkpoint that fails to load is quarantined only when it is proven corrupt (a size that
differs from its manifest, a file that does not unpickle, or one whose pickle names a type outside
the allow-list of tidal.worker.safe_load, which is refused rather than run); any other failure fails the attempt
and Ray's restart tries the same checkpoint again. Too little local disk is the node's fault:
a clear error, and the checkpoint is kept.
"""

from __future__ import annotations

import contextlib
import io
import logging
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

from tidal import fs
from tidal.errors import CheckpointError
from tidal.spec.job import JobSpec
from tidal.storage import (
    TRUNCATED,
    Found,
    RunDir,
    check_complete,
    find_resume_point,
    listed_files,
    quarantine,
)
from tidal.worker import fetch, safe_load, universal
from tidal.worker.checkpoint import TrainState, tag

log = logging.getLogger("tidal")
T = TypeVar("T")

def needs_reshard(state: dict[str, Any], world_size: int) -> bool:
    """ZeRO 1-3 partition optimizer state by rank; stage 0 keeps it whole, so it loads anywhere."""
    return int(state["world_size"]) != world_size and int(state["zero_stage"]) > 0


def agree_on_resume_point(spec: JobSpec) -> Found | None:
    """Rank 0 picks the newest complete checkpoint and every rank takes that one.

    Ranks must never pick their own: one that lists storage a moment later could see a
    checkpoint another rank did not, and they would load different steps.
    """
    def pick() -> tuple[str, dict[str, Any]] | None:
        found = find_resume_point(spec)
        if found is None:
            return None
        if needs_reshard(found.state, dist.get_world_size()):
            universal.prepare(found, tag(found.step))  # before the others can read a stale status
        return found.path, found.state

    chosen = _on_rank0(pick)
    if chosen is None:
        return None
    return Found(chosen[0], RunDir(spec.checkpoint.storage, spec.name).fs, chosen[1])


def restore(engine: Any, found: Found, reshard: bool) -> TrainState:
    """Load `found` into `engine`, converting it first if it was written at another world size."""
    state = TrainState.from_saved(found.state)
    step_tag = tag(state.step)
    if reshard:
        step_tag = _converted(found, step_tag)
    files = rank_files(engine, found, step_tag)
    with fetch.tag_folder(found.fs, found.path, step_tag, files, found.name) as load_dir:
        try:
            if step_tag.endswith("_universal"):  # DeepSpeed's universal loader unpickles with weights_only=False
                safe_load.check_files(f"{load_dir}/{step_tag}", files)
            with safe_load.safe_loading(engine):  # the model and optimizer states: weights-only
                load_path, _ = engine.load_checkpoint(load_dir, tag=step_tag,
                                                      load_optimizer_states=True, load_lr_scheduler_states=True)
            if load_path is None:
                raise CheckpointError(f"DeepSpeed found nothing to load under tag {step_tag}")
        except Exception as e:
            raise _load_failed(found, files, step_tag, e) from e
        if not fs.is_local(found.fs):
            # The node's cache goes with the last rank that leaves it: without this, a rank done
            # early removes it before a slower rank of its node arrives, which downloads again.
            # The wait is for peers' loads, never for a conversion (tidal.worker.universal).
            dist.barrier()
    return state


def _converted(found: Found, step_tag: str) -> str:
    """The universal tag of `step_tag`; a conversion that fails on checkpoint files proven
    corrupt quarantines the checkpoint (rank 0, which read them)."""
    try:
        return universal.ensure(found, step_tag, dist.get_rank())
    except fetch.LocalDiskFull:
        raise
    except CheckpointError as e:
        if dist.get_rank() != 0:
            raise
        corrupt = _safe_corruption(found, tag_files(found, step_tag), step_tag)
        if corrupt is None:
            raise
        quarantine(found, corrupt)
        raise CheckpointError(f"converting {found.name} to a universal checkpoint failed ({corrupt}; "
                              f"quarantined): {e}") from e


def tag_files(found: Found, step_tag: str) -> dict[str, int]:
    """The files of the folder `step_tag` of `found` (relative to it -> size) that a manifest
    lists: the checkpoint's own manifests, or for a universal folder its conversion's marker."""
    if step_tag.endswith("_universal"):
        published = fs.read_json(found.fs, f"{found.path}/{universal_marker(step_tag)}") or {}
        return dict(published.get("files", {}))
    prefix = f"{step_tag}/"
    return {rel[len(prefix):]: size for rel, size in listed_files(found.fs, found.path).items()
            if rel.startswith(prefix)}


def rank_files(engine: Any, found: Found, step_tag: str) -> dict[str, int]:
    """The listed files of `step_tag` this rank's engine loads (see tidal.worker.fetch.rank_files)."""
    listed = tag_files(found, step_tag)
    if step_tag.endswith("_universal"):  # DeepSpeed reads the old rank 0's model states whatever the rank
        return fetch.rank_files(listed, 0, _held_params(engine))
    return fetch.rank_files(listed, _dp_rank(engine))


# DeepSpeed internals, checked against 0.19.8: a ZeRO optimizer's data-parallel group, and for
# ZeRO-1/2 (`stage_1_and_2.py`) its `bit16_groups` and `param_names`, whose parameters with an
# `_hp_mapping` are those `load_hp_checkpoint_state_from_checkpoint_dir` reads `zero/<name>/` for.
def _dp_rank(engine: Any) -> int:
    group = getattr(engine.optimizer, "dp_process_group", None)
    return dist.get_rank(group=group) if group is not None else dist.get_rank()


def _held_params(engine: Any) -> set[str] | None:
    """Names of the parameters whose fragments this rank's ZeRO-1/2 optimizer holds; None (all)
    for others (ZeRO-3 loads every parameter's whole state and keeps its slice)."""
    groups, names = getattr(engine.optimizer, "bit16_groups", None), getattr(engine.optimizer, "param_names", None)
    if groups is None or names is None:
        return None
    return {names[p] for group in groups for p in group if getattr(p, "_hp_mapping", None) is not None}


def _load_failed(found: Found, files: dict[str, int], step_tag: str, error: BaseException) -> CheckpointError:
    """Condemn a checkpoint only when it is proven corrupt; any other failure (out of memory, a
    network error, a bug) fails this attempt, and Ray's restart tries the same checkpoint again."""
    why = f"{type(error).__name__}: {error}"
    corrupt = _safe_corruption(found, files, step_tag)
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


def _safe_corruption(found: Found, files: dict[str, int], step_tag: str) -> str | None:
    try:
        return _corruption(found, files, step_tag)
    except Exception as e:  # noqa: BLE001 - the check could not run: nothing is proven
        log.warning("could not check %s for damage (%s: %s); keeping it", found.name, type(e).__name__, e)
        return None


def _corruption(found: Found, files: dict[str, int], step_tag: str) -> str | None:
    """What proves the checkpoint's files damaged: a size that differs from its manifest, or one
    of `files` (those this rank read, all listed) whose bytes in storage do not unpickle. None
    when neither holds: a read error, a missing import or a lack of memory says nothing about
    the checkpoint, so it is not condemned for them. Storage is read, not a local copy: a copy
    damaged on this node proves nothing about the checkpoint."""
    if step_tag.endswith("_universal"):
        if not fs.published(found.fs, f"{found.path}/{step_tag}", f"{found.path}/{universal_marker(step_tag)}"):
            return "its files differ from the conversion's manifest"
    else:
        problem, _ = check_complete(found.fs, found.path)
        if problem is not None and problem.endswith(TRUNCATED):
            return problem
    for rel in sorted(r for r in files if r.endswith(".pt")):
        with found.fs.open_input_stream(f"{found.path}/{step_tag}/{rel}") as f:
            data = f.read()
        damage = _damaged_bytes(data)
        if damage is not None:
            return f"{rel} {damage}"
    return None


def _damage(path: Path) -> str | None:
    """What is wrong with the bytes of one checkpoint file, or None.

    The bytes are read first, so a read error (a flaky mount, a dropped connection) propagates
    rather than counting as damage; then the zip archive's CRCs are checked where it has them
    (torch.save writes one per entry by default, which catches flipped bits inside tensors too;
    Tidal's own saves write none, see tidal.worker.snapshot._without_crc32) and the file is
    unpickled from memory. A missing class (a library upgrade) or a lack of memory is no proof either.
    """
    return _damaged_bytes(path.read_bytes())


def _damaged_bytes(data: bytes) -> str | None:
    if zipfile.is_zipfile(io.BytesIO(data)):
        try:
            bad = _failed_crc(zipfile.ZipFile(io.BytesIO(data)))
        except zipfile.BadZipFile as e:
            return f"is not a readable archive ({e})"
        if bad is not None:
            return f"fails its checksum (entry {bad})"
    try:
        # Weights-only: a pickle naming a type Tidal's checkpoints never hold is refused, never run,
        # and counts as damage (safe_load.UnsafeCheckpointFile), so the checkpoint is quarantined.
        safe_load.safe_load(io.BytesIO(data))
    except (ImportError, AttributeError, MemoryError):
        raise
    except Exception as e:  # noqa: BLE001 - no I/O happens here: any other failure is the bytes'
        return f"does not unpickle ({type(e).__name__}: {str(e)[:200]})"
    return None


def _failed_crc(archive: zipfile.ZipFile) -> str | None:
    """The first entry whose bytes differ from their CRC-32, skipping entries written without
    one (0, as torch.save writes them with its CRCs turned off; a real CRC of 0 is 1 in 2**32)."""
    for info in archive.infolist():
        if info.CRC == 0:
            continue
        try:
            archive.read(info)  # zipfile checks the CRC-32 as it reads
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
