"""The lease (tidal/lease.py) when storage answers badly: a listing that fails never frees a live
job, a generation number is never taken twice, a lost create backs off instead of spinning, a
renewal is written even when the listing fails, and a writer that cannot confirm it is current
for a whole lease length stops. Each against a real lease folder on a local disk, its listing made
to fail by a wrapper around pyarrow's filesystem."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from tests.conftest import tiny_spec
from tidal import lease as lease_mod
from tidal.errors import JobAlreadyRunning, TidalError
from tidal.lease import Lease, LeaseCheck, LeaseUnreadable
from tidal.storage import RunDir


class FlakyListing:
    """pyarrow's local filesystem whose folder listings fail `fail` times (a 503, a dropped
    connection): every other call goes through."""

    def __init__(self, fail: int) -> None:
        self.inner, self.fail = pafs.LocalFileSystem(), fail

    def get_file_info(self, what):
        if isinstance(what, pafs.FileSelector) and self.fail > 0:
            self.fail -= 1
            raise OSError("When listing objects under key 'runs/live.lease': AWS Error SLOW_DOWN (503)")
        return self.inner.get_file_info(what)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def other_hosts_generation(storage: str, name: str, generation: int) -> Path:
    """A live holder on another host, its older generation files already deleted."""
    folder = Path(storage) / f"{name}.lease"
    folder.mkdir(parents=True, exist_ok=True)
    now = time.time()
    doc = {"generation": generation, "host": "gpu-node-7", "pid": 4242, "pid_started": 1.0, "since": now - 600,
           "renewed": now, "ttl_s": 30.0, "face": "tidal run job.yaml", "submission_id": ""}
    (folder / f"{generation:012d}.json").write_text(json.dumps(doc))
    return folder


def test_a_listing_that_fails_once_while_another_hosts_generation_is_live_refuses_and_touches_nothing(
        tmp_path: Path, monkeypatch):
    from tidal.launch import trainer

    spec = tiny_spec(tmp_path, name="live")
    storage = spec.checkpoint.storage
    folder = other_hosts_generation(storage, "live", 5)
    RunDir(storage, "live").write_json("tidal-job.json", {"mlflow_run_id": "r"})
    flaky = FlakyListing(fail=1)
    monkeypatch.setattr(lease_mod, "lease_path", lambda s, n: (flaky, f"{s}/{n}.lease"))
    monkeypatch.setattr(lease_mod, "check_store", lambda *_: None, raising=False)  # a local disk underneath

    def never(*_a, **_k):
        raise AssertionError("reached past the lease")

    monkeypatch.setattr(trainer, "connect_ray", never)
    monkeypatch.setattr(trainer, "find_resume_point", never)
    with pytest.raises(LeaseUnreadable, match="could not read job 'live'.s lease") as e:
        trainer.run(spec, restart=True)
    assert "SLOW_DOWN" in str(e.value) and "without touching its folder" in str(e.value)
    assert sorted(p.name for p in folder.iterdir()) == ["000000000005.json"], "no generation taken"
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["live", "live.lease"], "nothing set aside"
    assert RunDir(storage, "live").read_json("tidal-job.json") == {"mlflow_run_id": "r"}
    # Once the listing answers, the live holder is what the start sees.
    with pytest.raises(JobAlreadyRunning, match="gpu-node-7"):
        Lease(storage, "live").acquire()


def test_a_start_that_waits_keeps_waiting_through_a_failed_listing(tmp_path: Path, monkeypatch):
    storage = str(tmp_path / "runs")
    flaky = FlakyListing(fail=2)
    monkeypatch.setattr(lease_mod, "lease_path", lambda s, n: (flaky, f"{s}/{n}.lease"))
    monkeypatch.setattr(lease_mod, "check_store", lambda *_: None, raising=False)  # a local disk underneath
    lines: list[str] = []
    lease = Lease(storage, "job")
    real = lease_mod.create_exclusive
    monkeypatch.setattr(lease_mod, "create_exclusive", lambda _s, path, data: real(pafs.LocalFileSystem(), path, data))
    assert lease.acquire(wait=True, poll_s=0.01, say=lines.append) == 1
    assert len(lines) == 1 and "could not read job 'job'" in lines[0]


def test_a_lost_create_backs_off_and_gives_up_naming_the_file_in_the_way(tmp_path: Path, monkeypatch):
    """A file the listing does not count (here: every create loses) never makes acquire spin."""
    calls: list[int] = []
    pauses: list[float] = []

    def lose(*_a) -> bool:
        calls.append(1)
        if len(calls) > 100:
            raise AssertionError("acquire spins on a lost create")
        return False

    monkeypatch.setattr(lease_mod, "create_exclusive", lose)
    monkeypatch.setattr(lease_mod, "_pause", pauses.append)
    with pytest.raises(TidalError, match="000000000001.json exists"):
        Lease(str(tmp_path / "runs"), "job").acquire()
    assert len(calls) == lease_mod.MAX_LOST_CREATES
    assert len(pauses) == len(calls) - 1 and all(p > 0 for p in pauses)
    assert max(pauses) > 10 * min(pauses), "the pause grows"


def test_a_generation_number_is_never_taken_twice(tmp_path: Path):
    storage = str(tmp_path / "runs")
    for expected in range(1, 7):
        lease = Lease(storage, "job")
        assert lease.acquire() == expected
        lease.release()
    kept = sorted(p.name for p in (tmp_path / "runs" / "job.lease").iterdir())
    assert kept[-1] == "000000000006.json" and len(kept) == lease_mod.KEEP_GENERATIONS


def test_a_renewal_is_written_even_when_the_listing_fails(tmp_path: Path, monkeypatch):
    storage = str(tmp_path / "runs")
    lease = Lease(storage, "job", ttl=30)
    lease.acquire()
    path = Path(lease._file(1))
    before = json.loads(path.read_text())["renewed"]
    time.sleep(0.02)
    lease.fs = FlakyListing(fail=1)
    assert lease.renew() and not lease.lost.is_set()
    assert json.loads(path.read_text())["renewed"] > before, "the renewal was written"


def test_a_holder_unconfirmed_for_a_whole_lease_length_stops(tmp_path: Path):
    storage = str(tmp_path / "runs")
    lease = Lease(storage, "job", ttl=30)
    lease.acquire()
    lease.fs = FlakyListing(fail=10)
    assert lease.renew()  # within a lease length: a transient error stops nothing
    lease._confirmed -= 31
    assert not lease.renew() and lease.lost.is_set()
    assert "could not be read for over 30s" in lease.why_lost()


def test_a_writer_unconfirmed_for_a_whole_lease_length_stops(tmp_path: Path):
    lease = Lease(str(tmp_path / "runs"), "job", ttl=30)
    lease.acquire()
    check = LeaseCheck.from_config(lease.storage, "job", lease.config())
    assert check is not None and check.ttl_s == 30
    check.fs = FlakyListing(fail=10)
    assert check.current(fresh=True)  # within a lease length
    check._confirmed_at -= 31
    assert not check.current(fresh=True) and not check.current(fresh=True)
    assert "could not be read for over 30s" in check.why()


def test_an_unreadable_holder_file_counts_as_live(tmp_path: Path):
    """A generation file caught half-written (or unreadable for a moment) is a holder, never a gap."""
    storage = str(tmp_path / "runs")
    folder = tmp_path / "runs" / "job.lease"
    folder.mkdir(parents=True)
    (folder / "000000000002.json").write_text("{\"gener")
    with pytest.raises(JobAlreadyRunning, match="on host \\?"):
        Lease(storage, "job").acquire()


def test_a_credential_on_the_drivers_command_line_never_reaches_the_lease_or_a_refusal(tmp_path: Path, monkeypatch):
    """The command is redacted whole, then cut to its 80 characters: cut first, a credential split
    in two is no longer recognised and its first half is kept."""
    from tidal.lease import driver_command

    key, secret = "ml", "wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY"  # the cut at 77 falls inside the secret
    monkeypatch.setattr("sys.argv", ["/usr/bin/tidal", "run", "jobs/quickstart.yaml", "--set",
                                     f"checkpoint.storage=s3://{key}:{secret}@bucket/runs"])
    storage = str(tmp_path / "runs")
    Lease(storage, "job", face=driver_command()).acquire()
    written = (tmp_path / "runs" / "job.lease" / "000000000001.json").read_text()
    with pytest.raises(JobAlreadyRunning) as e:
        Lease(storage, "job").acquire()
    for shown in (written, str(e.value)):
        assert "tidal run jobs/quickstart.yaml" in shown
        assert secret[:6] not in shown


class FlakyRead:
    """pyarrow's local filesystem whose file reads fail `fail` times (a dropped connection)."""

    def __init__(self, fail: int) -> None:
        self.inner, self.fail = pafs.LocalFileSystem(), fail

    def open_input_stream(self, path):
        if self.fail > 0:
            self.fail -= 1
            raise OSError(f"When reading information for key '{path}': AWS Error NETWORK_CONNECTION (connection reset)")
        return self.inner.open_input_stream(path)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("fails", [1, 3])
def test_a_start_whose_read_back_fails_takes_its_lease_not_refuses_itself(tmp_path: Path, monkeypatch, fails):
    """The create succeeded, the read-back of the nonce failed (once; every time it was tried, so that
    the next listing tells): the start is its own holder, not 'already running' under its own pid."""
    from tidal import exclusive

    flaky = FlakyRead(fail=fails)
    monkeypatch.setattr(lease_mod, "lease_path", lambda s, n: (flaky, f"{s}/{n}.lease"))
    monkeypatch.setattr(lease_mod, "check_store", lambda *_: None)  # a local disk underneath: O_EXCL
    monkeypatch.setattr(lease_mod, "create_exclusive",
                        lambda _s, path, data: exclusive.create_exclusive(pafs.LocalFileSystem(), path, data))
    lease = Lease(str(tmp_path), "job", ttl=30)
    assert lease.acquire() == 1
    assert lease.renew() and not lease.lost.is_set()
