"""A checkpoint is exactly the files its manifests list, written by one attempt (one worker-group
start), on a local path and on a real S3 API: another attempt's manifests and files in the same
folder never count, the clearing at an attempt's first save never touches a complete or a
quarantined checkpoint, and an fp16 snapshot keeps the loss scale it had when it was taken."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

from tests.helpers import STORAGES
from tidal import fs
from tidal.storage import (
    QUARANTINE_FILE,
    STATE_FILE,
    check_complete,
    checkpoint_dir_name,
    clear_stale,
    listed_files,
    manifest_name,
    stale_checkpoints,
)
from tidal.worker.checkpoint.host_buffers import Buffers
from tidal.worker.checkpoint.snapshot import COPY, SnapshotEngine, write_checkpoint


@pytest.fixture(params=STORAGES)
def store(request, tmp_path) -> tuple[pafs.FileSystem, str]:
    """(filesystem, run folder) on a local path, or in a fresh bucket of the S3 test server."""
    if request.param == "local":
        return pafs.LocalFileSystem(), str(tmp_path / "run")
    bucket = request.getfixturevalue("bucket")
    return fs.resolve(f"{bucket}/run")


def zero_file(step: int, rank: int) -> str:
    return f"global_step{step}/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def save_rank(store: pafs.FileSystem, folder: str, tmp: Path, *, rank: int, world: int, step: int,
              attempt: str | None, manifest: bool = True) -> None:
    """One rank's part of a save, through the writer the workers use; rank 0 adds the state file.
    `manifest=False`: the rank died after its files, before its manifest."""
    local = tmp / f"small-{attempt}-{rank}-{step}"
    local.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        state = {"step": step, "world_size": world, "zero_stage": 2}
        (local / STATE_FILE).write_text(json.dumps(state if attempt is None else {**state, "attempt": attempt}))
    taken = {zero_file(step, rank): {"rank": rank, "attempt": attempt, "w": torch.full((2 + rank,), float(rank))}}
    write_checkpoint(local, taken, store, folder, rank, step, True, attempt=attempt)
    if not manifest:
        store.delete_file(f"{folder}/{manifest_name(rank)}")


def test_a_dead_attempts_files_are_no_part_of_the_step_saved_again(store, tmp_path):
    """Attempt A (2 ranks) died with rank 1 done and rank 0 unfinished; attempt B (1 rank) saved
    the same step into the same folder. B's checkpoint is complete and is only B's files."""
    filesystem, run = store
    folder = f"{run}/{checkpoint_dir_name(8)}"
    save_rank(filesystem, folder, tmp_path, rank=1, world=2, step=8, attempt="A")
    save_rank(filesystem, folder, tmp_path, rank=0, world=2, step=8, attempt="A", manifest=False)
    assert check_complete(filesystem, folder)[0] is not None and listed_files(filesystem, folder) == {}

    save_rank(filesystem, folder, tmp_path, rank=0, world=1, step=8, attempt="B")

    problem, state = check_complete(filesystem, folder)
    assert problem is None and state["attempt"] == "B" and state["world_size"] == 1
    listed = listed_files(filesystem, folder)
    assert zero_file(8, 1) in fs.files_under(filesystem, folder), "the dead attempt's file is still in the folder"
    assert set(listed) == {zero_file(8, 0), STATE_FILE}, "and is no part of the checkpoint"


def test_rank0_of_a_new_attempt_with_another_ranks_old_manifest_is_not_complete(store, tmp_path):
    """A complete checkpoint of attempt A; attempt B saves the same step again: once B's rank 0
    has rewritten the state file, A's rank-1 manifest (rank 1 of B not yet started) must not
    complete it, though every file it lists is there at its size."""
    filesystem, run = store
    folder = f"{run}/{checkpoint_dir_name(8)}"
    for rank in (0, 1):
        save_rank(filesystem, folder, tmp_path, rank=rank, world=2, step=8, attempt="A")
    assert check_complete(filesystem, folder)[0] is None

    save_rank(filesystem, folder, tmp_path, rank=0, world=2, step=8, attempt="B")
    problem, _ = check_complete(filesystem, folder)
    assert problem is not None and "rank 1" in problem and "'A'" in problem and "'B'" in problem
    assert listed_files(filesystem, folder) == {}

    save_rank(filesystem, folder, tmp_path, rank=1, world=2, step=8, attempt="B")
    assert check_complete(filesystem, folder)[0] is None
    assert set(listed_files(filesystem, folder)) == {zero_file(8, 0), zero_file(8, 1), STATE_FILE}


def test_a_manifest_of_another_step_does_not_count(tmp_path):
    filesystem, folder = pafs.LocalFileSystem(), str(tmp_path / checkpoint_dir_name(8))
    save_rank(filesystem, folder, tmp_path, rank=0, world=1, step=8, attempt=None)
    assert check_complete(filesystem, folder)[0] is None, "a checkpoint written before attempts still loads"
    fs.write_json(filesystem, f"{folder}/{manifest_name(0)}", {"step": 4, "files": {}})
    assert "of step 4, not 8" in check_complete(filesystem, folder)[0]


def test_clearing_takes_only_incomplete_folders_of_the_first_step_and_later(store, tmp_path):
    """An attempt whose first save is step 8 clears 8 and later when incomplete; the complete
    (4, 12), the quarantined (16) and anything older than its first save (2) stay whole."""
    filesystem, run = store
    path = {s: f"{run}/{checkpoint_dir_name(s)}" for s in (2, 4, 8, 12, 16, 20)}
    for s in (4, 12, 16):
        for rank in (0, 1):
            save_rank(filesystem, path[s], tmp_path, rank=rank, world=2, step=s, attempt="A")
    fs.write_json(filesystem, f"{path[16]}/{QUARANTINE_FILE}", {"error": "x does not unpickle"})
    for s in (2, 8, 20):  # saves that died: rank 1 done, rank 0 not
        save_rank(filesystem, path[s], tmp_path, rank=1, world=2, step=s, attempt="A")
        save_rank(filesystem, path[s], tmp_path, rank=0, world=2, step=s, attempt="A", manifest=False)
    before = {s: fs.files_under(filesystem, p) for s, p in path.items()}

    assert sorted(clear_stale(filesystem, run, 8)) == [path[8], path[20]]

    after = {s: fs.files_under(filesystem, p) for s, p in path.items()}
    assert after[8] == {} and after[20] == {}
    for s in (2, 4, 12, 16):
        assert after[s] == before[s], s
    assert clear_stale(filesystem, run, 8) == [], "nothing left to clear"


def test_stale_checkpoints_decides_from_steps_and_problems_alone():
    problems = {"r/checkpoint_000000012": None, "r/checkpoint_000000010": "quarantined as corrupt (x)",
                "r/checkpoint_000000008": "rank 0 of 2 never finished writing its files",
                "r/checkpoint_000000006": "tidal-state.json is missing or unreadable (the save did not finish)"}
    newest_first = sorted(problems, reverse=True)
    assert stale_checkpoints(newest_first, problems.get, 8) == ["r/checkpoint_000000008"]
    assert stale_checkpoints(newest_first, problems.get, 13) == []
    assert stale_checkpoints(newest_first, problems.get, 1) == ["r/checkpoint_000000008", "r/checkpoint_000000006"]


def test_local_files_holds_exactly_the_listed_files(store, tmp_path):
    filesystem, run = store
    folder = f"{run}/{checkpoint_dir_name(8)}"
    save_rank(filesystem, folder, tmp_path, rank=1, world=2, step=8, attempt="A")
    save_rank(filesystem, folder, tmp_path, rank=0, world=1, step=8, attempt="B")
    wanted = [rel for rel in listed_files(filesystem, folder) if rel.startswith("global_step8/")]

    with fs.local_files(filesystem, folder, wanted) as local:
        assert sorted(os.listdir(os.path.join(local, "global_step8"))) == [os.path.basename(zero_file(8, 0))]
        assert torch.load(os.path.join(local, zero_file(8, 0)), weights_only=False)["attempt"] == "B"


def test_an_fp16_snapshot_keeps_the_loss_scale_it_was_taken_with(tmp_path):
    """DeepSpeed's fp16 optimizers put the live loss scaler object in their state dict. Training
    goes on after the snapshot (the scale grows) before the background write runs:
    the checkpoint must hold the scale of the step it was taken at."""
    scaler = DynamicLossScaler(init_scale=2.0**16, scale_window=1, min_scale=1, delayed_shift=2,
                               consecutive_hysteresis=False)
    weights = torch.ones(4)
    rel = zero_file(8, 0)
    snap = SnapshotEngine(tmp_path / "small", Buffers(), COPY)
    snap.save({"optimizer_state_dict": {"loss_scaler": scaler, "dynamic_loss_scale": True, "w": weights}},
              str(tmp_path / "small" / rel))
    for _ in range(2):  # two steps without overflow: the scale window (1) has passed, the scale doubles
        scaler.update_scale(False)
    weights += 1
    assert scaler.cur_scale == 2.0**17

    (tmp_path / "small").mkdir(exist_ok=True)
    write_checkpoint(tmp_path / "small", snap.taken, pafs.LocalFileSystem(), str(tmp_path / "ckpt"), 0, 8, True)

    saved = torch.load(tmp_path / "ckpt" / rel, weights_only=False)["optimizer_state_dict"]
    assert saved["loss_scaler"].cur_scale == 2.0**16 and saved["loss_scaler"].cur_iter == 0
    assert torch.equal(saved["w"], torch.ones(4))
    assert scaler.cur_scale == 2.0**17, "training's own scaler is untouched"


def _flaky_json_reads() -> pafs.FileSystem:
    """A local filesystem whose reads of state files and manifests fail, as a flaky mount or an
    object store answering 503 does for a moment."""
    from fsspec.implementations.local import LocalFileSystem

    class Flaky(LocalFileSystem):
        def _open(self, path, mode="rb", **kwargs):  # type: ignore[no-untyped-def]
            if "r" in mode and str(path).endswith(".json"):
                raise OSError(f"When reading information for key '{path}': AWS Error SLOW_DOWN (HTTP status 503)")
            return super()._open(path, mode, **kwargs)

    return pafs.PyFileSystem(pafs.FSSpecHandler(Flaky()))


def test_a_checkpoint_that_cannot_be_read_for_a_moment_is_never_cleared(tmp_path):
    """No good checkpoint is condemned for a transient error: a storage error while checking a
    complete checkpoint (here every JSON read answers 503) says nothing about it, so the clearing
    at an attempt's first save leaves it whole."""
    run = str(tmp_path / "run")
    local, folder = pafs.LocalFileSystem(), f"{run}/{checkpoint_dir_name(8)}"
    for rank in (0, 1):
        save_rank(local, folder, tmp_path, rank=rank, world=2, step=8, attempt="A")
    before = fs.files_under(local, folder)
    flaky = _flaky_json_reads()

    assert check_complete(flaky, folder)[0] is not None, "unreadable: not known to be complete"
    assert clear_stale(flaky, run, 8) == []
    assert fs.files_under(local, folder) == before
