"""One live attempt per job, end to end on a real token-auth head whose nodes name an `mlflow server`
and S3 storage (moto's server): a second start of a running job through every face is refused
naming the live one, and the live one finishes with every step logged once and no checkpoint
lost; a driver stopped past its lease is taken over, and its attempt writes nothing more."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import ONE_WORKER, ROOT, tiny_spec
from tests.slow_step import slow_env
from tidal.launch.jobs import Job, submit
from tidal.storage import QUARANTINE_FILE, RunDir, check_complete
from tidal.testing.runs import job_run_id, metric_history, wait_for_step

pytestmark = pytest.mark.slow
STEPS = 100


def cluster_spec(tmp: Path, name: str, cluster_env: dict[str, str], step_s: float, storage: str | None = None):
    """A job whose steps take `step_s` per micro-batch while tmp/NAME.hold exists (tests/slow_step.py),
    tracked and stored where the cluster says."""
    hold = tmp / f"{name}.hold"
    hold.touch()
    spec = tiny_spec(tmp, name=name, **{
        "train.steps": STEPS, "checkpoint.every_steps": 10, "train.log_every": 1, **ONE_WORKER,
        "train.global_batch": 8,  # two micro-batches a step, as two workers of 16 had
        "train.step_fn": "tests.slow_step:step", "worker_env": slow_env(step_s, hold),
        "checkpoint.storage": storage or cluster_env["TIDAL_STORAGE"],
        "tracking.uri": cluster_env["MLFLOW_TRACKING_URI"]})
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    return spec, path


def on_the_head(head_tmp: Path, cluster_env: dict[str, str], *args: str, ttl: str = "30") -> subprocess.Popen:
    """`tidal ARGS` in a terminal on the head node: it joins the head's cluster (no RAY_ADDRESS)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | cluster_env | {
        "RAY_TMPDIR": str(head_tmp / "ray"), "TIDAL_LEASE_TTL_S": ttl, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "tidal", *args], env=env, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def assert_every_step_once_and_no_checkpoint_lost(spec) -> None:
    losses = metric_history(spec, job_run_id(spec), "loss")  # raises if a step was logged twice
    assert sorted(losses) == list(range(1, STEPS + 1))
    run = RunDir(spec.checkpoint.storage, spec.name)
    folders = run.checkpoints()
    assert folders and folders[0].endswith(f"{STEPS:09d}")
    for path in folders:
        assert check_complete(run.fs, path)[0] is None, f"{path} was damaged by a second start"
        assert not run.fs.get_file_info(f"{path}/{QUARANTINE_FILE}").is_file


def test_a_second_start_through_every_face_is_refused_and_the_first_finishes(head, head_tmp, cluster_env, tmp_path):
    spec, path = cluster_spec(tmp_path, "twice", cluster_env, step_s=0.3)
    first = submit(spec, head, ROOT)  # retries while the head's agent registers (launch/jobs.py)
    wait_for_step(spec, 3, timeout=300)

    tidal_submit = on_the_head(head_tmp, cluster_env, "submit", str(path), "--address", head)
    ray_job_submit = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "job", "submit", "--address", head, "--working-dir", str(ROOT),
         "--", "tidal", "run", str(path)], env={**os.environ, "RAY_AUTH_MODE": "token"}, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    tidal_run = on_the_head(head_tmp, cluster_env, "run", str(path))
    outputs = {face: proc.communicate(timeout=400)[0] for face, proc in
               (("tidal submit", tidal_submit), ("ray job submit", ray_job_submit), ("tidal run", tidal_run))}

    for face, proc in (("tidal submit", tidal_submit), ("ray job submit", ray_job_submit), ("tidal run", tidal_run)):
        out = outputs[face]
        assert proc.returncode != 0, f"{face} started a second driver:\n{out[-3000:]}"
        assert "job 'twice' is already running" in out, f"{face}:\n{out[-3000:]}"
        assert f"Ray job {first.submission_id}" in out, f"{face} did not name the live driver:\n{out[-3000:]}"
    assert Job(first.submission_id, head).status() == "RUNNING", "every face was refused while the first trained"
    (tmp_path / "twice.hold").unlink()  # the first has lasted long enough: it trains on at full speed
    assert first.wait(timeout=600) == "SUCCEEDED", Job(first.submission_id, head).logs()[-3000:]
    assert_every_step_once_and_no_checkpoint_lost(spec)


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): takeover and fencing are unit-tested (test_lease, test_lease_fencing); the refusal runs above
def test_a_driver_stopped_past_its_lease_is_taken_over_and_its_attempt_writes_nothing(head, head_tmp, cluster_env,
                                                                                      tmp_path):
    """SIGSTOP on the first driver (its workers and tracker keep running); past its lease a second
    start takes the job over; the first's workers stop themselves, the second trains to the end;
    continued, the first says it was superseded. On a local (shared-filesystem) folder."""
    spec, path = cluster_spec(tmp_path, "stopped", cluster_env, step_s=0.2, storage=str(tmp_path / "runs"))
    old = on_the_head(head_tmp, cluster_env, "run", str(path), ttl="3")
    new = None
    try:
        wait_for_step(spec, 5, timeout=300)
        old.send_signal(signal.SIGSTOP)
        time.sleep(4.5)  # past its 3 s lease
        new = on_the_head(head_tmp, cluster_env, "run", str(path), ttl="3")
        new_out = new.communicate(timeout=600)[0]
        assert new.returncode == 0, new_out[-3000:]
    finally:
        old.send_signal(signal.SIGCONT)
    old_out = old.communicate(timeout=300)[0]
    assert old.returncode == 1, old_out[-3000:]
    assert "was started again while this driver could not renew its lease" in old_out, old_out[-3000:]
    assert f"[tidal] step {STEPS}/{STEPS}" in new_out
    assert_every_step_once_and_no_checkpoint_lost(spec)
