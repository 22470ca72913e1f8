"""One live attempt per job (tidal/lease.py), on a local folder and on a real S3 API (moto's server):
a second start of a live job is refused naming the live one, a dead or released holder frees the
job, exactly one of two racing starts wins, and a superseded attempt's check says so."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from tests.helpers import STORAGES
from tidal.errors import JobAlreadyRunning
from tidal.lease import Lease, LeaseCheck, latest


@pytest.fixture(params=STORAGES)
def storage(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "runs")
    return request.getfixturevalue("bucket") + "/runs"


def test_a_second_start_of_a_live_job_is_refused_naming_the_live_driver(storage):
    first = Lease(storage, "job", ttl=30)
    assert first.acquire() == 1
    with pytest.raises(JobAlreadyRunning) as e:
        Lease(storage, "job", ttl=30).acquire()
    text = str(e.value)
    assert f"pid {os.getpid()}" in text and "already running" in text
    assert "--wait" in text and f"kill {os.getpid()}" in text
    assert latest(first.fs, first.path).generation == 1  # the refused start wrote nothing


def test_a_released_lease_is_taken_at_once_by_the_next_generation(storage):
    first = Lease(storage, "job", ttl=30)
    first.acquire()
    first.release()
    second = Lease(storage, "job", ttl=30)
    assert second.acquire() == 2
    assert not first.check().current(fresh=True)  # the old generation's writers stop
    assert second.check().current(fresh=True)


@pytest.mark.slow
def test_a_lease_not_renewed_within_its_ttl_is_taken_over_and_the_old_holder_learns_it(storage):
    # The holder is this process (alive on this host): only the expiry can free it.
    first = Lease(storage, "job", ttl=0.5)
    first.acquire()
    with pytest.raises(JobAlreadyRunning):
        Lease(storage, "job", ttl=0.5).acquire()
    time.sleep(0.8)
    second = Lease(storage, "job", ttl=30)
    assert second.acquire() == 2
    assert not first.renew() and first.lost.is_set()
    assert first.taken_by is not None and first.taken_by.generation == 2
    first.release()  # a lost lease releases nothing: the newer one stays live
    with pytest.raises(JobAlreadyRunning):
        Lease(storage, "job", ttl=30).acquire()


@pytest.mark.slow
def test_a_driver_killed_on_this_host_frees_its_job_at_once(tmp_path):
    storage = str(tmp_path / "runs")
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]);"
            "from tidal.lease import Lease; Lease(sys.argv[2], 'job', ttl=300).acquire(); print('held', flush=True);"
            "time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, os.path.join(os.path.dirname(__file__), "..", "platform"),
                             storage], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(JobAlreadyRunning):
            Lease(storage, "job").acquire()
    finally:
        proc.kill()
        proc.wait()
    assert Lease(storage, "job").acquire() == 2  # no 300 s wait: its process is gone


def test_of_two_racing_starts_exactly_one_wins(storage):
    results: list[str] = []

    def start() -> None:
        try:
            Lease(storage, "job", ttl=30).acquire()
            results.append("won")
        except JobAlreadyRunning:
            results.append("refused")

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["refused", "refused", "refused", "won"]


@pytest.mark.slow
def test_wait_starts_once_the_live_holder_releases(tmp_path):
    storage = str(tmp_path / "runs")
    first = Lease(storage, "job", ttl=30)
    first.acquire()
    lines: list[str] = []
    threading.Timer(0.5, first.release).start()
    assert Lease(storage, "job").acquire(wait=True, poll_s=0.1, say=lines.append) == 2
    assert len(lines) == 1 and "waiting for it to end" in lines[0]


def test_a_check_that_cannot_list_the_lease_counts_as_current(tmp_path):
    """A storage error proves nothing: a live attempt is never stopped for one."""
    lease = Lease(str(tmp_path / "runs"), "job")
    lease.acquire()
    check = lease.check()

    class Unreachable:
        def get_file_info(self, *_):
            raise OSError("503 Slow Down")

    check.fs = Unreachable()
    assert check.current(fresh=True)


def test_the_lease_lives_beside_the_run_folder_so_restart_does_not_move_it(tmp_path):
    from tidal.storage import RunDir

    storage = str(tmp_path / "runs")
    run = RunDir(storage, "job")
    run.write_json("tidal-job.json", {})
    lease = Lease(storage, "job")
    lease.acquire()
    assert run.set_aside()
    assert LeaseCheck(storage, "job", 1).current(fresh=True)
    with pytest.raises(JobAlreadyRunning):
        Lease(storage, "job").acquire()
