"""The queue survives its head (issue #52): a real Ray head with GCS fault tolerance (a real Redis)
and the cluster's admission runs one job (submitted as `ray job submit -- tidal run first.yaml --restart`)
while another (`tidal submit`) waits; the head is lost (every process of
it killed: its GCS, raylet, dashboard, the jobs' drivers and workers) and a new head is started in
its place on the same Redis. Nobody submits anything again: the admission actor, restarted by Ray
on the new head, finds the queue saved on the lost head and starts both jobs again. Both finish,
each in its one MLflow run with every step once: the running job from its latest checkpoint (the
replayed `--restart` applies to its first start only), the waiting one after it; each followed to its end
through the id it was first submitted as."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.conftest import ROOT, one_worker_spec
from tidal.admission.queue_doc import load_queue
from tidal.launch.jobs import Job, connect, submit
from tidal.testing.heads import ray_head
from tidal.testing.processes import free_port, wait_for
from tidal.testing.runs import job_run_id, metric_history, wait_for_step
from tidal.testing.servers import gcs_ft_env, redis_server

# extended: outside the suite's budget (pyproject.toml), in CI's rotation: a second head, Redis and two jobs; the relaunch's rules are unit-tested in test_admission_relaunch
pytestmark = [pytest.mark.slow, pytest.mark.extended]
QUOTAS = {"unit": "workers", "capacity": 1, "min_resize_interval_s": 5}


def states(queue: str) -> dict[str, str]:
    return {e.name: e.state for e in load_queue(queue).entries}


def first_step_after(spec, logged: int, timeout: float) -> float:
    """When MLflow first shows a step past `logged` (the job trains again)."""
    wait_for_step(spec, logged + 1, timeout=timeout)
    return time.time()


def ray_job_submit(spec, tmp: Path, address: str, submission_id: str) -> str:
    """`ray job submit --working-dir . -- tidal run JOB.yaml --restart`, as a user types it."""
    path = tmp / f"{spec.name}.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    subprocess.run(
        [sys.executable, "-m", "ray.scripts.scripts", "job", "submit", "--address", address, "--working-dir", str(ROOT),
         "--submission-id", submission_id, "--no-wait", "--", "tidal", "run", str(path), "--restart"],
        env={**os.environ, "RAY_AUTH_MODE": "token"}, check=True, capture_output=True, timeout=120)
    return submission_id


def test_a_lost_head_s_running_and_waiting_jobs_start_again_by_themselves_and_lose_nothing(tmp_path):
    quotas, queue = tmp_path / "quotas.yaml", str(tmp_path / "queue.json")
    quotas.write_text(yaml.safe_dump(QUOTAS))
    hold = tmp_path / "hold"  # the first job's steps are slow until the new head has it training again
    hold.touch()
    first, second = one_worker_spec(tmp_path, "first", 40, 0.25, hold), one_worker_spec(tmp_path, "second", 10, 0.0)
    port, token = free_port(), secrets.token_hex(16)
    with redis_server(tmp_path / "redis.log") as redis:
        env = {"TIDAL_QUOTAS": str(quotas), "TIDAL_QUEUE": queue, "TIDAL_RELAUNCH_GRACE_S": "5",
               **gcs_ft_env(redis, f"tidal-{secrets.token_hex(4)}")}
        (tmp_path / "h1").mkdir()
        with ray_head(tmp_path / "h1", 2, env, port=port, token=token) as head:
            ids = {"first": ray_job_submit(first, tmp_path, head.address, f"first-{secrets.token_hex(3)}")}
            wait_for_step(first, 12, timeout=240)  # two checkpoints saved
            ids["second"] = submit(second, head.address, working_dir=ROOT,
                                   submission_id=f"second-{secrets.token_hex(3)}").submission_id
            wait_for("second QUEUED behind first", lambda: states(queue) == {"first": "RUNNING", "second": "QUEUED"},
                     timeout=60)
        logged = max(metric_history(first, job_run_id(first), "loss"))
        assert logged < first.train.steps, "the head was lost while the first job trained"
        (tmp_path / "h2").mkdir()
        with ray_head(tmp_path / "h2", 2, env, port=port, token=token) as head:
            up = time.time()
            again = first_step_after(first, logged, timeout=300) - up
            # The user's first id follows the job's relaunched driver (it was reported STOPPED).
            assert Job(ids["first"], head.address).status() == "RUNNING"
            hold.unlink()
            started = first_step_after(second, 0, timeout=400) - up
            client = connect(head.address)

            def relaunched() -> dict[str, str]:
                return {j.submission_id: str(j.status) for j in client.list_jobs()
                        if j.submission_id and j.submission_id not in ids.values()}

            # Each job's relaunched driver; a waiting one may park again and go on as one more
            # (admission/parking.py): the queue is empty once every driver has ended.
            wait_for("every relaunched driver to end, the queue empty", lambda: len(relaunched()) >= 2 and all(
                s in ("SUCCEEDED", "FAILED", "STOPPED") for s in relaunched().values())
                and not load_queue(queue).entries, timeout=300, every=1.0)
            jobs = relaunched()
            followed = {name: Job(sid, head.address).wait(timeout=60) for name, sid in ids.items()}
        print(f"\n[head restart] (MLflow's clock; benchmarks.head_restart times it from the loss trace) from the new head's Jobs API to the first step: first (running) {again:.1f}s, "
              f"second (queued) {started:.1f}s")
    assert set(jobs.values()) == {"SUCCEEDED"}, jobs
    assert followed == {"first": "SUCCEEDED", "second": "SUCCEEDED"}, "each job's first id ends with the job"
    assert all(any(sid.startswith(ids[name]) for sid in jobs) for name in ids), jobs
    assert all(any(sid.startswith(old) for old in ids.values()) for sid in jobs), jobs
    for spec in (first, second):
        client = MlflowClient(spec.tracking.uri)
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
        assert len(runs) == 1, f"{spec.name}: one MLflow run across the head's loss"
        loss = metric_history(spec, job_run_id(spec), "loss")
        assert sorted(loss) == list(range(1, spec.train.steps + 1)), f"{spec.name}: every step logged, each once"
