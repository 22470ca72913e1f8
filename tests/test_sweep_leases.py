"""`tidal sweep --restart` never moves a live job's folder, and a sweep holds a lease of its own
(launch/sweep.py, tidal/lease.py): against real lease folders, without Ray."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.conftest import tiny_spec
from tidal.errors import JobAlreadyRunning
from tidal.launch import sweep as sweep_mod
from tidal.lease import Lease


def live_elsewhere(storage: Path, name: str) -> None:
    """`name`'s lease held by a driver on another host that renewed just now."""
    folder = storage / f"{name}.lease"
    folder.mkdir(parents=True)
    now = time.time()
    (folder / "000000000001.json").write_text(json.dumps(
        {"generation": 1, "host": "gpu-node-7", "pid": 4242, "pid_started": 1.0, "since": now - 60, "renewed": now,
         "ttl_s": 30.0, "face": "tidal run", "submission_id": "raysubmit_live"}))


def test_restart_moves_no_folder_of_a_running_trial(tmp_path: Path):
    base = tiny_spec(tmp_path, name="x")
    runs = tmp_path / "runs"
    for folder in ("x-sweep", "x-t0", "x-t1"):
        (runs / folder).mkdir(parents=True)
    live_elsewhere(runs, "x-t1")
    with pytest.raises(JobAlreadyRunning, match="trial 'x-t1', which is running: Ray job raysubmit_live"):
        sweep_mod._set_aside(base)
    assert sorted(p.name for p in runs.iterdir()) == ["x-sweep", "x-t0", "x-t1", "x-t1.lease"], "nothing moved"
    # once its lease is released (or expired) it is moved as before
    (runs / "x-t1.lease" / "000000000001.json").write_text(json.dumps({"generation": 1, "released": True}))
    sweep_mod._set_aside(base)
    assert sorted(p.name for p in runs.iterdir() if ".replaced-" not in p.name) == ["x-t1.lease"]


def test_a_second_sweep_of_a_running_sweep_is_refused_before_it_touches_anything(tmp_path: Path, monkeypatch):
    spec = tiny_spec(tmp_path, name="x")
    live = Lease(spec.checkpoint.storage, "x-sweep")
    live.acquire()

    def never(*_a, **_k):
        raise AssertionError("reached past the sweep's lease")

    monkeypatch.setattr(sweep_mod, "connect_ray", never)
    monkeypatch.setattr(sweep_mod, "_set_aside", never)
    with pytest.raises(JobAlreadyRunning, match="job 'x-sweep' is already running"):
        sweep_mod.sweep(spec, params={"train.lr": "grid:1e-2,1e-3"}, restart=True)
