"""A waiting job holds no driver (admission/parking.py): a submitted job's driver that has waited
long enough parks its job with the admission actor and ends; the actor keeps the job's place and
package, and once it admits the job submits its driver again under the successor id the driver
named. The Jobs API is stood in for by a recorder (a real head: tests/test_driverless_queue.py);
the actor and the seat are the real ones, in-process."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import tiny_spec
from tidal.admission.actor import Admitter
from tidal.admission.parking import (
    ATTEMPTS,
    PIN_S,
    RETRY_S,
    Cancelled,
    Gone,
    Parked,
    ParkedStarts,
    may_park,
    successor_id,
)
from tidal.admission.queue_doc import DamagedQueue, Entry, Queue, load_queue, parse_queue
from tidal.admission.seat import Seat, seat
from tidal.errors import TidalError
from tidal.launch.chain import merge_rows

JOB_ENV = {"RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps({"metadata": {"job_submission_id": "waiter-1"}})}


def registration(job: str, workers: int = 1, priority: str = "normal", token: str = "",
                 submission: str = "") -> dict:
    """What a driver sends (admission/seat.py), for a job of a fixed size."""
    return {"job": job, "name": job, "team": None, "priority": priority, "min_workers": workers,
            "max_workers": workers, "cpus_per_worker": 1, "gpus_per_worker": 0, "token": token or f"tok-{job}",
            "submission": submission or job}


class Jobs:
    """Stands in for the Jobs API the actor uses: submits (recorded) and package pins (recorded)."""

    def __init__(self, fail: int = 0, cancelled: bool = False, pin_fails: bool = False) -> None:
        self.sent: list[tuple[str, str]] = []  # (job, submission id)
        self.pins: list[str] = []
        self.fail, self.cancelled, self.pin_fails = fail, cancelled, pin_fails
        self.stops: set[str] = set()  # successor ids a stop has taken
        self.marked: list[tuple[str, str]] = []  # successor ids taken for a dropped job, and why

    def stopped(self, successor: str) -> bool:
        return successor in self.stops

    def mark(self, successor: str, why: str) -> None:
        self.marked.append((successor, why))

    def relaunch(self, entry: Entry) -> str:
        if self.cancelled:
            raise Cancelled(entry.successor)
        if self.fail:
            self.fail -= 1
            raise ConnectionError("the Jobs API is not up")
        self.sent.append((entry.job, entry.successor))
        return entry.successor

    def pin(self, submission: str, seconds: float) -> int:
        if self.pin_fails:
            raise ConnectionError("the GCS did not answer")
        self.pins.append(submission)
        return 1


@pytest.fixture
def full(tmp_path, monkeypatch):
    """Two slots, both held by `big`; the actor in-process with a recorder for the Jobs API."""
    quotas = tmp_path / "quotas.yaml"
    quotas.write_text(yaml.safe_dump({"capacity": 2, "min_resize_interval_s": 0}))
    monkeypatch.setenv("TIDAL_QUOTAS", str(quotas))
    where = str(tmp_path / "q.json")

    def make(**kw) -> tuple[Admitter, Jobs]:
        jobs = Jobs(**kw)
        a = Admitter(str(quotas), where, background=False, lease_s=5, relauncher=jobs.relaunch, pinner=jobs.pin,
                     stopped=jobs.stopped, marker=jobs.mark)
        return a, jobs

    a, jobs = make()
    a.submit(registration("big", workers=2))
    a.tick()
    return a, jobs, where, make


def as_submitted_driver(monkeypatch, actor: Admitter) -> list[str]:
    """This process as a Ray Job's driver whose seat talks to `actor`; the calls it makes."""
    for k, v in JOB_ENV.items():
        monkeypatch.setenv(k, v)
    calls: list[str] = []

    def call(self: Seat, method: str, *args):
        calls.append(method)
        return getattr(actor, method)(*args)

    monkeypatch.setattr(Seat, "_call", call)
    return calls


def test_a_submitted_job_that_waits_parks_and_starts_as_its_successor_once_admitted(full, tmp_path, monkeypatch):
    a, jobs, where, _ = full
    monkeypatch.setenv("TIDAL_PARK_AFTER_S", "0")
    calls = as_submitted_driver(monkeypatch, a)
    with pytest.raises(Parked) as parked, seat(tiny_spec(tmp_path, name="waiter")):
        pass
    assert "park" in calls and "finished" not in calls, "a parked driver does not give the seat back"
    successor = parked.value.successor
    assert successor == "waiter-1-p", "its own submission id and -p: anyone holding the first id finds it"
    saved = load_queue(where).get("waiter-1")
    assert (saved.state, saved.successor) == ("QUEUED", successor), "saved before the driver left"
    assert jobs.pins == ["waiter-1"], "its package pinned before its driver's end could free it"
    # No driver checks in for it: far past its lease it keeps its place (big's driver does check in).
    a.seen["big"] = time.time() + 60
    a.tick(time.time() + 60)
    assert load_queue(where).get("waiter-1") is not None
    assert jobs.sent == []
    # `big` ends: the parked job is admitted and its driver submitted, once, under its successor id.
    assert a.finished("big", "tok-big")
    a.tick()
    a.tick()
    assert jobs.sent == [("waiter-1", successor)]
    entry = load_queue(where).get("waiter-1")
    assert (entry.state, entry.submission, entry.successor) == ("RUNNING", successor, "")
    # The successor's driver registers under the job's key and runs at its size.
    again = {**registration("waiter-1", workers=2, token="tok-next", submission=successor), "name": "waiter"}
    assert a.submit(again)["workers"] == 2
    assert a.finished("waiter-1", "tok-next")


