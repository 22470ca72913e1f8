"""The driver dies mid-run; the same command resumes into the same MLflow run. Also: a truncated
newest checkpoint is skipped, and a changed model is refused before any worker starts.

Each `tidal run` here is its own process with its own local Ray instance, started in a new
session so that killing it takes exactly the processes it started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import metric_history, tiny_spec
from tests.helpers import job_run_id
from tidal.storage import RunDir
from tidal.testing.processes import kill_session
from tidal.testing.runs import StepHolds

pytestmark = pytest.mark.slow

# The driver is killed (or stopped with Ctrl-C) while its rank 0 holds after step 12 (StepHolds):
# 60 steps leave a rerun something to train.
STEPS = 60
LONG = {"train.steps": STEPS, "train.global_batch": 64, "checkpoint.every_steps": 10}


def start(job: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen([sys.executable, "-m", "tidal", "run", str(job), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)


def held_at(spec, path: Path, step: int) -> StepHolds:
    """`path` becomes the job with its rank 0 held once `step` is done (the same command run again
    does not hold: the hold is once per job)."""
    holds = StepHolds(step)
    path.write_text(yaml.safe_dump(holds.spec(spec).model_dump(mode="json")))
    return holds


def kill_mid_run(spec, path: Path) -> tuple:
    """Start the job, SIGKILL its driver's session after step 12; (MLflow run id, newest complete checkpoint)."""
    holds = held_at(spec, path, 12)
    first = start(path)
    try:
        holds.wait(12)
    finally:
        kill_session(first)
    last = RunDir(spec.checkpoint.storage, spec.name).latest_complete()
    assert last is not None and last.step == 10
    return job_run_id(spec), last


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            kill_session(proc)
    assert proc.returncode == 0, out[-5000:]
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> tuple:
    tmp = tmp_path_factory.mktemp("driver")
    spec = tiny_spec(tmp, name="driver-dies", **LONG)
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    return spec, path


def test_driver_killed_then_rerun_resumes_same_mlflow_run(job):
    spec, path = job
    run_id, last = kill_mid_run(spec, path)

    out = finish(start(path))
    assert f"resuming job 'driver-dies' from checkpoint_{last.step:09d} (step {last.step}/{STEPS})" in out
    assert json.loads((Path(spec.checkpoint.storage) / spec.name / "tidal-job.json").read_text())["mlflow_run_id"] == run_id
    assert sorted(metric_history(spec, run_id, "loss")) == list(range(1, STEPS + 1))


@pytest.fixture
def trained(job) -> tuple:
    """`job` with its checkpoints: those the driver test above left, or, where this test runs without it
    (`-m extended` deselects it, as CI's rotation does), a run of its own to the end."""
    spec, path = job
    if not RunDir(spec.checkpoint.storage, spec.name).checkpoints():
        finish(start(path), timeout=600)  # 60 steps on 2 workers, where the driver test's kill stops at 12
    return job


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): quarantine also in test_s3_checkpoints' corrupt checkpoint
def test_truncated_newest_checkpoint_is_quarantined_and_skipped(trained):
    spec, path = trained
    run = RunDir(spec.checkpoint.storage, spec.name)
    newest = Path(run.checkpoints()[0])
    victim = max((p for p in newest.rglob("*.pt")), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    previous = Path(run.checkpoints()[1]).name

    out = finish(start(path, "--set", f"train.steps={STEPS + 10}"))
    assert f"Skipping checkpoint {newest}" in out and "truncated" in out
    assert f"resuming job 'driver-dies' from {previous}" in out
    assert "truncated" in json.loads((newest / "tidal-quarantined.json").read_text())["error"]
    assert sorted(metric_history(spec, job_run_id(spec), "loss")) == list(range(1, STEPS + 11))


def test_changed_model_is_refused_before_training(job):
    _, path = job
    proc = subprocess.run([sys.executable, "-m", "tidal", "run", str(path), "--set", "model.d_model=128"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1  # a CheckpointError: exit 1, as any failed command
    assert "model.d_model: 64 -> 128" in proc.stderr and "--restart" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "starting a local Ray instance" not in proc.stdout, "refused before any Ray process starts"


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): the S3 variant of the killed driver above
def test_driver_killed_with_checkpoints_on_s3_loses_and_repeats_no_metric_point(bucket, tmp_path):
    """The metrics buffer lives on the job's storage, so it survives the driver on object storage too."""
    spec = tiny_spec(tmp_path, name="driver-dies-s3", **LONG, **{"checkpoint.storage": f"{bucket}/runs"})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    run_id, last = kill_mid_run(spec, path)  # the driver inherits AWS_ENDPOINT_URL: the S3 test server

    out = finish(start(path))
    assert f"resuming job 'driver-dies-s3' from checkpoint_{last.step:09d}" in out
    assert sorted(metric_history(spec, run_id, "loss")) == list(range(1, STEPS + 1))  # each exactly once


def test_ctrl_c_ends_the_run_gracefully_exits_130_and_says_how_to_resume(tmp_path):
    """Ctrl-C in a terminal (SIGINT to the foreground process group) while the job trains: Ray Train
    aborts its run, the job's summary and the hint to resume are printed, the exit status is 130
    (as documented), and the checkpoints written before it are there for the next run."""
    spec = tiny_spec(tmp_path, name="ctrl-c", **LONG)
    path = tmp_path / "job.yaml"
    holds = held_at(spec, path, 12)
    proc = start(path)
    try:
        holds.wait(12)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=180)
    finally:
        kill_session(proc)
    assert proc.returncode == 130, out[-3000:]
    assert "interrupted; run the same command again to resume from the latest checkpoint" in out, out[-3000:]
    assert "[tidal] goodput " in out and "Traceback" not in out, out[-3000:]
    last = RunDir(spec.checkpoint.storage, spec.name).latest_complete()
    assert last is not None and last.step == 10
