"""The admission component's body, without Ray (admission/actor.py): what drivers and workers
see as jobs come and go, what survives its restart (the queue document), a driver that stops
checking in giving its slots back, and the rules that hold on every path (issue #52): decisions
saved before anyone acts, heartbeats that never wait behind a decision, a damaged document set
aside, and what the actor computes itself. Against a real Ray head: tests/test_admission_sharing.py."""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest
import yaml

from tidal.admission import actor as actor_module
from tidal.admission.actor import Admitter, onprem_capacity
from tidal.admission.naming import queue_document
from tidal.admission.queue_doc import load_queue
from tidal.admission.quotas import Quotas


def quota_file(tmp_path, **extra) -> str:
    path = tmp_path / "quotas.yaml"
    path.write_text(yaml.safe_dump({"capacity": 4, "min_resize_interval_s": 0, **extra}))
    return str(path)


def reg(job: str, priority: str, lo: int, hi: int, cpus: float = 1, token: str | None = None, **extra) -> dict:
    """What a driver sends (admission/seat.py)."""
    return {"job": job, "name": job, "team": None, "priority": priority, "min_workers": lo, "max_workers": hi,
            "cpus_per_worker": cpus, "gpus_per_worker": 0, "token": token or f"tok-{job}", **extra}


def test_a_high_priority_job_shrinks_the_low_one_and_it_grows_back_when_it_ends(tmp_path):
    a = Admitter(quota_file(tmp_path), str(tmp_path / "q.json"), background=False)
    a.submit(reg("low", "low", 1, 4))
    a.tick()
    assert a.status("low")["workers"] == 4
    a.submit(reg("high", "high", 2, 2))
    a.tick()
    high = a.status("high")
    assert (high["state"], high["workers"]) == ("RUNNING", 2)
    a.status("low", world=4)
    a.tick()
    low = a.status("low")
    assert (low["state"], low["workers"], low["workers_now"]) == ("RUNNING", 2, 4)
    assert "make room for 'high'" in low["reason"]
    assert a.finished("high", "tok-high")
    a.tick()
    assert a.status("low")["workers"] == 4


def test_the_queue_survives_the_components_restart(tmp_path):
    """A new component (Ray restarted the actor, or the head restarted) reads back the same
    jobs in the same states: the queued one stays queued, the running one keeps its workers."""
    where, quotas = str(tmp_path / "q.json"), quota_file(tmp_path)
    a = Admitter(quotas, where, background=False)
    a.submit(reg("big", "normal", 4, 4))
    a.submit(reg("next", "normal", 2, 2))
    a.tick()
    queued = a.status("next")
    assert (queued["state"], queued["position"]) == ("QUEUED", 1)
    b = Admitter(quotas, where, background=False)
    assert [(e["job"], e["state"], e["workers"]) for e in b.entries()] == [("big", "RUNNING", 4), ("next", "QUEUED", 0)]
    assert b.finished("big", "tok-big")  # its holder is known to the new component too
    b.tick()
    assert b.status("next")["state"] == "RUNNING"


def test_a_driver_that_stops_checking_in_gives_its_slots_back(tmp_path):
    a = Admitter(quota_file(tmp_path), str(tmp_path / "q.json"), lease_s=30, background=False)
    a.submit(reg("dead", "normal", 4, 4))
    a.submit(reg("next", "normal", 2, 2))
    a.tick()
    a.seen["next"] += 100  # only "next" checked in since
    a.tick(now=a.seen["dead"] + 31)
    assert a.status("dead") == {} and a.status("next")["state"] == "RUNNING"


def test_a_job_already_known_keeps_its_place_when_its_driver_registers_again(tmp_path):
    a = Admitter(quota_file(tmp_path), str(tmp_path / "q.json"), background=False)
    a.submit(reg("big", "normal", 4, 4))
    first = a.submit(reg("next", "normal", 2, 2))
    a.tick()
    again = a.submit(reg("next", "normal", 2, 2, token="a-new-driver"))  # a restarted driver
    assert (again["state"], again["submitted_at"]) == ("QUEUED", first["submitted_at"])


# --- every rule on every path (issue #52) --------------------------------------------------------

