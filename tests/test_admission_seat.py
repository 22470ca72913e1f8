"""A job's seat (admission/seat.py), from its driver's side: what it does while the cluster's
admission cannot be reached. The actor's answers are stood in for (`Seat._call`, the one place
the seat meets Ray): an actor that stays unreachable for minutes cannot be had in a unit test;
tests/test_admission_sharing.py kills the real one."""

from __future__ import annotations

import threading
import time

import pytest

from tests.conftest import tiny_spec
from tidal.admission import seat as seat_module
from tidal.admission.seat import Seat


@pytest.mark.slow
def test_an_unreachable_actor_makes_a_job_wait_visibly_and_never_fail(tmp_path, monkeypatch, capsys):
    """It used to raise after TIDAL_ADMISSION_WAIT_S (300 s) of silence, failing every queued and
    suspended job while the actor restarted. Now the job keeps waiting, says so again as the
    silence goes on, and starts once the actor answers."""
    monkeypatch.delenv("TIDAL_QUOTAS", raising=False)
    monkeypatch.setattr(seat_module, "SAY_SILENCE_S", 0.1)
    monkeypatch.setattr(seat_module, "SILENT_LIMIT_S", 0.1, raising=False)  # the old limit, where it exists
    seat = Seat(tiny_spec(tmp_path))
    answer: dict = {"now": None}  # None: the call did not get through
    monkeypatch.setattr(seat, "_call", lambda method, *args: answer["now"])
    got: dict = {}

    def wait() -> None:
        try:
            got["workers"] = seat.wait(poll_s=0.02)
        except Exception as e:  # noqa: BLE001 - what the test looks for
            got["error"] = e

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    time.sleep(1.0)  # ten times the silence that used to fail it
    assert "error" not in got and waiter.is_alive()
    answer["now"] = {"job": seat.job, "state": "RUNNING", "workers": 2, "position": None, "reason": ""}
    waiter.join(10)
    assert got == {"workers": 2}
    out = capsys.readouterr().out
    assert "WAITING: the cluster's admission" in out and "keeps its place" in out
    assert "has not answered for" in out  # said again as the silence goes on


def test_the_registration_carries_resources_and_a_token_not_slots_or_a_time(tmp_path, monkeypatch):
    monkeypatch.delenv("TIDAL_QUOTAS", raising=False)
    spec = tiny_spec(tmp_path).with_overrides({"scaling.cpus_per_worker": 4})
    seat = Seat(spec)
    r = seat.registration
    assert (r["cpus_per_worker"], r["gpus_per_worker"]) == (4, 0) and len(r["token"]) == 32
    assert "slots_per_worker" not in r and "submitted_at" not in r
    assert Seat(spec).token != seat.token


def test_a_driver_started_again_for_a_running_job_holds_its_seat_and_gives_it_back(tmp_path, monkeypatch):
    """A job's driver started again while the queue still lists the job RUNNING under the lost
    driver (admission relaunched it after a head restart, or a person ran it again): it starts at
    the job's size, and its `finished` gives the slots back. It used to ask only the job's status,
    never registering, so its `finished` was refused as not the holder's and the slots stayed
    taken until the lease ran out (60 s, seen in tests/test_head_restart.py)."""
    import yaml

    from tidal.admission.actor import Admitter

    quotas = tmp_path / "quotas.yaml"
    quotas.write_text(yaml.safe_dump({"capacity": 2, "min_resize_interval_s": 0}))
    monkeypatch.setenv("TIDAL_QUOTAS", str(quotas))
    actor = Admitter(str(quotas), str(tmp_path / "q.json"), background=False)
    lost, again = Seat(tiny_spec(tmp_path)), Seat(tiny_spec(tmp_path))
    for s in (lost, again):
        monkeypatch.setattr(s, "_call", lambda method, *args: getattr(actor, method)(*args))
    actor.submit(lost.registration)
    actor.tick()
    assert again.wait(poll_s=0.01) == 2
    again.release()
    assert actor.status(again.job) == {}, "the new driver's `finished` gave the seat back"
