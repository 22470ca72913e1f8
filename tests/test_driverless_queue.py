"""Queued jobs cost the head no driver (issue #52), against a real token-auth head with the
cluster's admission and one worker slot: a job runs, two more are submitted and wait. Their
drivers park them and end (Ray's own record says SUCCEEDED: no process is left for them), while
`Job.status()` and `tidal list` say QUEUED. One is stopped while it waits and never starts; the
other starts by itself as its successor once the slot is free, and finishes in one MLflow run
with every step once; `Job.logs()` and `Job.wait()` of its first submission id follow it there.
The waiting job's package stays in the GCS after its driver ended (admission pins it): without the
pin the GCS deleted it (seen failing), and a successor's workers on any node but the parked
driver's, which has the package unpacked in its cache, could not set up their runtime env."""

from __future__ import annotations

import secrets
import time

import pytest
import yaml

from tests.conftest import ROOT, one_worker_spec
from tidal.admission.queue_doc import load_queue
from tidal.launch.jobs import Job, connect, list_jobs, submit
from tidal.testing.heads import ray_head, wait_accepting_jobs
from tidal.testing.processes import scaled, wait_for
from tidal.testing.runs import job_run_id, metric_history

# extended: outside the suite's budget (pyproject.toml), in CI's rotation: its own head and three jobs; parking's rules are tested against a recorder in test_admission_parking
pytestmark = [pytest.mark.slow, pytest.mark.extended]
PIN_S = 15  # how long the head keeps an upload whatever holds it (Ray's default: 600)


def held(gcs: str, package: str) -> bool:
    """Whether the cluster's GCS still holds `package` (asked from a driver of this process)."""
    import ray

    from tidal.ray_private import package_exists

    ray.init(address=gcs, logging_level="ERROR", log_to_driver=False)
    try:
        return package_exists(package)
    finally:
        ray.shutdown()


def test_waiting_jobs_hold_no_driver_and_start_by_themselves_or_never_once_stopped(tmp_path, monkeypatch):
    quotas, queue = tmp_path / "quotas.yaml", str(tmp_path / "queue.json")
    quotas.write_text(yaml.safe_dump({"unit": "workers", "capacity": 1, "min_resize_interval_s": 5}))
    monkeypatch.setenv("TIDAL_QUEUE", queue)  # Job.status() and `tidal list` read the cluster's queue here
    hold = tmp_path / "hold"  # the first job's steps are slow until the waiting jobs were checked
    hold.touch()
    # 60 held steps: the first job still runs when the package check below comes
    first, second, third = (one_worker_spec(tmp_path, "first", 60, 0.3, hold), one_worker_spec(tmp_path, "second", 6, 0.0),
                            one_worker_spec(tmp_path, "third", 6, 0.0))
    # Ray keeps a fresh upload for 10 minutes whatever holds it; PIN_S here, so that a parked job's
    # package outlives the driver that held it only through admission's pin (admission/parking.py).
    env = {"TIDAL_QUOTAS": str(quotas), "TIDAL_QUEUE": queue, "TIDAL_PARK_AFTER_S": "1",
           "RAY_RUNTIME_ENV_TEMPORARY_REFERENCE_EXPIRATION_S": str(PIN_S)}
    (tmp_path / "head").mkdir()
    with ray_head(tmp_path / "head", 2, env) as head:
        # A first submission that waited for the head's agent lost its package to that short hold
        # once on CI (the job failed before its driver ran): the agent is up before any upload.
        wait_accepting_jobs(head.address)

        def send(spec) -> Job:
            return submit(spec, head.address, working_dir=ROOT, submission_id=f"{spec.name}-{secrets.token_hex(3)}")

        jobs = {"first": send(first)}

        def seen() -> str:  # what a timed-out wait reports: each job's state and the end of its logs
            return "\n".join(f"{n}: {load_queue(queue).get(j.submission_id)}; Ray: {j.status()}\n{j.logs()[-2000:]}"
                              for n, j in jobs.items())

        wait_for("first RUNNING", lambda: (e := load_queue(queue).get(jobs["first"].submission_id))
                 and e.state == "RUNNING", timeout=120, context=seen)
        jobs["second"], jobs["third"] = send(second), send(third)
        sent_at = time.time()
        client = connect(head.address)

        def parked() -> bool:
            q = load_queue(queue)
            return all((e := q.get(jobs[n].submission_id)) is not None and e.successor
                       and str(client.get_job_status(jobs[n].submission_id).value) == "SUCCEEDED"
                       for n in ("second", "third"))

        wait_for("second and third parked, their drivers ended", parked, timeout=120, every=0.5, context=seen)
        assert jobs["second"].status() == "QUEUED" and jobs["third"].status() == "QUEUED"
        assert "waits in the cluster's queue" in jobs["second"].logs()
        assert jobs["third"].stop(), "a parked job can be stopped"
        assert jobs["third"].status() == "STOPPED"
        rows = {r["name"]: r["status"] for r in list_jobs(head.address)}
        assert rows == {"first": "RUNNING", "second": "QUEUED", "third": "STOPPED"}, rows
        # Past Ray's own hold on the upload, and with no driver holding it, the package is kept.
        package = client.get_job_info(jobs["second"].submission_id).runtime_env["working_dir"]
        time.sleep(max(0.0, PIN_S + 2 - (time.time() - sent_at)))
        assert jobs["first"].status() == "RUNNING", "the slot is still taken: no successor holds the package"
        assert held(head.gcs, package), "a parked job's package outlives its driver"
        hold.unlink()

        # Following the first id (as `tidal submit` and `tidal logs --follow` do) waits through the
        # queue and streams the driver admission starts, to the job's end.
        followed = "".join(jobs["second"].follow(poll_s=0.5))
        assert "waits in the cluster's queue" in followed and "finished in" in followed, followed[-3000:]
        assert jobs["second"].wait(timeout=scaled(60)) == "SUCCEEDED", jobs["second"].logs()[-3000:]
        assert jobs["first"].wait(timeout=scaled(60)) == "SUCCEEDED", jobs["first"].logs()[-3000:]
        logs = jobs["second"].logs()
        assert "waits in the cluster's queue" in logs and "finished in" in logs, "the logs follow it to its end"
        wait_for("the queue empty", lambda: not load_queue(queue).entries, timeout=60, context=seen)
        ran = {j.submission_id for j in client.list_jobs() if (j.metadata or {}).get("tidal.job") == "second"}
        assert len(ran) == 2 and all(s.startswith(jobs["second"].submission_id) for s in ran), ran
        assert {r["name"]: r["status"] for r in list_jobs(head.address)} == {
            "first": "SUCCEEDED", "second": "SUCCEEDED", "third": "STOPPED"}
    loss = metric_history(second, job_run_id(second), "loss")
    assert sorted(loss) == list(range(1, second.train.steps + 1)), "every step logged, each once"
    assert not list((tmp_path / "third" / "runs").glob("third/checkpoint_*")), "a stopped waiting job never trained"
