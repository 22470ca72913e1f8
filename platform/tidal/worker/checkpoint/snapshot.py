"""Asynchronous checkpoints: training waits only while its state is copied in memory.

A save has two halves:

1. **Snapshot** (the training thread waits): DeepSpeed's `save_checkpoint` runs as usual, but
   with `SnapshotEngine` as its checkpoint engine, which records each state dict DeepSpeed hands
   it instead of serializing it to a file. On a GPU, or into an object store, it copies every
   tensor into one host block per file (page-locked on a GPU: DMA; see tidal.worker.checkpoint.host_buffers),
   kept and reused by the next save, so a save after the first pays a copy, not page faults. On CPU into a filesystem a copy
   costs about as much as the write into the page cache it would spare, so the engine keeps the
   live tensors instead ("live" mode) and the next optimizer step, the first thing that changes
   them, waits until the write has serialized them (`before_update`; their fsync and the
   manifest need not hold it): the write overlaps the next forward and backward
   (`snapshot_mode` decides).
2. **Write** (in the background): `StorageWriter.upload` serializes each snapshot with
   `torch.save` straight into the checkpoint's folder in storage (a local path, fsynced, or an
   object store through pyarrow): written once, no local temporary copy re-copied. The rank's
   manifest (see tidal.storage) is written last, only when every byte is durable, so a crash
   during the write leaves the previous checkpoint as the resume point.

The write runs as Ray Train's own `checkpoint_upload_fn` in its `CheckpointUploadMode.ASYNC`
upload thread (one per worker), so Ray registers the checkpoint when it is written, keeps its
reports in order and waits for the last write before the worker exits. At most one save is in
flight: the next `save` waits for the previous write (back-pressure when storage is slower than
the checkpoint interval), which also frees its buffers for reuse.

Why not DeepSpeed's own asynchronous engines: `DecoupledCheckpointEngine` and
`FastCheckpointEngine` write local POSIX paths through DeepSpeed's AIO op (libaio or GPUDirect
Storage), not object stores, and commit on their own schedule with no hook that tells Ray when
the bytes are durable. PyTorch DCP's `async_save` writes its own format, which DeepSpeed's
loader and its universal-checkpoint converter (Tidal's resize path) do not read.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
)

from tidal import fs, test_hooks
from tidal.errors import CheckpointError
from tidal.worker.checkpoint.host_buffers import Buffers, rebuilt, tensors_in
from tidal.worker.checkpoint.safe_load import check_saveable, safe_load

log = logging.getLogger("tidal")

# Fault-injection for tests and benchmarks: seconds the background write pauses after a
# rank's data files and before its manifest, as a slow store would, so a kill lands mid-write
# ("S@R": on rank R only, so a kill lands after the other ranks finished; "S:N": only the writes
# of step N, where a test's kill lands; see `write_delay`).
WRITE_DELAY_ENV = test_hooks.CHECKPOINT_WRITE_DELAY


COPY, LIVE, CLONE = "copy", "live", "clone"


def snapshot_mode(background: bool, device_type: str, pipeline: bool, local_storage: bool) -> str:
    """How a save holds the state until it is written.

    live: the tensors themselves, with the next optimizer step waiting for the write: on CPU,
    into a filesystem, whose write takes about what a copy would (the page cache) and overlaps
    the next forward and backward.
    copy: into reused host buffers: on a GPU (a fast DMA); into an object store, whose upload
    outlasts a step, so a waiting update would stall; and for pipelines, whose `train_batch`
    runs the optimizer step inside DeepSpeed, with no point where an update could wait.
    clone: DeepSpeed's own clone of views, for a write that ends before training goes on.
    """
    if not background:
        return CLONE
    return LIVE if device_type == "cpu" and not pipeline and local_storage else COPY


class SnapshotEngine(CheckpointEngine):
    """A DeepSpeed checkpoint engine that records what DeepSpeed would save, for a writer
    (`mode`: see `snapshot_mode`). Loading is weights-only (tidal.worker.checkpoint.safe_load)."""

    def __init__(self, root: Path, buffers: Buffers, mode: str, mutable: set[int] | None = None) -> None:
        super().__init__()
        self.name = "TidalSnapshotEngine"
        self.root, self.buffers, self.mode = root, buffers, mode
        # Storages a forward pass may change (a module's buffers, e.g. BatchNorm's running
        # statistics): a live save copies these, since only the optimizer step waits for it.
        self.mutable = mutable or set()
        self.taken: dict[str, Any] = {}  # path relative to root -> state (a copy or the original)

    def create(self, info: CheckpointCommitInfo) -> None:
        pass

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)  # DeepSpeed writes a few small files itself (latest, a script)

    def save(self, state_dict: Any, path: str) -> None:
        rel = os.path.relpath(path, self.root)
        check_saveable(rel, state_dict)  # a state no restore could load fails here, at the first save
        if self.mode == COPY:
            # DeepSpeed puts every file in a folder named for the step (global_step12/...): the
            # buffers go by the name inside it, so the next save reuses them instead of holding
            # one more copy of the whole state per checkpoint.
            self.taken[rel] = self.buffers.take(rel.split(os.sep, 1)[-1], state_dict)
        elif self.mode == LIVE and self.mutable:
            self.taken[rel] = _clone_where(state_dict, lambda t: t.untyped_storage().data_ptr() in self.mutable)
        else:
            self.taken[rel] = state_dict
        self.taken[rel] = _scalers_copied(self.taken[rel])

    def load(self, path: str, map_location: Any = None) -> Any:
        return safe_load(path, map_location=map_location)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        return True

    def preserves_storage_sharing(self) -> bool:
        # True makes DeepSpeed clone views before saving (as with its own engine, so a parameter
        # that is a view of a flat buffer is not saved with the whole buffer). A copy goes into
        # compact buffers anyway; a live save must not copy (torch.save writes a storage shared
        # by several views once per file, and the loader reads the views back as they were).
        return self.mode == CLONE


def _scalers_copied(tree: Any) -> Any:
    """`tree` with every fp16 loss scaler replaced by a copy of it as it is now.

    DeepSpeed's fp16 optimizers put the live scaler object in their state dict (`loss_scaler`),
    not its values; a write that runs later, in the background, would pickle the scale of
    whatever step training has reached by then. The scaler is a few numbers: copying it costs
    nothing. (A live save's optimizer step waits for the write anyway; the copy makes the
    snapshot hold, whatever the mode.)"""
    from deepspeed.runtime.fp16.loss_scaler import LossScalerBase

    def walk(x: Any) -> Any:
        if isinstance(x, LossScalerBase):
            return copy.deepcopy(x)
        if isinstance(x, dict):
            if not any(isinstance(v, LossScalerBase | dict) for v in x.values()):
                return x
            out = copy.copy(x)
            for k, v in x.items():
                out[k] = walk(v)
            return out
        return x

    return walk(tree)


def _clone_where(tree: Any, pick: Callable[[torch.Tensor], bool]) -> Any:
    """`tree` with the tensors `pick` chooses cloned, containers rebuilt, all else as it was."""
    return rebuilt(tree, {id(t): t.detach().clone() if pick(t) else t for t in tensors_in(tree)})


class StorageWriter:
    """Writes one rank's snapshot into storage; at most one write in flight per worker."""

    def __init__(self) -> None:
        self.last = threading.Event()  # set when the latest save's write ended
        self.last.set()
        self.read = threading.Event()  # set when the latest save's tensors are serialized
        self.read.set()
        self.buffers = Buffers()
        self.live = False  # the latest save holds live tensors: updates wait until they are read
        self.gate_s = 0.0  # seconds updates waited for live writes, since `gate_waited`
        self.ended = 0.0  # perf_counter() when the latest write ended
        self.held_s = 0.0  # seconds writes waited for Ray to take earlier reports, since `ray_held`

    def before_update(self) -> None:
        """Called before every optimizer step: a live save's tensors must have been serialized
        (into the page cache or the upload) first; their fsync and the manifest need not wait."""
        if self.live and not self.read.is_set():
            t0 = time.perf_counter()
            self.read.wait()
            self.gate_s += time.perf_counter() - t0

    def gate_waited(self) -> float:
        """Seconds optimizer steps waited for live writes since the last call."""
        waited, self.gate_s = self.gate_s, 0.0
        return waited

    def ray_held(self) -> float:
        """Seconds writes waited, since the last call, for Ray Train's upload thread after their
        report and the previous write had ended: the thread was handing an earlier report to a
        controller that takes one per poll (tidal.launch.recovery)."""
        held, self.held_s = self.held_s, 0.0
        return held

    def wait(self) -> float:
        """Block until the previous write ended (written or failed); returns the seconds waited.

        Ray skips a report's upload only when a peer has failed (its barrier was reset); it then
        tears this worker group down, so a wait for a write that never runs ends with the group."""
        t0 = time.perf_counter()
        self.last.wait()
        return time.perf_counter() - t0

    def abandon(self) -> None:
        """The latest save never reached storage: stop waiting for it, and keep its buffers out of reuse."""
        self.buffers = Buffers()
        self.read.set()
        self.last.set()

    def upload_fn(self, rank: int, step: int, taken: dict[str, Any], zipfile: bool, storage: pafs.FileSystem,
                  experiment: str, checkpoint_cls: Any, mode: str, attempt: str | None = None,
                  before_manifest: Callable[[], None] | None = None,
                  may_write: Callable[[], bool] | None = None) -> Callable[[Any, str], Any]:
        """Ray Train's `checkpoint_upload_fn` for this save: (local checkpoint, folder name) -> the
        checkpoint in storage (a `checkpoint_cls`, i.e. `ray.train.Checkpoint`). `wait` blocks
        from now until it has run, and so, for a live save, does `before_update`.
        `before_manifest` runs in the write, after the files and before the manifest; `may_write`
        (whether this attempt still owns the job) is asked before the first write and the manifest."""
        done, read = self.last, self.read = threading.Event(), threading.Event()
        self.live = mode == LIVE
        stale = False  # a live save that failed after training moved on: its state is gone
        queued = time.perf_counter()

        def upload(local: Any, dir_name: str) -> Any:
            nonlocal stale
            self.held_s += max(0.0, time.perf_counter() - max(queued, self.ended))
            if stale:
                raise CheckpointError(f"checkpoint of step {step} failed after training had moved on from its state; "
                                      "it is not written again (the previous checkpoint stays the resume point)")
            dest = f"{experiment}/{dir_name}"
            try:
                write_checkpoint(Path(local.path), taken, storage, dest, rank, step, zipfile, on_read=read.set,
                                 attempt=attempt, before_manifest=before_manifest, may_write=may_write)
            except BaseException:
                # Should this be called again with the same state, it must write this step's:
                # later copies go into new buffers; live tensors not yet read are copied before
                # the optimizer step waiting on them may change them.
                self.buffers = Buffers()
                if mode == LIVE and read.is_set():
                    stale = True
                elif mode == LIVE:
                    fresh = Buffers()
                    taken.update({rel: fresh.take(rel, state) for rel, state in taken.items()})
                raise
            finally:
                self.ended = time.perf_counter()
                read.set()
                done.set()
            return checkpoint_cls(dest, filesystem=storage)

        return upload