def test_a_damaged_document_keeps_its_parked_jobs_which_start_once_admitted(full, tmp_path, monkeypatch):
    """A parked job has no driver to check in again: set aside with the document, it was lost."""
    import json

    a, _, where, make = full
    monkeypatch.setenv("TIDAL_PARK_AFTER_S", "0")
    as_submitted_driver(monkeypatch, a)
    with pytest.raises(Parked), seat(tiny_spec(tmp_path, name="waiter")):
        pass
    doc = json.loads(Path(where).read_text())
    doc["jobs"].append({**doc["jobs"][0], "job": "../elsewhere"})  # one bad entry damages the document
    Path(where).write_text(json.dumps(doc))
    again, jobs = make()  # the actor restarted and reads it
    assert [e.job for e in again.queue.entries] == ["waiter-1"] and "parked job(s)" in again.queue.notice
    again.submit(registration("big", workers=2))  # big's driver checks in, then ends
    again.tick()
    assert again.finished("big", "tok-big")
    again.tick()
    again.tick()
    assert jobs.sent == [("waiter-1", "waiter-1-p")]


def test_a_job_admitted_meanwhile_or_a_caller_not_holding_the_seat_does_not_park(full):
    a, jobs, where, _ = full
    assert not a.park("big", "tok-big", "big-q1"), "a RUNNING job runs"
    a.submit(registration("w"))
    assert not a.park("w", "someone-else", "w-q1")
    assert not a.park("w", "tok-w", "not a submission id!")
    assert not a.queue.get("w").successor


def test_a_park_asked_again_after_a_lost_answer_is_confirmed_not_refused(full):
    """The driver's call can time out after the actor parked the job (a busy actor): asked again
    with the same successor id, the actor says yes, so the driver leaves as the document says."""
    a, jobs, where, _ = full
    a.submit(registration("w"))
    a.tick()
    assert a.park("w", "tok-w", "w-q1")
    assert a.park("w", "tok-w", "w-q1"), "the same driver, the same successor: confirmed"
    assert not a.park("w", "someone-else", "w-q1")
    assert jobs.pins == ["w"], "pinned once"


def test_a_driver_whose_park_answer_was_lost_leaves_instead_of_training(full, tmp_path, monkeypatch):
    """The park landed but its answer timed out; the job is admitted before the driver asks again.
    The driver must not train (admission starts the successor): it sees its own successor in the
    job's entry and leaves. A late registration from it does not un-park the job either."""
    a, jobs, where, _ = full
    monkeypatch.setenv("TIDAL_PARK_AFTER_S", "0")
    calls = as_submitted_driver(monkeypatch, a)
    real_park = Admitter.park

    def park_answer_lost(self, *args):
        real_park(self, *args)
        return None  # what Seat._call gives for a call that timed out

    monkeypatch.setattr(Admitter, "park", park_answer_lost)
    s = Seat(tiny_spec(tmp_path, name="waiter"))
    s.registration["submission"] = "waiter-1"
    lost = dict(s.registration)
    assert a.finished("big", "tok-big")
    with pytest.raises(Parked):
        s.wait(poll_s=0.0, park=True)
    assert calls.count("park") == 1
    a.submit(lost)  # the parked driver's own registration, arriving late
    assert a.queue.get(s.job).successor == "waiter-1-p", "still parked"
    a.tick()
    a.tick()
    assert jobs.sent == [(s.job, "waiter-1-p")], "started once, by admission"


def test_a_parked_job_whose_record_is_gone_leaves_the_queue_and_says_why():
    marked: list[tuple[str, str]] = []

    def gone(entry):
        raise Gone(entry.submission)

    starts = ParkedStarts(lambda: gone, lambda: lambda successor, why: marked.append((successor, why)))
    admitted = Entry("w", "w", "default", "normal", 1, 1, 1.0, state="RUNNING", workers=1, submission="w",
                     successor="w-p")
    assert starts.run(Queue((admitted,))) == ({}, ["w"])
    assert marked and marked[0][0] == "w-p" and "record is gone" in marked[0][1], \
        "its successor id says why, so Job.status() of it is FAILED, not QUEUED forever"


def test_no_pin_or_no_save_no_parking(full, tmp_path, monkeypatch):
    """The driver leaves only once its package is kept and the document says the job is parked:
    else it keeps waiting (and so holds its package and its place)."""
    a, jobs, where, make = full
    reg = registration("w")
    a.submit(reg)
    jobs.pin_fails = True
    assert not a.park("w", "tok-w", "w-q1")
    jobs.pin_fails = False
    monkeypatch.setattr("tidal.admission.actor.save_queue", lambda *_: (_ for _ in ()).throw(OSError("disk full")))
    assert not a.park("w", "tok-w", "w-q1")
    assert not a.queue.get("w").successor, "nothing recorded that the document does not hold"