def test_the_actor_sets_submission_time_and_slots_itself(tmp_path):
    """A caller's clock (or a made-up early time) does not jump the queue, and a worker's slots
    come from its resources: at 4 CPUs a worker, a 1-worker job needs 4 of the 4 slots."""
    a = Admitter(quota_file(tmp_path), str(tmp_path / "q.json"), background=False)
    a.submit(reg("first", "normal", 2, 2))
    a.submit(reg("early", "normal", 1, 1, cpus=4, submitted_at=0.0, slots_per_worker=1))
    a.tick()
    first, early = a.status("first"), a.status("early")
    assert early["submitted_at"] > first["submitted_at"]
    assert (early["slots_per_worker"], early["state"], first["state"]) == (4, "QUEUED", "RUNNING")
    assert "needs 4 slot(s)" in early["reason"]


def test_finished_from_a_caller_that_does_not_hold_the_seat_is_refused(tmp_path):
    """Another job's driver, a stale one (its job was registered again by a newer driver), or a
    caller without the token cannot give a running job's slots away."""
    a = Admitter(quota_file(tmp_path), str(tmp_path / "q.json"), background=False)
    a.submit(reg("job", "normal", 2, 2, token="old-driver"))
    a.submit(reg("job", "normal", 2, 2, token="new-driver"))
    a.tick()
    assert not a.finished("job", "")
    assert not a.finished("job", "old-driver")
    assert a.status("job")["state"] == "RUNNING"
    assert "old-driver" not in (tmp_path / "q.json").read_text()  # only a digest is kept
    assert a.finished("job", "new-driver") and a.status("job") == {}


def test_a_failed_save_blocks_acting_and_is_retried(tmp_path):
    """The decision to shrink the low job and start the high one is not seen by any driver until
    the document holds it; once storage is back the next tick saves it and they act."""
    folder = tmp_path / "queue"
    where = str(folder / "q.json")
    a = Admitter(quota_file(tmp_path), where, background=False)
    a.submit(reg("low", "low", 1, 4))
    a.tick()
    a.submit(reg("high", "high", 2, 2))
    shutil.move(folder, tmp_path / "away")
    folder.write_text("storage is gone")  # a real failure: every write under it fails
    a.tick()
    assert a.status("high")["state"] == "QUEUED" and a.status("low")["workers"] == 4
    folder.unlink()
    shutil.move(tmp_path / "away", folder)
    a.tick()
    assert (a.status("high")["state"], a.status("low")["workers"]) == ("RUNNING", 2)
    assert load_queue(where).get("high").state == "RUNNING"


@pytest.mark.slow
def test_heartbeats_are_answered_during_a_tick_longer_than_a_lease_and_no_live_job_is_dropped(tmp_path, monkeypatch):
    """A save that takes longer than a driver's lease (slow storage): the drivers keep calling,
    each call is answered while the save runs, and no live job loses its slots."""
    a = Admitter(quota_file(tmp_path), str(tmp_path / "q.json"), lease_s=0.5, background=False)
    a.submit(reg("live", "normal", 2, 2))
    a.tick()
    saving, real = threading.Event(), actor_module.save_queue

    def slow_save(location, queue):  # the one stand-in: storage this slow cannot be had here
        saving.set()
        time.sleep(1.0)
        saving.clear()
        real(location, queue)

    monkeypatch.setattr(actor_module, "save_queue", slow_save)
    busy = threading.Thread(target=lambda: (a.submit(reg("next", "normal", 2, 2)), a.tick(), a.tick()))
    busy.start()
    assert saving.wait(10)
    answered_while_saving = 0
    while busy.is_alive():
        if a.status("live").get("state") == "RUNNING" and saving.is_set():
            answered_while_saving += 1
        time.sleep(0.1)
    busy.join()
    assert answered_while_saving > 0
    a.tick()
    assert a.status("live")["state"] == "RUNNING" and a.status("next")["state"] == "RUNNING"


