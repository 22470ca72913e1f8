"""Restore a checkpoint at any world size: agree on the resume point, convert, load, condemn only proven damage.

Resizing: DeepSpeed ZeRO checkpoints only load at the world size that wrote them. For another
size rank 0 converts once to DeepSpeed's universal format (`ds_to_universal`), which keeps the
optimizer state, and publishes it in storage beside the original as `global_stepN_universal`
(a marker written last makes it count), where every rank on every node loads it.

A checkpoint that fails to load is quarantined only when it is proven corrupt (a size that
differs from its manifest, a file that does not unpickle); any other failure fails the attempt
and Ray's restart tries the same checkpoint again.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
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
        return (found.path, found.state) if found else None

    chosen = _on_rank0(pick)
    if chosen is None:
        return None
    return Found(chosen[0], RunDir(spec.checkpoint.storage, spec.name).fs, chosen[1])


def restore(engine: Any, found: Found, reshard: bool) -> TrainState:
    """Load `found` into `engine`, converting it first if it was written at another world size."""
    state = TrainState(**found.state)
    step_tag = tag(state.step)
    if reshard:
        step_tag = _on_rank0(lambda: _universal(found, step_tag))
    with fs.local_copy(found.fs, f"{found.path}/{step_tag}") as local_tag:
        try:
            load_path, _ = engine.load_checkpoint(os.path.dirname(local_tag), tag=step_tag,
                                                  load_optimizer_states=True, load_lr_scheduler_states=True)
            if load_path is None:
                raise CheckpointError(f"DeepSpeed found nothing to load under tag {step_tag}")
        except Exception as e:
            raise _load_failed(found, local_tag, step_tag, e) from e
    return state


def _load_failed(found: Found, local_tag: str, step_tag: str, error: BaseException) -> CheckpointError:
    """Condemn a checkpoint only when it is proven corrupt; any other failure (out of memory, a
    network error, a bug) fails this attempt, and Ray's restart tries the same checkpoint again."""
    why = f"{type(error).__name__}: {error}"
    try:
        corrupt = _corruption(found, local_tag, step_tag)
    except Exception as e:  # noqa: BLE001 - the check could not run: nothing is proven
        log.warning("could not check %s for damage (%s: %s); keeping it", found.name, type(e).__name__, e)
        corrupt = None
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


def _corruption(found: Found, local_tag: str, step_tag: str) -> str | None:
    """What proves the checkpoint's files damaged: a size that differs from its manifest, or a
    file whose bytes do not unpickle. None when neither holds: a read error, a missing import
    or a lack of memory says nothing about the checkpoint, so it is not condemned for them."""
    if step_tag.endswith("_universal"):
        if not fs.published(found.fs, f"{found.path}/{step_tag}", f"{found.path}/{universal_marker(step_tag)}"):
            return "its files differ from the conversion's manifest"
    else:
        problem, _ = check_complete(found.fs, found.path)
        if problem is not None and problem.endswith(TRUNCATED):
            return problem
    for path in sorted(Path(local_tag).rglob("*.pt")):
        damage = _damage(path)
        if damage is not None:
            return f"{path.relative_to(local_tag)} {damage}"
    return None


def _damage(path: Path) -> str | None:
    """What is wrong with the bytes of one checkpoint file, or None.

    The bytes are read first, so a read error (a flaky mount, a dropped connection) propagates
    rather than counting as damage; then the zip archive's CRCs are checked where it has them
    (torch.save writes one per entry by default, which catches flipped bits inside tensors too;
    Tidal's own saves write none, see tidal.worker.snapshot._without_crc32) and the file is
    unpickled from memory. A missing class (a library upgrade) or a lack of memory is no proof either.
    """
    data = path.read_bytes()
    if zipfile.is_zipfile(io.BytesIO(data)):
        try:
            bad = _failed_crc(zipfile.ZipFile(io.BytesIO(data)))
        except zipfile.BadZipFile as e:
            return f"is not a readable archive ({e})"
        if bad is not None:
            return f"fails its checksum (entry {bad})"
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
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
    return f"tidal-universal-{step_tag.removesuffix('_universal')}.json"


def _universal(found: Found, step_tag: str) -> str:
    """Convert `step_tag` of `found` to universal form once and publish it beside the original in
    storage, where every rank on every node finds it (a rank's own download is private)."""
    out_tag = f"{step_tag}_universal"
    out, marker = f"{found.path}/{out_tag}", f"{found.path}/{universal_marker(step_tag)}"
    if fs.published(found.fs, out, marker):
        return out_tag  # converted by an earlier attempt at this world size
    t0 = time.perf_counter()
    # Only the files the checkpoint's manifests list: ds_to_universal infers the old data-parallel
    # degree from how many ZeRO files it finds, and a save that died may have left more.
    listed = [rel for rel in listed_files(found.fs, found.path) if rel.startswith(f"{step_tag}/")]
    with fs.local_files(found.fs, found.path, listed) as root, tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(root, step_tag), os.path.join(tmp, out_tag)
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", src,
               "--output_folder", dst, "--num_extract_workers", "1", "--num_merge_workers", "1"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        if proc.returncode != 0:
            try:
                corrupt = _corruption(found, src, step_tag)
            except Exception:  # noqa: BLE001 - the check could not run: nothing is proven
                corrupt = None
            if corrupt is not None:
                quarantine(found, corrupt)
            raise CheckpointError(f"converting {found.name} to a universal checkpoint failed"
                                  f"{f' ({corrupt}; quarantined)' if corrupt else ''}:\n{proc.stderr[-3000:]}")
        fs.publish_dir(dst, found.fs, out, marker)
    log.warning("Resharding: converted %s of %s to universal form in %.1fs", step_tag, found.name,
                time.perf_counter() - t0)
    return out_tag


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
