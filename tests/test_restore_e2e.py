"""Restores end to end through Ray Train and real DeepSpeed engines: from S3 a 2-worker restore
reads each file of the checkpoint once (each rank its own partition, the model states once for
the node), counted by the S3 server itself, and a worker killed afterwards restores from its
node's copy with zero bytes from S3; a resize's conversion killed half-way is made again by the
next attempt, which loads it, while the waiting rank never sat in a collective; a pickle planted in
that published conversion never runs when a later start loads it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import tidal
from tests.conftest import metric_history, moto_s3, tiny_spec
from tests.fakes import evil
from tests.golden import reference_losses
from tests.helpers import run_killing_a_worker
from tests.slow_step import slow_env
from tidal import fs
from tidal.storage import QUARANTINE_FILE, RunDir, checkpoint_dir_name, listed_files
from tidal.worker.checkpoint import fetch, universal

pytestmark = [pytest.mark.slow]


@pytest.fixture
def recorded_s3(tmp_path_factory) -> Iterator[str]:
    """moto's S3 server with its request recorder (every request's method, URL and headers)."""
    folder = tmp_path_factory.mktemp("moto-rec")
    with moto_s3(folder / "moto.log", {"MOTO_RECORDER_FILEPATH": str(folder / "recording.jsonl")}) as endpoint:
        yield endpoint


@pytest.fixture
def ray_here(recorded_s3, _ray_session) -> Iterator[None]:
    """For one test, a Ray instance whose workers find the recording S3 server (the session's shared
    one is stopped first: its workers name the session's server; the next `ray_local` starts it again)."""
    import ray

    _ray_session.stop()
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


def recorder(endpoint: str, action: str) -> str:
    method = "GET" if action == "download-recording" else "POST"
    req = urllib.request.Request(f"{endpoint}/moto-api/recorder/{action}", method=method)
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read().decode()


def bytes_read(recording: str, folder: str, sizes: dict[str, int]) -> dict[str, int]:
    """Bytes the server sent for each object under `folder` (key suffix -> bytes), from its GETs."""
    got: dict[str, int] = {}
    for line in recording.splitlines():
        entry = json.loads(line)
        path = urllib.parse.unquote(urllib.parse.urlsplit(entry["url"]).path)
        if entry["method"] != "GET" or f"/{folder}/" not in path:
            continue
        rel = path.split(f"/{folder}/", 1)[1]
        rng = {k.lower(): v for k, v in entry["headers"].items()}.get("range")
        if rng:
            first, last = rng.removeprefix("bytes=").split("-")
            n = min(int(last), sizes[rel] - 1) - int(first) + 1
        else:
            n = sizes[rel]
        got[rel] = got.get(rel, 0) + n
    return got


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): requests per rank are counted in test_restore_scale and test_restore_fetch
def test_a_two_worker_restore_from_s3_reads_each_file_once(tmp_path, recorded_s3, ray_here):
    """Each rank reads its own ZeRO partition, and the model states are read once for the node:
    the checkpoint's bytes cross the network once, where every rank used to read all of them.
    Then a worker is killed before the next checkpoint: its node lived, so the restart restores
    from the node's copy and reads nothing more from S3 (it used to download the rank's state again)."""
    import boto3

    bucket = f"tidal-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    spec = tiny_spec(tmp_path, name="fetch", **{"train.steps": 16, "checkpoint.every_steps": 8,
                                                "checkpoint.storage": f"s3://{bucket}/runs",
                                                "train.step_fn": "tests.slow_step:step"},
                     worker_env={fetch.CACHE_ENV: str(tmp_path / "cache"), **slow_env(0.5)})
    tidal.run(spec.with_overrides({"train.stop_at": 8}))
    run = RunDir(spec.checkpoint.storage, spec.name)
    ckpt = f"{run.path}/{checkpoint_dir_name(8)}"
    tag = {rel.removeprefix("global_step8/"): size for rel, size in listed_files(run.fs, ckpt).items()
           if rel.startswith("global_step8/")}
    partitions = sorted(rel for rel in tag if "optim_states" in rel)
    assert len(partitions) == 2 and "mp_rank_00_model_states.pt" in tag

    recorder(recorded_s3, "reset-recording")
    recorder(recorded_s3, "start-recording")
    try:
        result, killed = run_killing_a_worker(spec, after_step=10)
    finally:
        recorder(recorded_s3, "stop-recording")
    read = bytes_read(recorder(recorded_s3, "download-recording"), f"{checkpoint_dir_name(8)}/global_step8", tag)

    assert killed and result.error is None, result.error
    assert sorted(metric_history(spec, result.mlflow_run_id, "loss")) == list(range(1, 17))
    assert metric_history(spec, result.mlflow_run_id, "restarts")[16] >= 1
    assert metric_history(spec, result.mlflow_run_id, "steps_lost")[16] > 0, "the restart resumed from step 8 again"
    needed = {rel: size for rel, size in tag.items() if rel.endswith(".pt")}
    assert read == needed, f"each file read exactly once for the node, over both restores; read {read}, sizes {tag}"
    whole = sum(tag.values())
    print(f"two restores read {sum(read.values())} bytes of a {whole}-byte step folder for 2 ranks on one node "
          f"(partitions {[tag[p] for p in partitions]}, model states {tag['mp_rank_00_model_states.pt']})")
    assert len(list((tmp_path / "cache").iterdir())) == 1, "the node keeps one checkpoint's copy"


