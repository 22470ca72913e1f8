"""A rank fetches only what it loads, once per node, into a cache that is bounded and cleaned up;
a rank waiting for rank 0's conversion fails clearly when rank 0 fails or dies. Real S3 API
(moto's server), real processes sharing a cache; no Ray."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from tests.conftest import ROOT, free_port
from tidal import fs
from tidal.errors import CheckpointError
from tidal.storage import QUARANTINE_FILE, STATE_FILE, Found, manifest_name
from tidal.worker.checkpoint import fetch, restore, universal
from tidal.worker.checkpoint.route import Load, Route

LISTED = {
    "mp_rank_00_model_states.pt": 10,
    "zero_pp_rank_0_mp_rank_00_optim_states.pt": 100,
    "zero_pp_rank_1_mp_rank_00_optim_states.pt": 101,
    "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt": 102,
    "zero_pp_rank_10_mp_rank_00_model_states.pt": 11,  # ZeRO-3 model states of rank 10, not 1
}


def test_a_rank_takes_its_own_partition_and_the_model_states():
    assert fetch.rank_files(LISTED, 1) == {
        "mp_rank_00_model_states.pt": 10,
        "zero_pp_rank_1_mp_rank_00_optim_states.pt": 101,
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt": 102,
    }
    assert set(fetch.rank_files(LISTED, 10)) == {"mp_rank_00_model_states.pt", "zero_pp_rank_10_mp_rank_00_model_states.pt"}


def test_a_universal_rank_takes_the_folders_of_the_parameters_it_holds():
    listed = {"mp_rank_00_model_states.pt": 1, "zero/optimizer_state.pt": 2, "zero/a.weight/fp32.pt": 3,
              "zero/a.weight/exp_avg.pt": 3, "zero/b.weight/fp32.pt": 4, "zero_pp_rank_1_mp_rank_00_model_states.pt": 5}
    assert set(fetch.rank_files(listed, 0, {"b.weight"})) == {
        "mp_rank_00_model_states.pt", "zero/optimizer_state.pt", "zero/b.weight/fp32.pt"}
    assert set(fetch.rank_files(listed, 0, None)) == set(listed) - {"zero_pp_rank_1_mp_rank_00_model_states.pt"}


def test_conversion_workers_follow_cpus_partitions_and_memory():
    gb = 2**30
    assert universal.workers(cpus=96, partitions=8, largest=10 * gb, available_mem=1000 * gb) == 8
    assert universal.workers(cpus=4, partitions=8, largest=10 * gb, available_mem=1000 * gb) == 4
    assert universal.workers(cpus=96, partitions=8, largest=10 * gb, available_mem=45 * gb) == 2
    assert universal.workers(cpus=96, partitions=8, largest=100 * gb, available_mem=10 * gb) == 1


def put(store: pafs.FileSystem, path: str, data: bytes) -> None:
    store.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with store.open_output_stream(path) as f:
        f.write(data)


def s3_checkpoint(bucket: str, files: dict[str, bytes]) -> Found:
    """A complete checkpoint of 2 ranks on S3 whose tag folder holds `files` (listed by rank 0)."""
    store, root = fs.resolve(f"{bucket}/runs/job/checkpoint_000000008")
    state = {"step": 8, "world_size": 2, "zero_stage": 2}
    put(store, f"{root}/{STATE_FILE}", json.dumps(state).encode())
    for rel, data in files.items():
        put(store, f"{root}/global_step8/{rel}", data)
    listed = {f"global_step8/{rel}": len(data) for rel, data in files.items()}
    put(store, f"{root}/{manifest_name(0)}", json.dumps({"step": 8, "files": listed}).encode())
    put(store, f"{root}/{manifest_name(1)}", json.dumps({"step": 8, "files": {}}).encode())
    return Found(root, store, state)


RANK_FETCH = """
import json, sys, time
from tidal import fs
from tidal.worker.checkpoint import fetch
store, root = fs.resolve(sys.argv[1])
files = json.loads(sys.argv[2])
with fetch.NodeCache(root, name="job") as cache:
    got = cache.fetch(store, root, files)
    print(json.dumps({"dir": cache.dir, "downloaded": got.downloaded, "reused": got.reused,
                      "read": {rel: open(cache.path(rel), "rb").read().decode() for rel in files}}), flush=True)
    time.sleep(float(sys.argv[3]))
