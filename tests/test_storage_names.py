"""A name read from storage never reaches outside its folder: a manifest, a conversion's marker or
a shard index naming `global_stepN/../../x` or an absolute path makes the checkpoint damaged
(skipped, and quarantined by the driver), and nothing is read or written there. On local storage
and on a real S3 API (moto's server, whose client pyarrow normalises `..` in keys); no Ray."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from tests.helpers import STORAGES
from tidal import fs
from tidal.errors import CheckpointError, TidalError
from tidal.storage import (
    QUARANTINE_FILE,
    STATE_FILE,
    UNSAFE,
    Found,
    RunDir,
    check_complete,
    listed_files,
    manifest_name,
)
from tidal.worker.checkpoint import fetch, universal

BAD = ["global_step8/../../x", "/etc/passwd", "global_step8/./a.pt", "", "global_step8//a.pt", "..",
       "C:/x", "global_step8\\..\\..\\x"]


@pytest.mark.parametrize("name", BAD)
def test_names_that_could_leave_their_folder_are_refused(name):
    with pytest.raises(fs.UnsafeName):
        fs.check_name(name)
    with pytest.raises(fs.UnsafeName):
        fs.checked_files({name: 1})


def test_plain_names_pass_and_sizes_must_be_byte_counts():
    assert fs.check_name("global_step8/zero/blocks.0.attn.weight/fp32.pt") == "global_step8/zero/blocks.0.attn.weight/fp32.pt"
    assert fs.checked_files({"a.pt": 0, "b/c.pt": 5}) == {"a.pt": 0, "b/c.pt": 5}
    for size in (-1, "5", 1.5, None, True):
        with pytest.raises(fs.UnsafeName):
            fs.checked_files({"a.pt": size})


def test_a_link_planted_in_a_folder_cannot_lead_outside(tmp_path):
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "out").symlink_to(tmp_path)
    with pytest.raises(fs.UnsafeName, match="outside"):
        fs.join_local(str(tmp_path / "root"), "out/x")
    assert fs.join_local(str(tmp_path / "root"), "a/b") == str(tmp_path / "root" / "a" / "b")


def put(store: pafs.FileSystem, path: str, data: bytes) -> None:
    store.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with store.open_output_stream(path) as f:
        f.write(data)


def write_checkpoint(store: pafs.FileSystem, run: str, step: int, extra: dict[str, int] | None = None) -> str:
    """A complete checkpoint of 2 ranks; `extra` names go into rank 1's manifest."""
    path = f"{run}/checkpoint_{step:09d}"
    put(store, f"{path}/{STATE_FILE}", json.dumps({"step": step, "world_size": 2, "zero_stage": 2}).encode())
    for rank in range(2):
        rel = f"global_step{step}/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        put(store, f"{path}/{rel}", b"x" * 10)
        files = {rel: 10, **((extra or {}) if rank == 1 else {})}
        put(store, f"{path}/{manifest_name(rank)}", json.dumps({"step": step, "files": files}).encode())
    return path


@pytest.fixture(params=STORAGES)
def run_dir(request, tmp_path) -> RunDir:
    if request.param == "local":
        return RunDir(str(tmp_path / "runs"), "job")
    return RunDir(f"{request.getfixturevalue('bucket')}/runs", "job")


@pytest.mark.parametrize("name", ["global_step8/../../x", "/x"])
def test_a_manifest_naming_a_file_outside_its_checkpoint_makes_it_damaged(run_dir, name):
    """The object the name points at exists (on S3, `ck/global_step8/../../x` is `run/x`), so
    before the check the checkpoint counted as complete and the name was joined to local paths."""
    write_checkpoint(run_dir.fs, run_dir.path, 4)
    bad = write_checkpoint(run_dir.fs, run_dir.path, 8, {name: 3})
    put(run_dir.fs, f"{run_dir.path}/x", b"abc")  # where `..` leads on S3

    problem, _ = check_complete(run_dir.fs, bad)
    assert problem is not None and problem.endswith(UNSAFE) and repr(name) in problem
    assert listed_files(run_dir.fs, bad) == {}, "nothing of it is ever read"
    found = run_dir.latest_complete(condemn_truncated=True)  # the driver, at start
    assert found is not None and found.step == 4, "the job goes on from the checkpoint before"
    marker = fs.read_json(run_dir.fs, f"{bad}/{QUARANTINE_FILE}")
    assert marker is not None and UNSAFE in marker["error"]


def test_the_node_cache_never_writes_outside_its_folder(tmp_path):
    src = tmp_path / "storage"
    (src / "global_step8").mkdir(parents=True)
    (tmp_path / "x").write_bytes(b"abc")
    with fetch.NodeCache("k", root=str(tmp_path / "cache")) as cache:
        for name in ("global_step8/../../x", str(tmp_path / "x")):
            with pytest.raises(fs.UnsafeName):
                cache.fetch(pafs.LocalFileSystem(), str(src), {name: 3})
            with pytest.raises(fs.UnsafeName):
                fetch.rank_files({name: 3}, 0)
    written = sorted(p.name for p in tmp_path.rglob("*") if p.is_file() and p.name != fetch.INUSE)
    assert written == ["x"], f"nothing was fetched anywhere: {written}"


def test_a_private_copy_refuses_names_outside(tmp_path):
    with pytest.raises(fs.UnsafeName), fs.local_files(pafs.LocalFileSystem(), str(tmp_path), ["a/../../x"]):
        pass


def test_a_conversion_whose_marker_names_a_file_outside_is_discarded(run_dir):
    path = write_checkpoint(run_dir.fs, run_dir.path, 8)
    found = Found(path, run_dir.fs, {"step": 8, "world_size": 2})
    put(run_dir.fs, f"{path}/global_step8_universal/zero/optimizer_state.pt", b"o" * 4)
    put(run_dir.fs, f"{run_dir.path}/x", b"abc")
    fs.write_json(run_dir.fs, f"{path}/{universal.marker('global_step8')}",
                  {"files": {"zero/optimizer_state.pt": 4, "../../../x": 3}})
    assert not universal.ready(found, "global_step8")
    with pytest.raises(CheckpointError, match="discarded"):
        universal.published(found, "global_step8")
    assert not fs.exists(run_dir.fs, f"{path}/{universal.marker('global_step8')}"), "made again next attempt"


def test_a_shard_index_naming_a_file_outside_is_refused(tmp_path: Path):
    from tidal.worker.stream import INDEX_FILE, ShardReader

    (tmp_path / INDEX_FILE).write_text(json.dumps({"shards": ["../secret.npy"], "counts": [1]}))
    with pytest.raises(TidalError, match="outside its folder"):
        ShardReader(str(tmp_path))
