"""Save a DeepSpeed checkpoint through Ray Train, and restore it at any world size.

Every rank snapshots its DeepSpeed state in memory and hands it to `ray.train.report`, whose
upload thread writes it straight into the checkpoint's folder in storage (all ranks' files in
one folder), then a manifest of the rank's files, last (see tidal.worker.snapshot). Training
waits only for the snapshot unless the save must be synchronous. Rank 0 also writes
`tidal-state.json`: the step, the world size, the spec fingerprint and the MLflow run id.
`tidal.storage` decides from those files which checkpoint is complete.

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
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import ray.train
import torch
import torch.distributed as dist

from tidal import fs
from tidal.errors import CheckpointError
from tidal.spec.job import JobSpec
from tidal.storage import (
    STATE_FILE,
    TRUNCATED,
    Found,
    RunDir,
    check_complete,
    checkpoint_dir_name,
    find_resume_point,
    quarantine,
)
from tidal.worker.engine import is_pipeline
from tidal.worker.snapshot import SnapshotEngine, StorageWriter, snapshot_mode

log = logging.getLogger("tidal")
T = TypeVar("T")


@dataclass
class TrainState:
    """All a checkpoint needs beyond DeepSpeed's own files to continue exactly."""

    step: int = 0
    samples_seen: int = 0
    tokens_seen: int = 0
    world_size: int = 1
    zero_stage: int = 0
    mlflow_run_id: str | None = None
    data_ended: bool = False  # a stream of data.epochs passes ran out: the job is done
    evaluation: dict[str, Any] = field(default_factory=dict)  # the last eval and early stopping (tidal.eval_best)
    fingerprint: dict[str, Any] = field(default_factory=dict)


def tag(step: int) -> str:
    return f"global_step{step}"


def save(engine: Any, state: TrainState, metrics: dict[str, Any],
         save_data_position: Callable[[Path], None] | None = None, background: bool = True) -> dict[str, float]:
    """Save on every rank and report to Ray Train (a collective: all ranks call it together).

    `background`: training waits only for a snapshot of the state in memory, and the write into
    storage happens in Ray Train's upload thread (see tidal.worker.snapshot); otherwise this call
    returns once the checkpoint is written (the preemption path does that).
    Either way the files go straight into storage, once, and the manifest last.
    `metrics` go with the checkpoint to Ray (and so to Ray Tune in a sweep);
    `save_data_position(folder)`, a collective too, adds the data stream's position. Returns
    this rank's snapshot time, time training was blocked (including the wait for the previous
    write) and the state's bytes.
    """
    rank = dist.get_rank()
    t0 = time.perf_counter()
    writer = _writer()
    waited = writer.wait()  # at most one save in flight: also frees the buffers for reuse
    local = Path(tempfile.mkdtemp(prefix="tidal-ckpt-"))  # only the few small files land here
    storage = ray.train.get_context().get_storage()
    mode = snapshot_mode(background, engine.device.type, is_pipeline(engine), fs.is_local(storage.storage_filesystem))
    mutable = {b.untyped_storage().data_ptr() for b in engine.module.buffers()}
    snap = SnapshotEngine(local, writer.buffers, mode, mutable)
    zipfile_format = getattr(engine.checkpoint_engine, "zipfile_serialization", True)
    before, engine.checkpoint_engine = engine.checkpoint_engine, snap
    try:
        engine.save_checkpoint(
            str(local),
            tag=tag(state.step),
            # ds_to_universal refuses checkpoints without this key.
            client_state={"tidal": asdict(state), "universal_checkpoint_info": {"universal_checkpoint_version": 0.4}},
        )
    finally:
        engine.checkpoint_engine = before
    if save_data_position is not None:
        save_data_position(local)
    if rank == 0:
        (local / STATE_FILE).write_text(json.dumps(asdict(state), indent=2))
    save_s = time.perf_counter() - t0
    small = sum(p.stat().st_size for p in local.rglob("*") if p.is_file())
    state_bytes = _tensor_bytes(snap.taken) + small
    upload = writer.upload_fn(rank, state.step, snap.taken, zipfile_format, storage.storage_filesystem,
                              storage.experiment_fs_path, ray.train.Checkpoint, mode)
    try:
        ray.train.report(
            {**metrics, "step": state.step},
            checkpoint=ray.train.Checkpoint.from_directory(str(local)),
            checkpoint_dir_name=checkpoint_dir_name(state.step),
            checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC if background else ray.train.CheckpointUploadMode.SYNC,
            checkpoint_upload_fn=upload,
            delete_local_checkpoint_after_upload=True,
        )
    except BaseException:
        writer.abandon()  # nothing was handed to Ray's upload thread, or it ran and failed
        raise
    return {"checkpoint_save_s": save_s, "checkpoint_blocked_s": time.perf_counter() - t0,
            "checkpoint_wait_s": waited, "checkpoint_bytes": float(state_bytes),
            "checkpoint_ray_held_s": writer.ray_held()}


def ray_backlog(held_s: float, every_steps: int, interval_s: str | None) -> str | None:
    """A warning when checkpoint writes waited for Ray Train to take earlier reports (it takes one
    per worker per poll, see tidal.launch.recovery): training then waits for Ray, not storage."""
    if held_s < 0.1:
        return None
    return (f"WARNING: checkpoints come faster than Ray Train takes their reports (one per "
            f"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S = {interval_s or 2} s): writes waited {held_s:.2f} s for Ray "
            f"since the last save, and training waits with them. Raise checkpoint.every_steps (now "
            f"{every_steps}) or lower RAY_TRAIN_HEALTH_CHECK_INTERVAL_S.")


def before_update(engine: Any) -> None:
    """Before DeepSpeed's step: a checkpoint still being written from the live state (CPU) ends
    first, if this step updates the weights (the last micro-batch of the step)."""
    if _WRITER is not None and engine.is_gradient_accumulation_boundary():
        _WRITER.before_update()


def gate_waited() -> float:
    """Seconds optimizer steps waited for checkpoint writes since the last call (part of the stall)."""
    return _WRITER.gate_waited() if _WRITER is not None else 0.0


_WRITER: StorageWriter | None = None


def _writer() -> StorageWriter:
    """One writer per worker process; a restarted worker group starts new processes."""
    global _WRITER
    if _WRITER is None:
        _WRITER = StorageWriter()
    return _WRITER


def _tensor_bytes(tree: Any) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(v) for v in tree)
    return 0


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
    with fs.local_copy(found.fs, f"{found.path}/{step_tag}") as src, tempfile.TemporaryDirectory() as tmp:
        dst = os.path.join(tmp, out_tag)
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
