"""Hangs found, explained and recovered with the spec's defaults, end to end: a job on a real Ray
instance (2 DeepSpeed workers on gloo) has one worker stopped with SIGSTOP; another (extended: the
same detection and recovery, a second 30 s hang the suite's budget does not hold) has one rank
blocked in its step while its peer waits inside the collective (tests/hang_step.py). Each time the
heartbeat (a stopped rank) or the adaptive step deadline (a blocked one) finds it, the console names
the rank, its node and pid and where the other waits, every rank's stacks reach the MLflow run, and
the job trains again from its last checkpoint to the end. The verdict's rules, the protocol between ranks and the deadline table are unit-tested
(tests/test_hang_unit.py, tests/test_watchdog_phases.py)."""

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

STEPS = 30


def hang_spec(tmp_path, name: str, hang_file: Path):
    spec = tiny_spec(tmp_path, name=name, **{
        "train.steps": STEPS, "checkpoint.every_steps": 10, "failure.max_restarts": 4,
        "train.step_fn": "tests.hang_step:step",
        # 0.2 s a micro-batch: the job lasts while the test looks; the adaptive deadline stays at its floor
        "worker_env": {**slow_env(0.2), HANG_FILE: str(hang_file), HANG_RANK: "1"},
    })
    assert spec.failure.step_timeout_s is None, "the spec's defaults: the adaptive deadline"
    return spec


def recovered_with_one_hang(spec, result, out: str, found_by: str) -> tuple[str, str]:
    """The job trained every step once after one hang, said once on the console, found by `found_by`
    (the heartbeat's deadline, or the adaptive step deadline at its floor); the hang's line, and
    every rank's stacks from the MLflow run."""
    assert sorted(metric_history(spec, result.mlflow_run_id, "loss")) == list(range(1, STEPS + 1))
    assert metric_history(spec, result.mlflow_run_id, "restarts")[STEPS] >= 1
    hangs = [line for line in out.splitlines() if "hang after step" in line]
    assert len(hangs) == 1, out
    assert found_by in hangs[0], hangs[0]
    client = MlflowClient(spec.tracking.uri)
    folders = [f.path for f in client.list_artifacts(result.mlflow_run_id, "hangs")]
    assert len(folders) == 1, folders
    names = sorted(f.path.rsplit("/", 1)[-1] for f in client.list_artifacts(result.mlflow_run_id, folders[0]))
    assert names == ["stacks-rank0.txt", "stacks-rank1.txt", "verdict.txt"], names
    stacks = "\n".join(Path(client.download_artifacts(result.mlflow_run_id, f"{folders[0]}/{n}")).read_text()
                       for n in ("stacks-rank0.txt", "stacks-rank1.txt"))
    assert "Thread" in stacks and "MainThread" in stacks, "the live ranks' own stacks, every thread"
    return hangs[0], stacks


def test_a_stopped_worker_is_named_read_from_outside_and_recovered(tmp_path, capfd):
    spec = hang_spec(tmp_path, "hang-stopped", tmp_path / "unused")
    frozen: list[psutil.Process] = []

    def stop() -> None:
        wait_for_step(spec, 12, timeout=300)
        victim = our_processes("RayTrainWorker")[-1]
        frozen.append(victim)
        kill(victim, signal.SIGSTOP)

    threading.Thread(target=stop, daemon=True).start()
    try:
        result = tidal.run(spec)
    finally:
        for p in frozen:  # whatever Ray did not clean up: wake and end the process we froze
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGCONT)
                p.kill()
    assert frozen, "the worker was stopped"
    # Found by its heartbeat, in seconds: the step deadline's floor (30 s) is not waited for.
    line, stacks = recovered_with_one_hang(spec, result, capfd.readouterr().out, "gave no heartbeat for 5s")
    # Named with its node and pid, seen stopped from outside; the other waits in a collective.
    assert re.search(rf"rank \d on node [\d.]+ \(pid {frozen[0].pid}\) stopped answering \(process state T \(stopped\)",
                     line), line
    assert re.search(r"rank \d waits in \w+ \((torch/distributed|deepspeed/comm)/", line), line
    assert stacks.count("did not answer; read from outside: process state T (stopped)") == 1, stacks


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): the detection and recovery above, a rank that answers
def test_a_rank_blocked_outside_the_collective_is_named_where_it_is_and_recovered(tmp_path, capfd):
    hang_file = tmp_path / "hang-now"
    spec = hang_spec(tmp_path, "hang-blocked", hang_file)

    def block() -> None:
        wait_for_step(spec, 12, timeout=300)
        hang_file.write_text("")  # rank 1 sleeps in its next step

    threading.Thread(target=block, daemon=True).start()
    result = tidal.run(spec)
    assert not hang_file.exists(), "the rank was blocked"
    # Its heartbeat goes on (it sleeps in its step): the step deadline finds it, at its floor.
    line, stacks = recovered_with_one_hang(spec, result, capfd.readouterr().out, "adaptive deadline 30s")
    # It answers and is not in a collective (asleep in its step); rank 0 waits in one for it.
    assert re.search(r"rank 1 on node [\d.]+ \(pid \d+\) is not in a collective: it is in step \(tests/hang_step.py:\d+\)",
                     line), line
    assert re.search(r"rank 0 waits in \w+ \((torch/distributed|deepspeed/comm)/", line), line
    assert "hang_step.py" in stacks, "the blocked rank's stack shows where it is"
