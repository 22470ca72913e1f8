"""Save a DeepSpeed checkpoint through Ray Train (restoring it: tidal.worker.checkpoint.restore).

Every rank snapshots its DeepSpeed state in memory and hands it to `ray.train.report`, whose
upload thread writes it straight into the checkpoint's folder in storage (all ranks' files in
one folder), then a manifest of the rank's files, last (see tidal.worker.checkpoint.snapshot). Training
waits only for the snapshot unless the save must be synchronous. Rank 0 also writes
`tidal-state.json`: the `TrainState` (what a resume restores) beside the checkpoint's own
`Provenance` and attempt id (who wrote it: the world size, ZeRO stage and spec fingerprint that
`tidal.storage` and `tidal.worker.checkpoint.restore` check). The MLflow run id is the job's, in
`tidal-job.json`, not any checkpoint's. `tidal.storage` decides from those files which
checkpoint is complete.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import ray.train
import torch
import torch.distributed as dist

from tidal import fs
from tidal.lease import LeaseCheck
from tidal.storage import (
    STATE_FILE,
    checkpoint_dir_name,
    clear_stale,
)
from tidal.worker.checkpoint.snapshot import SnapshotEngine, StorageWriter, snapshot_mode

log = logging.getLogger("tidal")


@dataclass
class TrainState:
    """All a resume restores beyond DeepSpeed's own files (and the data position's, see
    `tidal.worker.data`): derived counts (samples, tokens) follow from the step and the spec."""

    step: int = 0
    data_ended: bool = False  # a stream of data.epochs passes ran out: the job is done
    evaluation: dict[str, Any] = field(default_factory=dict)  # the last eval and early stopping (tidal.eval_best)

    @classmethod
    def from_saved(cls, saved: dict[str, Any]) -> TrainState:
        """From a state file; keys that are not TrainState's are ignored: the provenance saved
        beside it, and keys older checkpoints carry (`samples_seen`, `mlflow_run_id`, ...)."""
        return cls(**{f.name: saved[f.name] for f in fields(cls) if f.name in saved})


@dataclass(frozen=True)
class Provenance:
    """Who wrote a checkpoint, saved beside its TrainState and never restored into it:
    `tidal.storage.check_complete` reads `world_size`, `check_compatible` the `fingerprint`,
    `route.Layout` `world_size`, `zero_stage`, `frozen_params` and `sub_group_size`."""

    world_size: int
    zero_stage: int
    fingerprint: dict[str, Any] = field(default_factory=dict)
    # Parameters the optimizer does not train: ZeRO-3 saves their fragments per rank, which only
    # a universal conversion cuts at another size (tidal.worker.checkpoint.route.by_range); None: unknown.
    frozen_params: int | None = None
    # ZeRO-3's sub-group size (tidal.spec.deepspeed.sub_group_size), which cuts its partitions: one
    # changed since loads only through a conversion (route.decide); None: not ZeRO-3, or unknown.
    sub_group_size: int | None = None
    # The libraries whose types the checkpoint's pickles name: a resume says when they changed
    # (`libraries_changed`), since an upgrade that moves a type has the allow-list refuse it.
    libraries: dict[str, str] = field(default_factory=lambda: library_versions())


def library_versions() -> dict[str, str]:
    """torch's and DeepSpeed's versions, as a checkpoint records them: plain strings (torch's own
    is a TorchVersion, a type the weights-only allow-list refuses)."""
    import deepspeed

    return {"torch": str(torch.__version__), "deepspeed": str(deepspeed.__version__)}


def libraries_changed(saved: dict[str, Any]) -> str | None:
    """How the libraries that wrote a checkpoint (its saved state) differ from this worker's, as a
    clause ("torch 2.13.0 -> 2.14.0"); None when the same, or not recorded (an older checkpoint)."""
    then, now = saved.get("libraries") or {}, library_versions()
    changed = [f"{name} {then[name]} -> {now[name]}" for name in sorted(now) if then.get(name, now[name]) != now[name]]
    return ", ".join(changed) or None


def tag(step: int) -> str:
    return f"global_step{step}"


def save(engine: Any, state: TrainState, written_by: Provenance, metrics: dict[str, Any],
         save_data_position: Callable[[Path], None] | None = None, background: bool = True,
         before_commit: Callable[[], None] | None = None) -> dict[str, float]:
    """Save on every rank and report to Ray Train (a collective: all ranks call it together).

    `background`: training waits only for a snapshot of the state in memory, and the write into
    storage happens in Ray Train's upload thread (see tidal.worker.checkpoint.snapshot); otherwise this call
    returns once the checkpoint is written (the preemption path does that).
    Either way the files go straight into storage, once, and the manifest last.
    `metrics` go with the checkpoint to Ray (and so to Ray Tune in a sweep);
    `save_data_position(folder)`, a collective too, adds the data stream's position;
    `before_commit()` runs in this rank's write before its manifest, so the checkpoint is not
    complete until it returns. Returns
    this rank's snapshot time, time training was blocked (including the wait for the previous
    write) and the state's bytes.
    """
    global _SAVED_AT, _PERIOD_S
    rank = dist.get_rank()
    t0 = time.perf_counter()
    _PERIOD_S, _SAVED_AT = (t0 - _SAVED_AT if _SAVED_AT is not None else None), t0
    writer = _writer()
    waited = writer.wait()  # at most one save in flight: also frees the buffers for reuse
    local = Path(tempfile.mkdtemp(prefix="tidal-ckpt-"))  # only the few small files land here
    storage = ray.train.get_context().get_storage()
    attempt = _attempt(storage.storage_filesystem, storage.experiment_fs_path, state.step)
    saved_state = {**asdict(state), **asdict(written_by), "attempt": attempt}
    # A pipeline engine is one with `train_batch` (tidal.worker.engine.is_pipeline; this package
    # sits below the rest of the worker and does not import it).
    pipeline = hasattr(engine, "train_batch")
    mode = snapshot_mode(background, engine.device.type, pipeline, fs.is_local(storage.storage_filesystem))
    mutable = {b.untyped_storage().data_ptr() for b in engine.module.buffers()}
    snap = SnapshotEngine(local, writer.buffers, mode, mutable)
    zipfile_format = getattr(engine.checkpoint_engine, "zipfile_serialization", True)
    before, engine.checkpoint_engine = engine.checkpoint_engine, snap
    try:
        engine.save_checkpoint(
            str(local),
            tag=tag(state.step),
            # ds_to_universal refuses checkpoints without this key.
            client_state={"tidal": saved_state, "universal_checkpoint_info": {"universal_checkpoint_version": 0.4}},
        )
    finally:
        engine.checkpoint_engine = before
    if save_data_position is not None:
        save_data_position(local)
    if rank == 0:
        # The state file also says the step time: what a restarted group's watchdog arms its deadline
        # with (worker/hang.resumed_step_times). Not in DeepSpeed's files: their state is the training's.
        timing = {"step_time_s": st} if isinstance(st := metrics.get("step_time_s"), float) and st == st else {}
        (local / STATE_FILE).write_text(json.dumps({**saved_state, **timing}, indent=2))
    save_s = time.perf_counter() - t0
    small = sum(p.stat().st_size for p in local.rglob("*") if p.is_file())
    state_bytes = _tensor_bytes(snap.taken) + small
    upload = writer.upload_fn(rank, state.step, snap.taken, zipfile_format, storage.storage_filesystem,
                              storage.experiment_fs_path, ray.train.Checkpoint, mode, attempt, before_commit,
                              may_write=_may_write)
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


# The share of the time between two saves that writes may wait for Ray Train before it is worth a warning:
# below it, the wait is Ray's controller being slow at a poll (a loaded machine), not saves outpacing it.
BACKLOG_SHARE = 0.05


def ray_backlog(held_s: float, every_steps: int, interval_s: str | None, period_s: float | None = None) -> str | None:
    """A warning when checkpoint writes waited for Ray Train to take earlier reports (it takes one
    per worker per poll, see tidal.launch.recovery): training then waits for Ray, not storage.
    `period_s`: seconds since this rank's previous save (None: the group's first)."""
    if held_s < 0.1 or (period_s is not None and held_s < BACKLOG_SHARE * period_s):
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


def period_s() -> float | None:
    """Seconds between this process's last two saves (None: one save so far): `ray_backlog`'s yardstick."""
    return _PERIOD_S


_WRITER: StorageWriter | None = None
_SAVED_AT: float | None = None  # time.perf_counter() of this process's last save
_PERIOD_S: float | None = None
_ATTEMPT: str | None = None
_FENCE: LeaseCheck | None = None


def fence_writes(lease: LeaseCheck | None) -> None:
    """Check `lease` before this worker clears or commits anything (tidal/lease.py): a save of an
    attempt whose driver lost the job to a newer start writes no manifest, and clears nothing."""
    global _FENCE
    _FENCE = lease


def _may_write() -> bool:
    return _FENCE is None or _FENCE.current(fresh=True)


def _attempt(storage: Any, run_path: str, step: int) -> str:
    """This worker group's attempt id, the same on every rank (a collective at the first save).

    At the group's first save rank 0 clears the incomplete checkpoint folders of this step and
    later (tidal.storage.clear_stale: saves that died left them, and this group writes those
    steps again), then draws the id and hands it to every rank, which waits for it: so no rank
    writes before the clearing ends. Ray Train's public context (`ray.train.get_context()`) offers
    nothing that is new at each group start, hence our own."""
    global _ATTEMPT
    if _ATTEMPT is None:
        box: list[str | None] = [None]
        if dist.get_rank() == 0:
            if _may_write():  # a superseded attempt must not clear the newer one's in-flight saves
                clear_stale(storage, run_path, step)
            box = [uuid.uuid4().hex[:12]]
        dist.broadcast_object_list(box, src=0)
        _ATTEMPT = box[0]
    return _ATTEMPT


def new_attempt() -> None:
    """The next save draws a new attempt id (a collective) and clears the steps it will write again: for a
    group re-formed in this process (failure.replace_in_place), where the cached id is the old group's."""
    global _ATTEMPT
    _ATTEMPT = None


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