def test_a_damaged_document_is_set_aside_and_the_queue_rebuilt_from_live_drivers(tmp_path):
    """No crash loop: the component starts, says what happened where `tidal queue` shows it, keeps
    the damaged file for a person to read, and a running job's driver checking in is adopted at
    its size while a waiting one takes a new place."""
    where = tmp_path / "q.json"
    where.write_text('{"version": 1, "jobs": [{"job": "a"')
    a = Admitter(quota_file(tmp_path), str(where), background=False)
    assert a.entries() == []
    (aside,) = tmp_path.glob("q.json.damaged-*")
    assert aside.read_text().startswith('{"version": 1')
    notice = json.loads(where.read_text())["notice"]
    assert "not JSON" in notice and aside.name in notice and "rebuilt" in notice
    a.submit(reg("trainer", "low", 1, 4, running_workers=3))
    a.submit(reg("waiter", "normal", 2, 2))
    a.tick()
    assert (a.status("trainer")["state"], a.status("trainer")["workers_now"]) == ("RUNNING", 3)
    assert a.status("waiter")["state"] in ("QUEUED", "RUNNING")
    assert load_queue(str(where)).notice == notice


def test_tidal_queue_shows_the_clusters_notice_first(tmp_path, monkeypatch, capsys):
    from tidal.cli import main

    where = tmp_path / "q.json"
    where.write_text("[]")  # another shape: damaged
    Admitter(quota_file(tmp_path), str(where), background=False)
    monkeypatch.setenv("TIDAL_QUEUE", str(where))
    capsys.readouterr()
    assert main(["queue"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("NOTICE: the queue document") and "set aside" in out and "the queue is empty" in out


def test_capacity_counts_live_onprem_nodes_in_the_files_unit():
    nodes = [{"Alive": True, "Resources": {"CPU": 8.0, "GPU": 4.0, "site_onprem": 1000.0}, "Labels": {}},
             {"Alive": True, "Resources": {"CPU": 8.0, "GPU": 8.0}, "Labels": {"tidal.io/site": "cloud"}},
             {"Alive": False, "Resources": {"CPU": 8.0, "GPU": 4.0}, "Labels": {}},
             {"Alive": True, "Resources": {"CPU": 2.0}, "Labels": {}}]
    assert onprem_capacity(Quotas(unit="gpus"), nodes) == 4
    assert onprem_capacity(Quotas(unit="workers"), nodes) == 10
    assert onprem_capacity(Quotas(capacity=3), nodes) == 3


def test_a_submitted_job_is_known_by_its_submission_id():
    from tidal.admission.naming import job_key

    config = json.dumps({"runtime_env": {}, "metadata": {"job_submission_id": "low-4f2a1c"}})
    assert job_key("low", {"RAY_JOB_CONFIG_JSON_ENV_VAR": config}) == "low-4f2a1c"
    assert job_key("low", {}) == "low"


def test_the_queue_lives_on_the_clusters_storage_unless_told_otherwise():
    assert queue_document({"TIDAL_STORAGE": "s3://b/runs"}) == "s3://b/runs/.tidal-queue/queue.json"
    assert queue_document({"TIDAL_QUEUE": "/srv/q.json", "TIDAL_STORAGE": "s3://b"}) == "/srv/q.json"


def test_a_burst_of_registrations_at_a_thousand_jobs_costs_one_save(tmp_path, monkeypatch):
    """Each registration used to rewrite the whole queue document under the actor's lock (about
    100 ms at 1,000 jobs on this machine): a burst of 1,000 drivers registering took the actor about
    a minute, past their calls' 15 s timeout. A registration now only joins the queue in memory
    (the seat asks its status until the document holds it); the next tick saves them all at once."""
    a = Admitter(quota_file(tmp_path, capacity=1), str(tmp_path / "q.json"), background=False)
    for i in range(1000):
        a.submit(reg(f"job-{i}", "normal", 1, 1))
    saves: list[int] = []
    real = actor_module.save_queue
    monkeypatch.setattr(actor_module, "save_queue", lambda where, q: (saves.append(len(q.entries)), real(where, q)))
    for i in range(1000, 1100):
        assert a.submit(reg(f"job-{i}", "normal", 1, 1))["state"] == "QUEUED"
    assert saves == [], "no registration waits for a save"
    assert "waiting for the queue document to be saved" in a.status("job-1099")["reason"]
    a.tick()
    assert saves == [1100], "the tick saves every registration at once"
    assert load_queue(str(tmp_path / "q.json")).get("job-1099").position == 1099