def write_checkpoint(local: Path, taken: dict[str, Any], storage: pafs.FileSystem, dest: str, rank: int,
                     step: int, zipfile: bool, on_read: Callable[[], None] | None = None,
                     attempt: str | None = None, before_manifest: Callable[[], None] | None = None,
                     may_write: Callable[[], bool] | None = None) -> dict[str, int]:
    """Write `taken` (serialized) and the small files DeepSpeed and Tidal left under `local` into
    `dest`, then this rank's manifest, last, naming the `attempt` (worker-group start) that wrote
    it. `on_read` is called once every tensor of `taken` is serialized, before the fsyncs;
    `before_manifest` once every file is durable, before the manifest (rank 0 waits there for
    the event log: see tidal.worker.loop `_save`). Returns the files written and their sizes.

    When `may_write()` says a newer start of the job took its lease (tidal/lease.py), nothing is
    written (before the first file), or no manifest (after the files): such files count for
    nothing, and a newer attempt's manifest of the same step is never deleted or replaced."""
    from tidal.storage import manifest_name

    if may_write is not None and not may_write():
        if on_read is not None:
            on_read()
        log.warning("[tidal] checkpoint of step %d not written: a newer start of the job holds its lease", step)
        return {}
    manifest = f"{dest}/{manifest_name(rank)}"
    fs.delete_file(storage, manifest)  # a retry of this step after a crash: not complete until rewritten
    storage.create_dir(dest, recursive=True)
    with _without_crc32():
        files = {rel: _write(storage, f"{dest}/{rel}", lambda f, s=state: torch.save(
            s, f, _use_new_zipfile_serialization=zipfile), sync=False) for rel, state in taken.items()}
    if on_read is not None:
        on_read()
    if fs.is_local(storage):
        for rel in files:
            _fsync_path(f"{dest}/{rel}")
    for p in sorted(local.rglob("*")):
        if p.is_file():
            rel = str(p.relative_to(local))
            files[rel] = _write(storage, f"{dest}/{rel}", lambda f, p=p: f.write(p.read_bytes()))
    if fs.is_local(storage):
        _fsync_dirs(dest, files)
    if delay := write_delay(test_hooks.read(WRITE_DELAY_ENV), rank, step):
        time.sleep(delay)
    if before_manifest is not None:
        before_manifest()
    if may_write is not None and not may_write():
        log.warning("[tidal] checkpoint of step %d left incomplete: a newer start of the job holds its lease", step)
        return files
    fs.write_json(storage, manifest, {"step": step, "attempt": attempt, "files": files})
    return files


