"""The run folder behaves the same on a local path and on a real S3 API (moto's server): which
checkpoint resumes, set-aside on --restart, retention, published conversions, the metrics buffer.
No Ray: these run in seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import STORAGES, ray_registers
from tidal import fs
from tidal.spec.job import JobSpec
from tidal.storage import STATE_FILE, RunDir, checkpoint_dir_name, manifest_name, prune_plan
from tidal.tracking.buffer import MetricsBuffer


@pytest.fixture(params=STORAGES)
def root(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "store")
    return request.getfixturevalue("bucket") + "/store"


def put(store, path: str, data: bytes) -> None:
    store.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with store.open_output_stream(path) as f:
        f.write(data)


def fake_checkpoint(root: str, job: str, step: int, world: int = 2, complete: bool = True) -> str:
    """A checkpoint folder as `worker.checkpoint.save` leaves it, written through pyarrow."""
    run = RunDir(root, job)
    path = f"{run.path}/{checkpoint_dir_name(step)}"
    state = json.dumps({"step": step, "world_size": world, "fingerprint": JobSpec().resume_fingerprint()}).encode()
    put(run.fs, f"{path}/{STATE_FILE}", state)
    for rank in range(world if complete else world - 1):
        name = f"global_step{step}/zero_pp_rank_{rank}_optim_states.pt"
        put(run.fs, f"{path}/{name}", b"x" * (100 + rank))
        files = {name: 100 + rank, **({STATE_FILE: len(state)} if rank == 0 else {})}
        put(run.fs, f"{path}/{manifest_name(rank)}", json.dumps({"step": step, "files": files}).encode())
    return path


def test_newest_complete_checkpoint_resumes(root):
    for step in (10, 20):
        fake_checkpoint(root, "job", step)
    fake_checkpoint(root, "job", 30, complete=False)  # a rank died while writing
    found = RunDir(root, "job").latest_complete(warn=False)
    assert found is not None and found.step == 20


def test_restart_sets_the_run_aside_whole(root):
    for step in (10, 20):
        fake_checkpoint(root, "job", step)
    run = RunDir(root, "job")
    before = fs.files_under(run.fs, run.path)
    aside = run.set_aside()
    assert aside is not None and not run.exists()
    assert fs.files_under(run.fs, aside) == before
    assert RunDir(root, "job").latest_complete() is None  # a fresh start
    assert RunDir(root, "never-ran").set_aside() is None


def test_retention_deletes_what_ray_never_registers_and_leaves_it_the_rest(root):
    for step in (10, 20):  # complete, from an earlier launch whose driver died before Ray registered them
        fake_checkpoint(root, "job", step)
    run = RunDir(root, "job")
    assert run.prune(keep=1) == [], "nothing is known to be behind Ray before it registers anything"
    for step in (30, 40, 50):  # this launch: written asynchronously, ahead of Ray's registration
        fake_checkpoint(root, "job", step)
    fake_checkpoint(root, "job", 60, complete=False)  # in flight: never touched
    register = ray_registers(run, keep=1)
    register(30)
    deleted = run.prune(keep=1)  # what Tidal's Retention callback does after each registration
    assert sorted(p.rsplit("/", 1)[-1] for p in deleted) == [checkpoint_dir_name(s) for s in (10, 20)]
    for step in (40, 50):  # 40 and 50 were complete but not yet registered: Ray finds them and deletes 30, 40
        register(step)
        run.prune(keep=1)
    left = sorted(p.rsplit("/", 1)[-1] for p in run.checkpoints())
    assert left == [checkpoint_dir_name(s) for s in (50, 60)]


def test_prune_plan_never_touches_anything_newer_than_the_oldest_kept():
    complete = {"c60": False, "c50": True, "c40": False, "c30": True, "c20": True, "c10": False}
    checked: list[str] = []

    def is_complete(p: str) -> bool:
        checked.append(p)
        return complete[p]

    newest_first = list(complete)
    assert prune_plan(newest_first, is_complete, keep=2) == ["c20", "c10"]
    assert checked == ["c60", "c50", "c40", "c30"], "what is deleted anyway is not checked"
    assert prune_plan(newest_first, complete.get, keep=3) == ["c10"]
    assert prune_plan(newest_first, complete.get, keep=4) == []


def test_a_conversion_counts_only_once_its_marker_is_written(root, tmp_path):
    local = tmp_path / "converted"
    (local / "zero" / "w").mkdir(parents=True)
    (local / "zero" / "w" / "fp32.pt").write_bytes(b"y" * 64)
    (local / "mp_rank_00_model_states.pt").write_bytes(b"z" * 32)
    store, base = fs.resolve(root)
    out, marker = f"{base}/ck/global_step5_universal", f"{base}/ck/tidal-universal-global_step5.json"
    fs.upload_dir(str(local), store, out)  # the copy made it, the marker did not: not trusted
    assert not fs.published(store, out, marker)
    fs.publish_dir(str(local), store, out, marker)
    assert fs.published(store, out, marker)
    store.delete_file(f"{out}/zero/w/fp32.pt")  # a file lost afterwards: not trusted either
    assert not fs.published(store, out, marker)
    with fs.local_copy(store, out) as copy:  # what a rank loads from: the folder, or its own download
        assert (Path(copy) / "mp_rank_00_model_states.pt").read_bytes() == b"z" * 32


def test_metrics_buffer_survives_its_writer(root):
    run = RunDir(root, "job")
    first = MetricsBuffer(run.fs, run.path)
    entries = [first.append({"step": s, "values": {"loss": 1.0 / s}, "ts": s}) for s in (3, 1, 2)]
    again = MetricsBuffer(run.fs, run.path)  # a new driver after the first died
    assert [e["step"] for e in again.load()] == [1, 2, 3]
    again.forget([e for e in entries if e["step"] != 2])
    assert [e["step"] for e in MetricsBuffer(run.fs, run.path).load()] == [2]


def test_job_file_write_is_whole(root):
    run = RunDir(root, "job")
    run.write_json("tidal-job.json", {"mlflow_run_id": "a" * 32})
    run.write_json("tidal-job.json", {"mlflow_run_id": "b" * 32})
    assert run.read_json("tidal-job.json") == {"mlflow_run_id": "b" * 32}
    assert [i.base_name for i in fs.list_dir(run.fs, run.path)] == ["tidal-job.json"]  # no temporary left