"""


def run_rank(root_uri: str, files: dict[str, int], cache: Path, hold_s: float) -> subprocess.Popen:
    env = {**os.environ, fetch.CACHE_ENV: str(cache), "PYTHONPATH": f"{ROOT / 'platform'}:{ROOT}"}
    return subprocess.Popen([sys.executable, "-c", RANK_FETCH, root_uri, json.dumps(files), str(hold_s)],
                            stdout=subprocess.PIPE, text=True, env=env)


@pytest.mark.slow
def test_two_ranks_of_a_node_download_the_shared_file_once_and_clean_up(bucket, tmp_path):
    """Two rank processes on one node: each downloads its own partition, the model states are
    downloaded once between them, every byte read is the stored one, and the cache is gone after."""
    found = s3_checkpoint(bucket, {"mp_rank_00_model_states.pt": b"M" * 3000,
                                   "zero_pp_rank_0_mp_rank_00_optim_states.pt": b"0" * 5000,
                                   "zero_pp_rank_1_mp_rank_00_optim_states.pt": b"1" * 7000})
    listed = restore.tag_files(found, "global_step8")
    uri = f"{bucket}/runs/job/checkpoint_000000008/global_step8"
    ranks = [run_rank(uri, fetch.rank_files(listed, r), tmp_path / "cache", hold_s=1.0) for r in range(2)]
    out = [json.loads(p.communicate(timeout=120)[0]) for p in ranks]
    assert all(p.returncode == 0 for p in ranks)

    assert out[0]["dir"] == out[1]["dir"], "ranks of one node share one cache folder"
    for r in range(2):
        partition = f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        assert out[r]["downloaded"].get(partition) == listed[partition]
        assert f"zero_pp_rank_{1 - r}_mp_rank_00_optim_states.pt" not in out[r]["downloaded"] | out[r]["reused"]
        assert out[r]["read"][partition] == str(r) * listed[partition]
    model = "mp_rank_00_model_states.pt"
    assert sorted([model in out[0]["downloaded"], model in out[1]["downloaded"]]) == [False, True], "downloaded once"
    assert sum(sum(o["downloaded"].values()) for o in out) == sum(listed.values()), "no byte fetched twice"
    assert os.listdir(tmp_path / "cache") == [os.path.basename(out[0]["dir"])], "the node keeps its copy, one folder"

    again = run_rank(uri, fetch.rank_files(listed, 0), tmp_path / "cache", hold_s=0)
    reread = json.loads(again.communicate(timeout=120)[0])
    assert reread["downloaded"] == {} and reread["read"]["zero_pp_rank_0_mp_rank_00_optim_states.pt"] == "0" * 5000, \
        "a restart on the same node reads the node's copy, nothing from storage"


@pytest.mark.slow
def test_the_fetched_folder_holds_exactly_the_fetched_files(bucket, tmp_path):
    """DeepSpeed's converter lists a step folder by file-name prefix (`mp_rank_`, `zero_pp_rank_`):
    a lock or part file beside a data file was taken for one (`EOFError: Ran out of input` on
    the 0-byte `mp_rank_00_model_states.pt.lock`, every restart; found by the combined chaos run)."""
    found = s3_checkpoint(bucket, {"mp_rank_00_model_states.pt": b"M" * 300,
                                   "zero_pp_rank_0_mp_rank_00_optim_states.pt": b"0" * 500})
    listed = {f"global_step8/{rel}": size for rel, size in restore.tag_files(found, "global_step8").items()}
    with fetch.NodeCache("k", root=str(tmp_path)) as cache:
        cache.fetch(found.fs, found.path, listed)
        cache.fetch(found.fs, found.path, listed)  # again, as a peer rank of the node does
        assert sorted(os.listdir(cache.path("global_step8"))) == sorted(rel.split("/")[1] for rel in listed)


def test_a_cache_left_by_a_killed_rank_is_removed_by_the_next_restore(tmp_path):
    stale = tmp_path / f"{fetch.PREFIX}job-dead"
    (stale / "global_step8").mkdir(parents=True)
    (stale / "global_step8" / "x.pt.123.part").write_bytes(b"half")
    (stale / fetch.INUSE).touch()
    with fetch.NodeCache("some/other/checkpoint", root=str(tmp_path)) as cache:
        assert not stale.exists(), "nobody held it: swept"
        assert os.path.isdir(cache.dir)
    assert os.listdir(tmp_path) == [os.path.basename(cache.dir)], "kept for the node's next restore"
    with fetch.NodeCache("a/newer/checkpoint", root=str(tmp_path)) as newer:
        assert os.listdir(tmp_path) == [os.path.basename(newer.dir)], "bounded: the older copy went"


def test_a_ranks_own_copy_cut_short_is_never_taken_and_is_written_again_whole(tmp_path):
    """A direct resize's and a ZeRO-3 share's per-rank copies (fetch.write_once): a process killed while
    writing (its `.part` left behind), a write that fails, and a write of the wrong size leave nothing
    the next restore takes for the file; the next restore writes it and reuses it after."""
    dst = str(tmp_path / "global_step8" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    os.makedirs(os.path.dirname(dst))
    Path(f"{dst}.99999.part").write_bytes(b"half of it")  # a killed process's, at another pid

    def cut(part: str) -> int:
        Path(part).write_bytes(b"half")
        raise OSError("connection reset by peer")

    with pytest.raises(OSError, match="reset"):
        fetch.write_once(dst, 8, "s3://b/x", cut)
    assert not os.path.exists(dst) and not os.path.exists(f"{dst}.{os.getpid()}.part")
    with pytest.raises(CheckpointError, match="s3://b/x's size differs from its manifest's 8 bytes"):
        fetch.write_once(dst, 8, "s3://b/x", lambda part: Path(part).write_bytes(b"short"))
    assert not os.path.exists(dst)
    assert fetch.write_once(dst, 8, "s3://b/x", lambda part: Path(part).write_bytes(b"12345678") and 3) == 3
    assert Path(dst).read_bytes() == b"12345678"
    assert fetch.write_once(dst, 8, "s3://b/x", cut) is None, "this node's copy, reused"


def test_a_cache_in_use_by_another_rank_is_kept(tmp_path):
    cache = fetch.NodeCache("a/checkpoint", root=str(tmp_path))
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time; os.makedirs(sys.argv[1], exist_ok=True); "
        "f = open(os.path.join(sys.argv[1], '.inuse'), 'a'); fcntl.flock(f, fcntl.LOCK_SH); "
        "print('held', flush=True); time.sleep(60)"), cache.dir], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert fetch.sweep(str(tmp_path)) == []
        assert os.path.isdir(cache.dir)
    finally:
        holder.kill()
        holder.wait()
    assert fetch.sweep(str(tmp_path)) == [cache.dir]


def test_another_users_cache_folder_in_a_shared_temp_dir_is_left_alone(tmp_path):
    """The restore cache's default root is the temp dir every user of a node shares: a cache folder
    there that another Unix user made (0700, theirs) is neither a failure of this user's restore nor
    this user's to remove, whoever runs the sweep (a plain user, whom its lock file refuses; root,
    whom nothing refuses). Real users: a forked process drops to another uid (needs root)."""
    if os.geteuid() != 0:
        pytest.skip("making another user's folder, and becoming another user, needs root")
    shared = Path(tempfile.mkdtemp(dir="/tmp"))  # under /tmp: pytest's own folders are root's only
    try:
        shared.chmod(0o1777)  # as /tmp is
        theirs = shared / f"{fetch.PREFIX}job-0123456789abcdef"
        theirs.mkdir(mode=0o700)
        for f in (theirs / fetch.INUSE, theirs / "copy.pt"):
            f.write_bytes(b"theirs")
            os.chown(f, 4242, 4242)
        os.chown(theirs, 4242, 4242)
        pid = os.fork()
        if pid == 0:  # another user of the node, restoring with the default cache root
            code = 1
            try:
                os.setgid(4343)
                os.setuid(4343)
                with fetch.NodeCache("my/checkpoint", name="mine", root=str(shared)):
                    code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "a plain user's restore failed on another user's folder"
        assert fetch.sweep(str(shared)) == [], "root swept another user's folder"
        assert (theirs / "copy.pt").read_bytes() == b"theirs"
    finally:
        shutil.rmtree(shared, ignore_errors=True)


@pytest.mark.slow
def test_too_little_local_disk_is_a_clear_error_and_the_checkpoint_is_kept(bucket, tmp_path, monkeypatch):
    """A node whose disk cannot hold the rank's files: the error names the folder and the bytes,
    nothing is downloaded, and the checkpoint is not quarantined. (The free space is reported
    small: a full disk cannot be made here.)"""
    import torch.distributed as dist

    found = s3_checkpoint(bucket, {"mp_rank_00_model_states.pt": b"M" * 3000,
                                   "zero_pp_rank_0_mp_rank_00_optim_states.pt": b"0" * 5000})
    real = fetch.shutil.disk_usage
    monkeypatch.setattr(fetch.shutil, "disk_usage", lambda p: real(p)._replace(free=4000))
    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "cache"))

    class Engine:
        optimizer = None
        loaded = False

        def load_checkpoint(self, *a, **k):
            Engine.loaded = True
            return None, None

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with pytest.raises(fetch.LocalDiskFull) as e:
            restore.restore(Engine(), found, Route(Load.AS_SAVED))
    finally:
        dist.destroy_process_group()
    assert "8,000 bytes" in str(e.value) and str(tmp_path / "cache") in str(e.value) and "kept" in str(e.value)
    assert not Engine.loaded
    assert not fs.exists(found.fs, f"{found.path}/{QUARANTINE_FILE}")
    assert not [p for p in (tmp_path / "cache").rglob("*.pt")], "nothing was downloaded"


def test_a_waiting_rank_fails_clearly_when_rank_0s_conversion_failed(tmp_path):
    found = Found(str(tmp_path / "ck"), pafs.LocalFileSystem(), {"step": 8, "world_size": 1})
    universal.prepare(found, "global_step8")
    fs.write_json(found.fs, f"{found.path}/{universal.status_name('global_step8')}",
                  {"state": "failed", "beats": 3, "error": "CheckpointError: exit -9"})
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match="rank 0 could not convert ck.*exit -9"):
        universal.ensure(found, "global_step8", rank=1)
    assert time.monotonic() - t0 < 10


@pytest.mark.slow
def test_a_waiting_rank_fails_clearly_when_rank_0_stops_reporting(tmp_path, monkeypatch):
    monkeypatch.setattr(universal, "STALE_S", 1.0)
    monkeypatch.setattr(universal, "POLL_S", 0.1)
    found = Found(str(tmp_path / "ck"), pafs.LocalFileSystem(), {"step": 8, "world_size": 1})
    universal.prepare(found, "global_step8")  # rank 0 began, then died: no beat follows
    with pytest.raises(CheckpointError, match="reported nothing for 1 s"):
        universal.ensure(found, "global_step8", rank=1)


def test_a_waiting_rank_returns_once_the_conversion_is_published(tmp_path):
    found = Found(str(tmp_path / "ck"), pafs.LocalFileSystem(), {"step": 8, "world_size": 1})
    universal.prepare(found, "global_step8")
    out = tmp_path / "out"
    (out / "zero").mkdir(parents=True)
    (out / "zero" / "optimizer_state.pt").write_bytes(b"x" * 10)
    fs.publish_dir(str(out), found.fs, f"{found.path}/global_step8_universal",
                   f"{found.path}/{universal.marker('global_step8')}")
    assert universal.ensure(found, "global_step8", rank=1) == "global_step8_universal"