def write_delay(value: str, rank: int, step: int) -> float:
    """The fault-injected pause for `rank`'s write of `step`: "3" pauses every write 3 s, "3@0"
    only rank 0's, "3:20" only those of step 20, "3@0:20" rank 0's of step 20."""
    value, _, at_step = value.partition(":")
    seconds, _, only = value.partition("@")
    if not seconds or (only and int(only) != rank) or (at_step and int(at_step) != step):
        return 0.0
    return float(seconds)


@contextmanager
def _without_crc32() -> Iterator[None]:
    """torch.save without a CRC-32 of each record in the zip archive (PyTorch's own option).

    torch.load never checks them (a flipped bit in a tensor loads as it is), so they protect no
    resume, and computing them was 2/3 of a save's CPU here: 31.6 vs 11.0 ms for 32 MB (median
    of 8, one thread), taken from a training core while the write overlaps the next step. What
    proves a checkpoint damaged stays: sizes against the manifest, and unpickling
    (tidal.worker.checkpoint.restore). The option is process-wide and read when a torch.save starts: a
    torch.save of the user's in another thread meanwhile writes no CRCs either, which torch.load
    does not mind."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def _write(storage: pafs.FileSystem, path: str, emit: Callable[[Any], Any], sync: bool = True) -> int:
    """Write one file durably: fsynced on a local or shared filesystem (unless `sync` is False:
    the caller does it with `_fsync_path`); on an object store the upload's completion is its
    durability. Returns its size."""
    if fs.is_local(storage):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            emit(f)
            f.flush()
            if sync:
                os.fsync(f.fileno())
            return f.tell()
    parent = path.rsplit("/", 1)[0]
    storage.create_dir(parent, recursive=True)
    with storage.open_output_stream(path) as f:
        emit(f)
        return f.tell()


def _fsync_path(path: str) -> None:
    """fsync a file written and closed earlier (fsync flushes the file, whichever descriptor asks)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dirs(dest: str, files: dict[str, int]) -> None:
    """Make the new files' directory entries durable too, before the manifest claims them."""
    for d in sorted({os.path.dirname(os.path.join(dest, rel)) for rel in files} | {dest}):
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
