"""Every writer of a superseded attempt writes nothing (tidal/lease.py): its checkpoint manifests,
its event log, its tracker's MLflow writes; and the step plan ends its group at once. Each against
a real lease folder taken over by a newer generation, without Ray."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch
from mlflow.tracking import MlflowClient

from tests.conftest import tiny_spec
from tidal.lease import Lease
from tidal.storage import STATE_FILE, RunDir, check_complete, manifest_name
from tidal.testing.runs import metric_history
from tidal.tracking.buffer import MetricsBuffer
from tidal.tracking.emitter import Emitter
from tidal.tracking.tracker import Tracker
from tidal.worker import plan
from tidal.worker.checkpoint.snapshot import write_checkpoint
from tidal.worker.logsync import LogSync

STEP = {"loss": 1.0, "tokens_per_s": 1.0, "samples_per_s": 1.0, "mfu": 0.1, "world_size": 2}


def superseded(storage: str, name: str) -> tuple[Lease, Lease]:
    """(the old driver's lease, the newer one's): the old stopped renewing and was taken over."""
    old = Lease(storage, name, ttl=0.01)
    old.acquire()
    time.sleep(0.05)
    new = Lease(storage, name, ttl=30)
    new.acquire()
    return old, new


def test_a_superseded_step_plans_nothing_and_ends_the_group():
    cadence = plan.Cadence(log_every=1, checkpoint_every=4, eval_every=4, last=100)
    due = plan.due(8, cadence, False)
    p = plan.plan_step(due, cadence, preempted=True, async_upload=True, resize=True, superseded=True)
    assert (p.log, p.checkpoint, p.evaluate, p.drain, p.end) == (False, False, False, False, "superseded")
    assert plan.plan_step(due, cadence, False, True).end is None


def test_rank_zeros_word_on_the_lease_is_what_every_rank_agrees():
    rows = [[1.0, 1, -1.0, 0.0, 0.0, -1.0, 1.0], [1.0, 1, -1.0, 0.0, 0.0, -1.0, 0.0]]
    assert LogSync().agree(rows).superseded
    assert not LogSync().agree([rows[1], rows[0]]).superseded  # only rank 0 checks the lease


def test_a_superseded_attempts_save_writes_no_manifest_and_keeps_the_newer_ones(tmp_path: Path):
    storage = str(tmp_path / "runs")
    old, _ = superseded(storage, "job")
    check = old.check()
    dest = tmp_path / "runs" / "job" / "checkpoint_000000004"
    dest.mkdir(parents=True)
    (dest / manifest_name(0)).write_text('{"step": 4, "attempt": "newer", "files": {}}')
    local = tmp_path / "local"
    (local / "global_step4").mkdir(parents=True)
    (local / STATE_FILE).write_text('{"step": 4, "world_size": 1}')
    taken = {"global_step4/mp_rank_00_model_states.pt": {"module": {"w": torch.ones(4)}}}

    written = write_checkpoint(local, taken, pafs.LocalFileSystem(), str(dest), 0, 4, True,
                               attempt="old", may_write=check.current)
    assert written == {}
    assert (dest / manifest_name(0)).read_text() == '{"step": 4, "attempt": "newer", "files": {}}'
    assert not (dest / "global_step4").exists()


def test_a_save_superseded_during_its_write_leaves_it_incomplete(tmp_path: Path):
    storage = str(tmp_path / "runs")
    old = Lease(storage, "job", ttl=0.01)
    old.acquire()
    check = old.check()
    dest = tmp_path / "runs" / "job" / "checkpoint_000000004"
    local = tmp_path / "local"
    local.mkdir()
    (local / STATE_FILE).write_text('{"step": 4, "world_size": 1}')
    answers = iter([True, False])  # owner before the files, superseded before the manifest
    write_checkpoint(local, {}, pafs.LocalFileSystem(), str(dest), 0, 4, True, attempt="old",
                     may_write=lambda: next(answers) and check.current(fresh=True))
    assert (dest / STATE_FILE).exists() and not (dest / manifest_name(0)).exists()
    assert check_complete(pafs.LocalFileSystem(), str(dest))[0] is not None


def test_a_superseded_attempts_events_never_reach_the_log_and_its_waits_end(tmp_path: Path):
    spec = tiny_spec(tmp_path, name="fenced")
    old, _ = superseded(spec.checkpoint.storage, spec.name)
    events = Emitter(spec.checkpoint.storage, spec.name, fence=old.check())
    for step in (1, 2, 3):
        events.metrics({"step": step, **STEP})
    assert events.drain(timeout_s=10), "a checkpoint's wait on a fenced log must not hang"
    run = RunDir(spec.checkpoint.storage, spec.name)
    assert MetricsBuffer(run.fs, run.path).load() == []


def test_a_superseded_tracker_sends_nothing_and_ends_no_run(tmp_path: Path, mlflow_uri: str):
    spec = tiny_spec(tmp_path, name="two-trackers", **{"tracking.uri": mlflow_uri})
    first = Lease(spec.checkpoint.storage, spec.name, ttl=0.01)
    first.acquire()
    old_tracker = Tracker(spec, system_metrics=False, background=False, lease=first.config())
    run_id = old_tracker.run_id()
    time.sleep(0.05)
    second = Lease(spec.checkpoint.storage, spec.name, ttl=30)
    second.acquire()
    events = Emitter(spec.checkpoint.storage, spec.name, fence=second.check())
    for step in (1, 2, 3):
        events.metrics({"step": step, **STEP, "loss": 5.0 - step})
    events.drain()

    assert old_tracker.flush(force=True) == 0
    old_tracker.close(False, 1.0)
    assert metric_history(spec, run_id, "loss") == {}, "the old tracker sent the newer attempt's steps"
    assert MlflowClient(mlflow_uri).get_run(run_id).info.status == "RUNNING", "the old tracker ended the run"

    new_tracker = Tracker(spec, system_metrics=False, background=False, lease=second.config())
    got_id, _, left = new_tracker.close(True, 1.0)
    assert (got_id, left) == (run_id, 0)
    assert metric_history(spec, run_id, "loss") == {1: 4.0, 2: 3.0, 3: 2.0}


def test_a_refused_start_touches_nothing_and_never_reaches_ray_or_the_queue(tmp_path: Path, monkeypatch):
    """The lease comes first in `run`: a second driver of a live job never connects to Ray, never
    takes a seat in the cluster's queue (so two live drivers never share one), and never
    quarantines, clears or sets aside anything (--restart included)."""
    from tidal.errors import JobAlreadyRunning
    from tidal.launch import trainer

    spec = tiny_spec(tmp_path, name="live")
    live = Lease(spec.checkpoint.storage, spec.name)
    live.acquire()
    RunDir(spec.checkpoint.storage, spec.name).write_json("tidal-job.json", {"mlflow_run_id": "r"})

    def never(*_a, **_k):
        raise AssertionError("reached past the lease")

    monkeypatch.setattr(trainer, "connect_ray", never)
    monkeypatch.setattr(trainer.admission, "seat", never)
    monkeypatch.setattr(trainer, "find_resume_point", never)
    for restart in (False, True):
        with pytest.raises(JobAlreadyRunning, match="already running"):
            trainer.run(spec, restart=restart)
    assert RunDir(spec.checkpoint.storage, spec.name).read_json("tidal-job.json") == {"mlflow_run_id": "r"}
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["live", "live.lease"], "nothing set aside"
