"""The admission component's body, without Ray (admission/actor.py): what drivers and workers
see as jobs come and go, what survives its restart (the queue document), and a driver that
stops checking in giving its slots back. Against a real Ray head: tests/test_admission_sharing.py."""

from __future__ import annotations

from dataclasses import asdict

import yaml

from tidal.admission.actor import Admitter, onprem_capacity, queue_document
from tidal.admission.queue_doc import Entry
from tidal.admission.quotas import Quotas


def quota_file(tmp_path, **extra) -> str:
    path = tmp_path / "quotas.yaml"
    path.write_text(yaml.safe_dump({"capacity": 4, "min_resize_interval_s": 0, **extra}))
    return str(path)


def entry(job: str, priority: str, lo: int, hi: int, at: float, team: str = "default") -> dict:
    return asdict(Entry(job, job, team, priority, lo, hi, at))


def test_a_high_priority_job_shrinks_the_low_one_and_it_grows_back_when_it_ends(tmp_path):
    a = Admitter(quota_file(tmp_path), str(tmp_path / "q.json"), background=False)
    assert a.submit(entry("low", "low", 1, 4, 1.0))["workers"] == 4
    high = a.submit(entry("high", "high", 2, 2, 2.0))
    assert (high["state"], high["workers"]) == ("RUNNING", 2)
    low = a.status("low", world=4)
    assert (low["state"], low["workers"], low["workers_now"]) == ("RUNNING", 2, 4)
    assert "make room for 'high'" in low["reason"]
    a.finished("high")
    assert a.status("low")["workers"] == 4


def test_the_queue_survives_the_components_restart(tmp_path):
    """A new component (Ray restarted the actor, or the head restarted) reads back the same
    jobs in the same states: the queued one stays queued, the running one keeps its workers."""
    where, quotas = str(tmp_path / "q.json"), quota_file(tmp_path)
    a = Admitter(quotas, where, background=False)
    a.submit(entry("big", "normal", 4, 4, 1.0))
    queued = a.submit(entry("next", "normal", 2, 2, 2.0))
    assert (queued["state"], queued["position"]) == ("QUEUED", 1)
    b = Admitter(quotas, where, background=False)
    assert [(e["job"], e["state"], e["workers"]) for e in b.entries()] == [("big", "RUNNING", 4), ("next", "QUEUED", 0)]
    b.finished("big")
    assert b.status("next")["state"] == "RUNNING"


def test_a_driver_that_stops_checking_in_gives_its_slots_back(tmp_path):
    a = Admitter(quota_file(tmp_path), str(tmp_path / "q.json"), lease_s=30, background=False)
    a.submit(entry("dead", "normal", 4, 4, 1.0))
    a.submit(entry("next", "normal", 2, 2, 2.0))
    a.seen["next"] += 100  # only "next" checked in since
    a.tick(now=a.seen["dead"] + 31)
    assert a.status("dead") == {} and a.status("next")["state"] == "RUNNING"


def test_a_job_already_known_keeps_its_place_when_its_driver_registers_again(tmp_path):
    a = Admitter(quota_file(tmp_path), str(tmp_path / "q.json"), background=False)
    a.submit(entry("big", "normal", 4, 4, 1.0))
    a.submit(entry("next", "normal", 2, 2, 2.0))
    again = a.submit(entry("next", "normal", 2, 2, 50.0))  # a restarted driver: same id, new clock
    assert (again["state"], again["submitted_at"]) == ("QUEUED", 2.0)


def test_capacity_counts_live_onprem_nodes_in_the_files_unit():
    nodes = [{"Alive": True, "Resources": {"CPU": 8.0, "GPU": 4.0, "site_onprem": 1000.0}, "Labels": {}},
             {"Alive": True, "Resources": {"CPU": 8.0, "GPU": 8.0}, "Labels": {"tidal.io/site": "cloud"}},
             {"Alive": False, "Resources": {"CPU": 8.0, "GPU": 4.0}, "Labels": {}},
             {"Alive": True, "Resources": {"CPU": 2.0}, "Labels": {}}]
    assert onprem_capacity(Quotas(unit="gpus"), nodes) == 4
    assert onprem_capacity(Quotas(unit="workers"), nodes) == 10
    assert onprem_capacity(Quotas(capacity=3), nodes) == 3


def test_a_submitted_job_is_known_by_its_submission_id():
    import json

    from tidal.admission.actor import job_key

    config = json.dumps({"runtime_env": {}, "metadata": {"job_submission_id": "low-4f2a1c"}})
    assert job_key("low", {"RAY_JOB_CONFIG_JSON_ENV_VAR": config}) == "low-4f2a1c"
    assert job_key("low", {}) == "low"


def test_the_queue_lives_on_the_clusters_storage_unless_told_otherwise():
    assert queue_document({"TIDAL_STORAGE": "s3://b/runs"}) == "s3://b/runs/.tidal-queue/queue.json"
    assert queue_document({"TIDAL_QUEUE": "/srv/q.json", "TIDAL_STORAGE": "s3://b"}) == "/srv/q.json"