def test_a_start_that_fails_is_tried_again_then_the_job_leaves_the_queue_saying_so(full, caplog):
    a, jobs, where, make = full
    b, jobs = make(fail=ATTEMPTS)
    b.submit(registration("w"))
    assert b.park("w", "tok-w", "w-q1")
    assert b.finished("big", "tok-big")
    now = time.time()
    with caplog.at_level(logging.ERROR, logger="tidal"):
        for i in range(ATTEMPTS + 1):
            b.tick(now + i * RETRY_S)
    assert jobs.sent == [] and load_queue(where).get("w") is None
    assert "its driver could not be started" in caplog.text and "submit it again" in caplog.text
    assert [m[0] for m in jobs.marked] == ["w-q1"], "its next id says why it never started"


def test_a_job_stopped_while_parked_leaves_the_queue_when_its_turn_comes(full):
    a, jobs, where, make = full
    b, jobs = make(cancelled=True)
    b.submit(registration("w"))
    assert b.park("w", "tok-w", "w-q1")
    assert b.finished("big", "tok-big")
    b.tick()
    b.tick()
    assert load_queue(where).get("w") is None and jobs.sent == []


def test_a_parked_job_stopped_while_it_waits_leaves_before_anyone_makes_room_for_it(full):
    """Stopped while parked, a high-priority job would still have shrunk or suspended a running job
    when its turn came, only to be dropped then. Among the first in the queue, a stop is looked for
    every few seconds: the job leaves while the running one keeps its size."""
    a, jobs, where, _ = full
    a.submit(registration("w", workers=2, priority="high"))
    assert a.park("w", "tok-w", "w-p")
    jobs.stops.add("w-p")  # `tidal stop` took its next id
    a.seen["big"] = time.time() + 60  # big's driver checks in all along
    a.tick(time.time() + 11)
    assert load_queue(where).get("w") is None, "out of the queue"
    a.tick(time.time() + 12)
    assert load_queue(where).get("big").workers == 2 and jobs.sent == [], "nobody made room for it"


def test_a_restarted_actor_pins_parked_packages_again_and_keeps_them_past_the_lease(full):
    a, jobs, where, make = full
    a.submit(registration("w"))
    assert a.park("w", "tok-w", "w-q1")
    b, jobs2 = make()  # Ray restarted the actor: it knows no pin times
    b.seen["big"] = time.time() + PIN_S  # big's driver checks in all along
    b.tick(time.time() + 60)
    assert jobs2.pins == ["w"], "pinned again at once"
    b.tick(time.time() + 60 + PIN_S / 4)
    assert jobs2.pins == ["w"], "not again before half the pin has run"
    assert load_queue(where).get("w").successor == "w-q1"


def test_only_a_submitted_driver_that_waited_long_enough_parks():
    assert may_park({}, "sub-1", 30.0)
    assert not may_park({}, "sub-1", 29.0), "30 s by default: a short wait keeps its driver"
    assert not may_park({}, "", 1e9), "a `tidal run` in a terminal or a notebook is the person's own process"
    assert not may_park({"TIDAL_PARK_AFTER_S": "-1"}, "sub-1", 1e9)
    assert may_park({"TIDAL_PARK_AFTER_S": "0"}, "sub-1", 0.0)
    with pytest.raises(TidalError, match="TIDAL_PARK_AFTER_S='soon' is not a number"):
        may_park({"TIDAL_PARK_AFTER_S": "soon"}, "sub-1", 0.0)
    assert len(successor_id("j" * 128)) == 128


def test_a_successor_read_from_storage_is_checked():
    doc = {"version": 1, "jobs": [{"job": "w", "name": "w", "team": "t", "priority": "normal", "min_workers": 1,
                                   "max_workers": 1, "submitted_at": 1.0, "successor": "../../etc"}]}
    with pytest.raises(DamagedQueue, match="successor"):
        parse_queue(doc, "test")


def test_tidal_list_shows_a_parked_job_where_it_is_now():
    rows = [{"id": "a", "name": "x", "status": "SUCCEEDED", "start_time": 1},
            {"id": "a-q1", "name": "x", "status": "RUNNING", "step": 7, "start_time": 9},
            {"id": "b", "name": "y", "status": "SUCCEEDED", "start_time": 2},
            {"id": "c", "name": "z", "status": "SUCCEEDED", "start_time": 3}]
    merged = {r["id"]: r for r in merge_rows(rows, {"a": "a-q1", "b": "b-q1", "c": "c-q1"}, {"c-q1"})}
    assert set(merged) == {"a", "b", "c"}
    assert (merged["a"]["status"], merged["a"]["step"], merged["a"]["start_time"]) == ("RUNNING", 7, 1)
    assert merged["b"]["status"] == "QUEUED" and merged["c"]["status"] == "STOPPED"
