"""Hangs found, explained and recovered with the spec's defaults, end to end: one job on a real Ray
instance (2 DeepSpeed workers on gloo) has one worker stopped with SIGSTOP, then, after it trains
again, one rank blocked in its step while its peer waits inside the collective (tests/hang_step.py).
Each time the adaptive deadline finds it, the console names the rank, its node and pid and where
the other waits, every rank's stacks reach the MLflow run, and the job trains again from its last
checkpoint to the end. The verdict's rules, the protocol between ranks and the deadline table are
unit-tested (tests/test_hang_unit.py, tests/test_watchdog_phases.py)."""

from __future__ import annotations

import contextlib
import re
import signal
import threading
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

import tidal
from tests.conftest import metric_history, tiny_spec
from tests.hang_step import HANG_FILE, HANG_RANK
from tests.helpers import kill, our_processes, wait_for_step
from tests.slow_step import slow_env

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]

STEPS = 50


def test_a_stopped_worker_and_a_rank_blocked_outside_the_collective_are_named_and_recovered(tmp_path, capfd):
    hang_file = tmp_path / "hang-now"
    spec = tiny_spec(tmp_path, name="hang", **{
        "train.steps": STEPS, "checkpoint.every_steps": 10, "failure.max_restarts": 4,
        "train.step_fn": "tests.hang_step:step",
        # 0.2 s a micro-batch: the job lasts while the test looks; the adaptive deadline stays at its floor
        "worker_env": {**slow_env(0.2), HANG_FILE: str(hang_file), HANG_RANK: "1"},
    })
    assert spec.failure.step_timeout_s is None, "the spec's defaults: the adaptive deadline"
    frozen: list[psutil.Process] = []

    def faults() -> None:
        wait_for_step(spec, 12, timeout=300)
        victim = our_processes("RayTrainWorker")[-1]
        frozen.append(victim)
        kill(victim, signal.SIGSTOP)
        wait_for_step(spec, 25, timeout=400)  # trained again past the stop: a new group
        hang_file.write_text("")  # rank 1 sleeps in its next step

    threading.Thread(target=faults, daemon=True).start()
    try:
        result = tidal.run(spec)
    finally:
        for p in frozen:  # whatever Ray did not clean up: wake and end the process we froze
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGCONT)
                p.kill()
    out = capfd.readouterr().out
    assert frozen and not hang_file.exists(), "both faults were injected"
    assert sorted(metric_history(spec, result.mlflow_run_id, "loss")) == list(range(1, STEPS + 1))
    assert metric_history(spec, result.mlflow_run_id, "restarts")[STEPS] >= 2

    hangs = [line for line in out.splitlines() if "hang after step" in line]
    assert len(hangs) == 2, out
    stopped, blocked = hangs
    # The stopped worker: named with its node and pid, seen stopped from outside; the other waits in a collective.
    assert re.search(rf"rank \d on node [\d.]+ \(pid {frozen[0].pid}\) stopped answering \(process state T \(stopped\)",
                     stopped), stopped
    assert re.search(r"rank \d waits in \w+ \((torch/distributed|deepspeed/comm)/", stopped), stopped
    # The blocked rank: it answers, is not in a collective (asleep in its step); rank 0 waits in one for it.
    assert re.search(r"rank 1 on node [\d.]+ \(pid \d+\) is not in a collective: it is in step \(tests/hang_step.py:\d+\)",
                     blocked), blocked
    assert re.search(r"rank 0 waits in \w+ \((torch/distributed|deepspeed/comm)/", blocked), blocked
    for line in hangs:  # found by the adaptive deadline at its floor, well within a minute
        assert "adaptive deadline 30s" in line, line

    client = MlflowClient(spec.tracking.uri)
    folders = [f.path for f in client.list_artifacts(result.mlflow_run_id, "hangs")]
    assert len(folders) == 2, folders
    for folder in folders:
        names = sorted(f.path.rsplit("/", 1)[-1] for f in client.list_artifacts(result.mlflow_run_id, folder))
        assert names == ["stacks-rank0.txt", "stacks-rank1.txt", "verdict.txt"], names
    texts = {folder: {n: client.download_artifacts(result.mlflow_run_id, f"{folder}/{n}")
                      for n in ("stacks-rank0.txt", "stacks-rank1.txt")} for folder in folders}
    every = "\n".join(Path(p).read_text() for per in texts.values() for p in per.values())
    assert every.count("did not answer; read from outside: process state T (stopped)") == 1, every
    assert 'Thread' in every and "MainThread" in every, "the live ranks' own stacks, every thread"
    assert "hang_step.py" in every, "the blocked rank's stack shows where it is"
