"""The queue's durable state: saved and read back identical (local disk and S3), survives the
owner's restart through one decide/apply round, and a damaged document is an error, not an
empty queue (which would silently drop every queued job)."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from tidal.admission.policy import decide
from tidal.admission.queue_doc import (
    DamagedQueue,
    Entry,
    Queue,
    apply,
    finished,
    load_queue,
    queue_location,
    running,
    save_queue,
    submitted,
    waiting,
)
from tidal.admission.quotas import Quotas
from tidal.errors import TidalError

QUOTAS = Quotas(min_resize_interval_s=0)


def entry(job: str, priority: str, lo: int, hi: int, at: float) -> Entry:
    return Entry(job, f"name-{job}", "default", priority, lo, hi, at)


def one_round(q: Queue, now: float, capacity: int = 4) -> Queue:
    return apply(q, decide(capacity, running(q), waiting(q), QUOTAS, now), now)


def test_queue_round_trips_identically_and_survives_the_owners_restart(tmp_path):
    where = queue_location(str(tmp_path))
    assert load_queue(where) == Queue()
    q = submitted(Queue(), entry("low", "low", 1, 4, 1.0))
    q = one_round(q, now=10.0)
    q = submitted(q, entry("rigid", "normal", 4, 4, 2.0))
    q = submitted(q, entry("high", "high", 2, 2, 3.0))
    q = one_round(q, now=20.0)
    save_queue(where, q)
    back = load_queue(where)  # a new owner, after the old one died
    assert back == q
    assert {e.job: (e.state, e.workers) for e in back.entries} == {
        "low": ("RUNNING", 2), "rigid": ("QUEUED", 0), "high": ("RUNNING", 2)}
    rigid = back.get("rigid")
    assert rigid.position == 1 and "needs 4 slot(s)" in rigid.reason
    # the high job ends: rigid (normal) outranks low, which cannot shrink far enough, so low is suspended
    after = one_round(finished(back, "high"), now=30.0)
    assert (after.get("rigid").state, after.get("rigid").workers) == ("RUNNING", 4)
    assert (after.get("low").state, after.get("low").workers) == ("SUSPENDED", 0)


def test_suspended_job_keeps_its_state_across_a_restart_and_resumes_when_room_returns(tmp_path):
    where = queue_location(str(tmp_path))
    q = one_round(submitted(Queue(), entry("rigid", "low", 4, 4, 1.0)), now=10.0)
    q = one_round(submitted(q, entry("high", "high", 2, 2, 2.0)), now=20.0)
    assert q.get("rigid").state == "SUSPENDED"
    save_queue(where, q)
    q = load_queue(where)
    assert q.get("rigid").state == "SUSPENDED"
    q = one_round(finished(q, "high"), now=30.0)
    assert (q.get("rigid").state, q.get("rigid").workers) == ("RUNNING", 4)


def test_a_job_is_queued_once(tmp_path):
    q = submitted(Queue(), entry("a", "low", 1, 1, 1.0))
    with pytest.raises(TidalError, match="already in the queue"):
        submitted(q, entry("a", "low", 1, 1, 2.0))


def test_damaged_queue_document_is_an_error_not_an_empty_queue(tmp_path):
    where = queue_location(str(tmp_path))
    save_queue(where, submitted(Queue(), entry("a", "low", 1, 1, 1.0)))
    (tmp_path / ".tidal-queue" / "queue.json").write_text('{"version": 1, "jobs": [{"job": "a"')
    with pytest.raises(DamagedQueue, match="not JSON"):
        load_queue(where)


def test_names_read_from_the_document_are_checked_and_a_bad_one_damages_it(tmp_path):
    """The document is untrusted input (issue #47): a job key or team that could name another
    folder, a size of the wrong type, a job listed twice, an unknown field: all damage it."""
    where = queue_location(str(tmp_path))
    good = asdict(entry("a", "low", 1, 1, 1.0))
    for bad in ({"job": "../../etc"}, {"team": "a/b"}, {"min_workers": "1"}, {"max_workers": 0},
                {"workers": True}, {"state": "DONE"}, {"submitted_at": "yesterday"}, {"extra": 1}):
        save_queue(where, Queue())
        (tmp_path / ".tidal-queue" / "queue.json").write_text(json.dumps({"version": 1, "jobs": [{**good, **bad}]}))
        with pytest.raises(DamagedQueue):
            load_queue(where)
    (tmp_path / ".tidal-queue" / "queue.json").write_text(json.dumps({"version": 1, "jobs": [good, good]}))
    with pytest.raises(DamagedQueue, match="twice"):
        load_queue(where)


@pytest.mark.slow
def test_queue_round_trips_on_s3(bucket):
    where = queue_location(f"{bucket}/runs")
    q = one_round(submitted(Queue(), entry("low", "low", 1, 4, 1.0)), now=10.0)
    save_queue(where, q)
    assert load_queue(where) == q


def test_entry_takes_the_clusters_default_team_and_priority_and_counts_gpus(tmp_path):
    from tests.conftest import ROOT, tiny_spec
    from tidal.admission.queue_doc import entry_for
    from tidal.admission.quotas import load_quotas

    quotas = load_quotas(str(ROOT / "cluster_configs" / "quotas.yaml"))  # unit: gpus, defaults research/normal
    spec = tiny_spec(tmp_path).with_overrides({"scaling.gpus_per_worker": 2, "scaling.min_workers": 1,
                                               "scaling.max_workers": 2})
    e = entry_for(spec, "raysubmit_1", quotas, now=5.0)
    assert (e.team, e.priority, e.slots_per_worker, e.state) == ("research", "normal", 2, "QUEUED")
    e = entry_for(spec.with_overrides({"scheduling.team": "production", "scheduling.priority": "high"}), "x", quotas, 5.0)
    assert (e.team, e.priority) == ("production", "high")
