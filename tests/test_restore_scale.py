"""Restore I/O that does not grow with the world: rank 0 lists and verifies a checkpoint once, and
each rank's restore then makes storage requests for its own files only. A simulated 64-rank
ZeRO-2 checkpoint, read through a pyarrow filesystem that counts every request (one per path
asked about, as S3 sends a HEAD or GET per key), behind the real restore (a process group of
one, the rank's data-parallel rank set per simulated rank). No Ray."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
import torch

from tests.fakes import Counting
from tidal.errors import CheckpointError
from tidal.storage import STATE_FILE, RunDir, manifest_name
from tidal.worker.checkpoint import damage, fetch, restore
from tidal.worker.checkpoint.route import Load, Route


def zero2_checkpoint(root: Path, world: int) -> str:
    """Rank r lists its optimizer partition; rank 0 also the model states. Small real torch files."""
    path = root / "job" / "checkpoint_000000008"
    (path / "global_step8").mkdir(parents=True)
    (path / STATE_FILE).write_text(json.dumps({"step": 8, "world_size": world, "zero_stage": 2, "attempt": "a",
                                               "checkpoint_every": 8}))
    for rank in range(world):
        names = [f"global_step8/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"]
        if rank == 0:
            names.append("global_step8/mp_rank_00_model_states.pt")
        files = {}
        for rel in names:
            torch.save({"x": torch.full((4,), float(rank))}, path / rel)
            files[rel] = (path / rel).stat().st_size
        (path / manifest_name(rank)).write_text(json.dumps({"step": 8, "attempt": "a", "files": files}))
    return str(path)


class Engine:
    optimizer = None
    checkpoint_engine = None

    def load_checkpoint(self, load_dir: str, tag: str, **_: Any) -> tuple[str, dict]:
        return load_dir, {}


def requests(world: int, ranks: list[int], tmp: Path, monkeypatch) -> tuple[Counter, dict[int, Counter]]:
    """(rank 0's requests to choose and verify the checkpoint, each rank's requests to restore it)."""
    zero2_checkpoint(tmp / f"w{world}", world)
    handler = Counting()
    run = RunDir(str(tmp / f"w{world}"), "job")
    run.fs = pafs.PyFileSystem(handler)  # an object store's behaviour: not a LocalFileSystem
    found = run.latest_complete()
    assert found is not None and found.files is not None
    planning, handler.calls = handler.calls, Counter()
    per_rank = {}
    for rank in ranks:
        monkeypatch.setattr(restore, "_dp_rank", lambda engine, r=rank: r)
        monkeypatch.setenv(fetch.CACHE_ENV, str(tmp / f"cache-{world}-{rank}"))  # a node each
        restore.restore(Engine(), found, Route(Load.AS_SAVED))
        per_rank[rank], handler.calls = handler.calls, Counter()
    return planning, per_rank


def test_each_ranks_restore_requests_grow_with_its_own_files_not_the_world(tmp_path, group, monkeypatch):
    small_plan, small = requests(8, [1, 7], tmp_path, monkeypatch)
    big_plan, big = requests(64, [1, 33, 63], tmp_path, monkeypatch)

    own = sum(big[1].values())
    assert all(sum(c.values()) == own for c in [*small.values(), *big.values()]), (small, big)
    assert own <= 4 * 2, f"a rank's restore asks about its 2 files, a few requests each: {big[1]}"
    # Rank 0 reads every manifest once, and asks once about each listed file, at any world size.
    assert big_plan["read"] - small_plan["read"] == 64 - 8
    assert big_plan["info"] - small_plan["info"] <= 2 * (64 - 8)
    print(f"per-rank restore requests: {dict(big[1])} at 8 and 64 ranks; rank 0's listing: {dict(small_plan)} "
          f"at 8 ranks, {dict(big_plan)} at 64")


class FailingEngine(Engine):
    def load_checkpoint(self, load_dir: str, tag: str, **_: Any) -> tuple[str, dict]:
        raise RuntimeError("out of memory")  # a failure that proves nothing about the checkpoint


def failed_load_requests(world: int, rank: int, tmp: Path, monkeypatch) -> Counter:
    """Rank `rank`'s storage requests for a load that fails (DeepSpeed's load raises), the damage
    check included, of a `world`-rank checkpoint whose files are intact."""
    zero2_checkpoint(tmp / f"w{world}", world)
    handler = Counting()
    run = RunDir(str(tmp / f"w{world}"), "job")
    run.fs = pafs.PyFileSystem(handler)
    found = run.latest_complete()
    assert found is not None
    monkeypatch.setattr(restore, "_dp_rank", lambda engine: rank)
    monkeypatch.setattr(damage, "_checks_listing", lambda: rank == 0)
    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp / f"cache-{world}-{rank}"))
    handler.calls = Counter()
    with pytest.raises(CheckpointError, match="intact"):
        restore.restore(FailingEngine(), found, Route(Load.AS_SAVED))
    return handler.calls


def test_a_failed_load_checks_what_the_rank_read_and_the_listing_once(tmp_path, group, monkeypatch):
    """A failed load proves nothing until the files are checked: each rank checks the files it read,
    and only rank 0 the whole listing (every old rank's manifest), so a failed load's requests per
    rank do not grow with the old world (at 512 ranks, every rank reading every manifest on every
    restart was about 1.3 million requests)."""
    small, big = (failed_load_requests(world, 5, tmp_path, monkeypatch) for world in (8, 64))
    assert small == big, (small, big)
    assert sum(big.values()) <= 4 * 2 * 2, f"a rank's load and check of its 2 files: {big}"
    first = failed_load_requests(64, 0, tmp_path / "rank0", monkeypatch)
    assert first["read"] >= 64, f"rank 0 checks every manifest, once: {first}"
    print(f"a failed load's requests, rank 5 of 8 and of 64: {dict(small)}, {dict(big)}; rank 0 of 64: {dict(first)}")
