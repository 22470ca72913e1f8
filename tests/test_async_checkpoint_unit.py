"""The two halves of an asynchronous checkpoint without Ray: the snapshot is a copy that later
training does not change (in buffers reused from save to save), and the write puts the manifest
last, so a checkpoint counts as complete only once every file is written."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pyarrow.fs as pafs
import torch

from tidal.storage import STATE_FILE, check_complete, manifest_name
from tidal.worker.snapshot import Buffers, write_checkpoint


def state(w: torch.Tensor) -> dict:
    return {"module": OrderedDict(w=w, tied=w), "optimizer": {"state": [w * 2], "step": 3}, "ds_version": "x"}


def test_snapshot_is_a_copy_in_reused_buffers():
    w = torch.arange(6.0).reshape(2, 3)
    buffers = Buffers()
    first = buffers.take("a.pt", state(w))
    w += 100  # training moves on in place
    assert torch.equal(first["module"]["w"], torch.arange(6.0).reshape(2, 3))
    assert first["module"]["tied"] is first["module"]["w"], "a tensor saved twice stays one tensor"
    assert isinstance(first["module"], OrderedDict) and first["optimizer"]["step"] == 3

    kept = first["module"]["w"]
    second = buffers.take("a.pt", state(w))
    assert second["module"]["w"] is kept, "the next save copies into the same buffer"
    assert torch.equal(kept, w)


def test_write_puts_the_manifest_last_and_replaces_a_stale_one(tmp_path: Path):
    local = tmp_path / "local"
    (local / "global_step4").mkdir(parents=True)
    (local / STATE_FILE).write_text('{"step": 4, "world_size": 1}')
    (local / "latest").write_text("global_step4")
    dest = tmp_path / "store" / "checkpoint_000000004"
    dest.mkdir(parents=True)
    (dest / manifest_name(0)).write_text('{"step": 4, "files": {}}')  # left by a crashed earlier try

    taken = {"global_step4/mp_rank_00_model_states.pt": state(torch.ones(4))}
    files = write_checkpoint(local, taken, pafs.LocalFileSystem(), str(dest), 0, 4, True)

    assert set(files) == {"global_step4/mp_rank_00_model_states.pt", STATE_FILE, "latest"}
    assert check_complete(pafs.LocalFileSystem(), str(dest)) == (None, {"step": 4, "world_size": 1})
    loaded = torch.load(dest / "global_step4/mp_rank_00_model_states.pt", weights_only=False)
    assert torch.equal(loaded["module"]["w"], torch.ones(4))
    # A file that lost bytes after the manifest was written is caught.
    (dest / "latest").write_text("x")
    assert check_complete(pafs.LocalFileSystem(), str(dest))[0] is not None

