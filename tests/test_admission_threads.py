"""The admission actor answers heartbeats whatever the Jobs API does (admission/handle.py,
admission/relaunch.py): calls that wait on the Jobs API run in a thread group of their own, and
every Jobs API call the actor makes returns within a bound."""

from __future__ import annotations

import threading
import time

import pytest
import yaml

from tidal.admission.relaunch import _Bounded
from tidal.testing.processes import wait_for


def test_a_jobs_api_call_that_hangs_returns_within_its_bound():
    release = threading.Event()

    class Stalled:
        def get_job_info(self, submission_id: str):
            release.wait(60)
            return submission_id

    client = _Bounded(Stalled(), timeout_s=0.1)
    try:
        with pytest.raises(TimeoutError, match="did not answer get_job_info within"):
            client.get_job_info("raysubmit_1")
    finally:
        release.set()


@pytest.mark.slow
def test_running_jobs_keep_their_slots_while_the_jobs_api_stalls_a_burst_of_parks(tmp_path, ray_local):
    import ray

    from tidal.admission.actor import Admitter
    from tidal.admission.handle import THREADS, method

    quotas = tmp_path / "quotas.yaml"
    quotas.write_text(yaml.safe_dump({"capacity": 1, "min_resize_interval_s": 0}))

    def stall(submission: str, seconds: float) -> int:  # here: shipped to the actor by value
        """A package pin on a dashboard that does not answer (for longer than the actor's lease)."""
        import time

        time.sleep(120)
        return 1

    def registration(job: str) -> dict:
        return {"job": job, "name": job, "team": None, "priority": "normal", "min_workers": 1, "max_workers": 1,
                "cpus_per_worker": 1, "gpus_per_worker": 0, "token": f"tok-{job}", "submission": job}

    actor = ray.remote(**THREADS)(Admitter).options(num_cpus=0).remote(
        str(quotas), str(tmp_path / "q.json"), lease_s=5, tick_s=0.2, pinner=stall)
    try:
        ray.get(actor.submit.remote(registration("running")), timeout=60)
        wait_for("the running job to be admitted",
                 lambda: ray.get(actor.status.remote("running"), timeout=30).get("state") == "RUNNING", 30)
        waiting = [f"waiting-{i}" for i in range(12)]
        for job in waiting:
            ray.get(actor.submit.remote(registration(job)), timeout=30)
        parks = [method(actor, "park").remote(job, f"tok-{job}", f"{job}-p") for job in waiting]  # each stalls
        # Heartbeats for three lease lengths: each answered, and the running job keeps its slot.
        for _ in range(30):
            entry = ray.get(actor.status.remote("running", 1), timeout=10)
            assert entry.get("state") == "RUNNING" and entry.get("workers") == 1
            time.sleep(0.5)
        del parks
    finally:
        ray.kill(actor)