class Killer:
    """Kills this test's first universal conversion process (a descendant of this process) once,
    when its log under `cache` shows it extracting, or `after_s` after it started: half-way."""

    def __init__(self, cache: Path, after_s: float = 5.0) -> None:
        self.cache, self.after_s, self.killed = cache, after_s, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me, seen = psutil.Process(), None
        while not self.stop.wait(0.05):
            procs = converters(me)
            if not procs:
                continue
            seen = seen or time.monotonic()
            logs = [p.read_text(errors="replace") for p in self.cache.rglob("convert.log")]
            if any("Extracting" in text for text in logs) or time.monotonic() - seen > self.after_s:
                os.kill(procs[0].pid, signal.SIGKILL)
                self.killed.append(procs[0].pid)
                return

    def __enter__(self) -> Killer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def converters(me: psutil.Process) -> list[psutil.Process]:
    found = []
    for p in me.children(recursive=True):
        try:
            if "tidal.worker.checkpoint.universal" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:
            pass
    return found


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): a ZeRO-1/2 or -3 resize loads by byte range (test_chaos, test_elastic, test_user_code_e2e); the conversion left for the rest is tested in test_universal_spread
def test_a_conversion_killed_half_way_is_made_again_and_loads(tmp_path, ray_local):
    """1 worker to step 6, then 2 workers: rank 0 converts while rank 1 waits on storage; the
    conversion is killed; the attempt fails, the next converts again, and training goes on with
    the losses of a run that never resized. Nothing is quarantined, nothing is left running."""
    # A resize converts only when asked to (checkpoint.resize) or for a checkpoint a direct one does not cover
    common = {"train.steps": 12, "checkpoint.every_steps": 6, "parallelism.zero_stage": 3, "checkpoint.resize": "universal"}
    # the undisturbed run's losses, stored (tests/golden.py regenerates them)
    expected = reference_losses("restore-e2e-steady3", tiny_spec(tmp_path, name="steady", **common))

    spec = tiny_spec(tmp_path, name="killed", **common, worker_env={fetch.CACHE_ENV: str(tmp_path / "cache")})
    tidal.run(spec.with_overrides({"train.stop_at": 6, "scaling.min_workers": 1, "scaling.max_workers": 1}))
    with Killer(tmp_path / "cache") as killer:
        result = tidal.run(spec)

    assert killer.killed, "a conversion was running and was killed"
    got = metric_history(spec, result.mlflow_run_id, "loss")
    assert sorted(got) == list(range(1, 13))
    for step in range(1, 13):
        assert got[step] == pytest.approx(expected[step], rel=1e-4), step
    assert metric_history(spec, result.mlflow_run_id, "restarts")[12] >= 1, "the killed attempt failed"
    run = RunDir(spec.checkpoint.storage, spec.name)
    ckpt = f"{run.path}/{checkpoint_dir_name(6)}"
    assert fs.published(run.fs, f"{ckpt}/global_step6_universal", f"{ckpt}/{universal.marker('global_step6')}")
    status = fs.read_json(run.fs, f"{ckpt}/{universal.status_name('global_step6')}")
    assert status is not None and status["state"] == "done"
    assert not [rel for rel in fs.files_under(run.fs, run.path) if QUARANTINE_FILE in rel]
    assert not converters(psutil.Process()), "no conversion process outlived its attempt"
    left = [p.name for p in (tmp_path / "cache").iterdir()]
    assert len(left) == 1 and "convert" not in left[0], f"the conversion's folders were removed: {left}"

    # A later start at this size reads the published conversion again. DeepSpeed's universal loader
    # unpickles every `zero/<param>/*.pt` without weights-only; on a local (or NFS) path it was once
    # handed the storage folder, where a pickle planted beside the fragments ran.
    marker = tmp_path / "ran"
    params = [p for p in (Path(ckpt) / "global_step6_universal" / "zero").iterdir() if p.is_dir()]
    assert params, "the resize published a universal folder"
    for param in params:
        (param / "planted.pt").write_bytes(evil(marker))
    # Step 12 set aside by hand: the next start resumes from step 6 (written by 1 worker) through it.
    (Path(run.path) / checkpoint_dir_name(12) / QUARANTINE_FILE).write_text('{"error": "set aside by the test"}')
    again = tidal.run(spec)
    assert not marker.exists(), "the planted pickle ran"
    assert again.error is None, again.error
    assert metric_history(spec, again.mlflow_run_id, "world_size")[7] == 2


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): the decision is a row of tests/test_route.py's table
def test_a_zero3_checkpoint_cut_at_another_sub_group_size_loads_through_the_conversion(tmp_path, ray_local):
    """2 workers to step 6 with DeepSpeed's default ZeRO-3 sub-groups, then 1 worker with
    `sub_group_size` 4096 (the partitions cut into many sub-groups): neither a by-range load nor
    DeepSpeed's own can read partitions cut otherwise, and each attempt failed on them until the
    restarts ran out. Now the resume converts, and the losses are those of a run that never changed."""
    common = {"train.steps": 12, "checkpoint.every_steps": 6, "parallelism.zero_stage": 3}
    # the undisturbed run's losses, stored (tests/golden.py regenerates them)
    expected = reference_losses("restore-e2e-steady3", tiny_spec(tmp_path, name="steady", **common,
                                                                 **{"checkpoint.resize": "universal"}))
    spec = tiny_spec(tmp_path, name="recut", **common)
    tidal.run(spec.with_overrides({"train.stop_at": 6}))
    recut = spec.with_overrides({"parallelism.deepspeed": {"zero_optimization": {"sub_group_size": 4096}},
                                 "scaling.min_workers": 1, "scaling.max_workers": 1, "failure.max_restarts": 0})
    result = tidal.run(recut)
    assert result.error is None, result.error
    got = metric_history(recut, result.mlflow_run_id, "loss")
    assert sorted(got) == list(range(1, 13))
    for step in range(7, 13):
        assert got[step] == pytest.approx(expected[step], rel=1e-4), step
    ckpt = RunDir(spec.checkpoint.storage, spec.name)
    assert fs.published(ckpt.fs, f"{ckpt.path}/{checkpoint_dir_name(6)}/global_step6_universal",
                        f"{ckpt.path}/{checkpoint_dir_name(6)}/{universal.marker('global_step6')}"), "it converted"
