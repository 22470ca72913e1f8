"""One live attempt per job: the lease on a job's run folder, on any storage.

A job's checkpoints, event log and MLflow run have one owner at a time: the driver holding the
job's lease. Two drivers of one job (a retried `tidal run`, two `tidal submit`s, a notebook cell
run twice) would otherwise both train into the same folder: the second's first save clears the
first's in-flight checkpoint as stale, both rewrite the same manifests, and both trackers send
one event log into one MLflow run, every step twice.

The lease is a folder of generation files beside the run folder, `<storage>/<name>.lease/
<generation>.json`, each created exclusively: an `O_EXCL` create on a local or shared (NFS)
filesystem, a conditional PUT (`If-None-Match: *`) on S3. pyarrow offers neither, and nothing
in Ray, DeepSpeed or MLflow fences a job's storage, hence this module. The current holder is
the highest generation; taking the lease over from a holder that stopped renewing is creating
the next generation, which only one contender can do. Every writer that could harm a newer
attempt (rank 0's event log, each rank's checkpoint manifest, the attempt's stale-folder
clearing, the tracker's MLflow writes) checks that no higher generation exists before it
writes (`LeaseCheck`), and a stale attempt stops itself instead. That check needs no clock:
only *when* a lease may be taken over does (its holder's renewals, `ttl_s`), so clocks must
agree to within a few seconds (NTP) for a takeover to wait its full length.

Beside the run folder, not in it: `tidal run --restart` moves the run folder aside, and the
lease must stay where the next start looks.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs

from tidal import fs
from tidal.errors import JobAlreadyRunning, TidalError
from tidal.exclusive import check_store, create_exclusive

log = logging.getLogger("tidal")

TTL_ENV = "TIDAL_LEASE_TTL_S"
DEFAULT_TTL_S = 30.0
KEEP_GENERATIONS = 3  # older generation files are deleted by the holder; the newest never is (see _forget_old)
MAX_LOST_CREATES = 20  # creates lost in a row (each backed off) before acquire gives up naming the file in the way


class LeaseUnreadable(TidalError):
    """The lease folder could not be listed or read: nothing was started or written. A failed
    listing proves nothing about a live holder, so a start never reads it as "never leased"."""


@dataclass(frozen=True)
class Holder:
    """A lease's generation file: who holds it, since when, and its last renewal."""

    generation: int
    host: str
    pid: int
    pid_started: float  # the process's start time: a pid reused by another process is not the holder
    since: float
    renewed: float
    ttl_s: float
    face: str = "tidal run"
    submission_id: str = ""
    released: bool = False
    nonce: str = ""  # written by the creator of this generation: a second "winner" of one create differs

    def live(self, now: float, host: str) -> bool:
        """Whether this holder may still be training: it renewed within its ttl, was not
        released, and, when it ran on this host, its process still exists (a driver killed on
        this host frees its job at once instead of after the ttl)."""
        if self.released or now - self.renewed > self.ttl_s:
            return False
        return self.host != host or _process_alive(self.pid, self.pid_started)

    def describe(self, now: float) -> str:
        who = f"Ray job {self.submission_id} (driver pid {self.pid} on {self.host})" if self.submission_id \
            else f"`{self.face}` (pid {self.pid} on host {self.host})"
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))
        return f"{who}, running since {started}, lease renewed {max(0.0, now - self.renewed):.0f}s ago"

    def stop_hint(self) -> str:
        if self.submission_id:
            return f"tidal stop {self.submission_id}   (or: ray job stop {self.submission_id})"
        return f"stop that command (Ctrl-C in its terminal, or kill {self.pid} on {self.host})"


def lease_path(storage: str, name: str) -> tuple[pafs.FileSystem, str]:
    store, root = fs.resolve(storage)
    return store, f"{root}/{name}.lease"


def ttl_s() -> float:
    return float(os.environ.get(TTL_ENV, DEFAULT_TTL_S))


class Lease:
    """The job's lease as its driver holds it: `acquire`, renewed in the background by `keep`,
    `release` at the end. `lost` is set once a newer generation exists (another start took the
    job over while this driver was stopped or cut off from storage)."""

    def __init__(self, storage: str, name: str, face: str = "tidal run", ttl: float | None = None) -> None:
        self.storage, self.name, self.face = storage, name, face
        self.fs, self.path = lease_path(storage, name)
        self.ttl_s = ttl if ttl is not None else ttl_s()
        self.generation = 0
        self.since = 0.0
        self.lost = threading.Event()
        self.taken_by: Holder | None = None  # who took it over, once lost
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._confirmed = time.monotonic()  # when a listing last showed no newer generation
        self.nonce = ""
        self.unconfirmed = False  # lost because no listing confirmed this generation for a whole ttl

    # --- taking it ----------------------------------------------------------------------------
    def acquire(self, wait: bool = False, poll_s: float = 2.0,
                say: Callable[[str], None] = lambda line: print(line, flush=True)) -> int:
        """Take the lease; the generation. A live holder refuses it (JobAlreadyRunning naming
        that holder), or with `wait`, is waited for: its end, or its lease's expiry."""
        check_store(self.fs, self._file(1))  # a store without an exclusive create is refused here
        said = unreadable_said = False
        lost_creates = 0
        while True:
            try:
                current = latest(self.fs, self.path, strict=True)
            except OSError as e:
                # Fail closed: read as "never leased", a failed listing would let this start take
                # generation 1 beside a live generation 5 and then --restart, cancel or prune it.
                if not wait:
                    raise LeaseUnreadable(self._unreadable(e)) from None
                if not unreadable_said:
                    say(f"[tidal] {self._unreadable(e)}; retrying every {poll_s:.0f}s (--wait)")
                    unreadable_said = True
                time.sleep(poll_s)
                continue
            now = time.time()
            if current is not None and self.nonce and current.nonce == self.nonce:
                return self._took(current.generation)  # this start's own create, its read-back had failed
            if current is not None and current.live(now, socket.gethostname()):
                if not wait:
                    raise JobAlreadyRunning(refusal(self.name, current, now))
                if not said:
                    say(f"[tidal] job {self.name!r} is running: {current.describe(now)}; "
                        "waiting for it to end (--wait)")
                    said = True
                time.sleep(poll_s)
                continue
            generation = (current.generation if current else 0) + 1
            self.since = time.time()
            self.nonce = uuid.uuid4().hex
            if create_exclusive(self.fs, self._file(generation), self._doc(generation, self.since)) \
                    and self._won(generation):
                return self._took(generation)
            # Another start created this generation first: look again (and refuse it, if live),
            # after a pause that grows, so that contenders (or a file in the way) never make a spin.
            lost_creates += 1
            if lost_creates >= MAX_LOST_CREATES:
                raise TidalError(f"could not take job {self.name!r}'s lease: {self._file(generation)} exists "
                                 f"but is not a readable generation file ({lost_creates} tries). Look at "
                                 f"{self.path}: remove a file there that Tidal did not write, then start again.")
            _pause(min(2.0, 0.05 * 2 ** lost_creates) * random.uniform(0.5, 1.0))

    def _took(self, generation: int) -> int:
        self.generation = generation
        self._confirmed = time.monotonic()
        self._forget_old()
        return generation

    def _won(self, generation: int, tries: int = 3) -> bool:
        """Whether the generation file holds this start's nonce: read back after the create, so
        that a store that let two creates of one file both succeed shows the tie instead of
        running two holders (the one whose nonce is not there lost). A read that fails (a dropped
        connection) is tried again; still unread, the next listing tells (`acquire` takes a latest
        generation holding its own nonce), never "already running" under this start's own pid."""
        for attempt in range(tries):
            try:
                with self.fs.open_input_stream(self._file(generation)) as f:
                    doc = json.loads(f.read())
            except FileNotFoundError:
                return False
            except (OSError, ValueError):
                _pause(0.1 * 2 ** attempt)
                continue
            return isinstance(doc, dict) and doc.get("nonce") == self.nonce
        return False

    def _unreadable(self, e: OSError) -> str:
        return (f"could not read job {self.name!r}'s lease at {self.path} ({e}): a job whose lease cannot be "
                "read may be running, so this start stops here without touching its folder. Start again once "
                "the storage answers (check its credentials and that it is reachable)")

    def keep(self) -> None:
        """Renew every ttl/6 in the background until `release`; sets `lost` when a newer
        generation appears. A renewal that fails (storage down) is retried: the lease is lost
        only to a newer generation, never to an error."""
        def loop() -> None:
            while not self._stop.wait(self.ttl_s / 6):
                self.renew()
        self._thread = threading.Thread(target=loop, daemon=True, name="tidal-lease")
        self._thread.start()

    def renew(self) -> bool:
        """One renewal; False once the lease is lost. The renewal is written whatever the listing
        does: a listing that fails must not let the lease expire under a live holder. What a
        failed listing cannot do is confirm that no newer generation exists; a holder that goes
        unconfirmed for a whole ttl counts as lost (another start may have taken the job over
        meanwhile), so its workers stop instead of writing on."""
        if self.lost.is_set():
            return False
        try:
            current = latest(self.fs, self.path, strict=True)
        except OSError as e:
            log.warning("[tidal] could not list job %r's lease (%s); retrying", self.name, e)
            current = None
            if time.monotonic() - self._confirmed > self.ttl_s:
                self.unconfirmed = True
                self.lost.set()
                return False
        else:
            if current is not None and (current.generation > self.generation or _tied(current, self.generation,
                                                                                      self.nonce)):
                self.taken_by = current
                self.lost.set()
                return False
            self._confirmed = time.monotonic()
        try:
            fs.write_json(self.fs, self._file(self.generation), self._doc(self.generation, self.since))
        except OSError as e:
            log.warning("[tidal] could not renew job %r's lease (%s); retrying", self.name, e)
        return True

    def release(self) -> None:
        """The driver ends: the next start takes the lease at once. Nothing is written once lost."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.generation and self.renew():
            try:
                fs.write_json(self.fs, self._file(self.generation),
                              {**self._doc(self.generation, self.since), "released": True})
            except OSError as e:  # the next start waits out the ttl instead
                log.warning("[tidal] could not release job %r's lease (%s)", self.name, e)

    def why_lost(self) -> str:
        if self.unconfirmed and self.taken_by is None:
            return (f"job {self.name!r}'s lease at {self.path} could not be read for over {self.ttl_s:.0f}s, so "
                    "this driver cannot tell whether another start took the job over: it stopped its workers "
                    "(they write nothing more). Start the job again once the storage answers; it goes on from "
                    "the latest checkpoint.")
        by = self.taken_by.describe(time.time()) if self.taken_by else "another start"
        return (f"job {self.name!r} was started again while this driver could not renew its lease (stopped, "
                f"or cut off from storage for over {self.ttl_s:.0f}s): {by} owns it now. This driver's workers "
                "stopped without writing; the newer start goes on from the latest checkpoint.")

    def check(self) -> LeaseCheck:
        return LeaseCheck(self.storage, self.name, self.generation, ttl=self.ttl_s, nonce=self.nonce)

    def config(self) -> dict[str, Any]:
        """What the workers and the tracker need to check the lease (`LeaseCheck.from_config`)."""
        return {"generation": self.generation, "ttl_s": self.ttl_s, "nonce": self.nonce}

    # --- files --------------------------------------------------------------------------------
    def _file(self, generation: int) -> str:
        return f"{self.path}/{generation:012d}.json"

    def _doc(self, generation: int, since: float) -> dict[str, Any]:
        me = _this_process()
        return {"generation": generation, "host": socket.gethostname(), "pid": os.getpid(),
                "pid_started": me, "since": since, "renewed": time.time(), "ttl_s": self.ttl_s,
                "face": self.face, "submission_id": submission_id(), "nonce": self.nonce}

    def _forget_old(self) -> None:
        """Delete all but the newest few generation files. The newest (this one) is never deleted:
        it is the high-water mark that keeps a generation number from ever being taken twice."""
        try:
            older = [g for g in generations(self.fs, self.path, strict=True) if g < self.generation]
        except OSError:
            return  # nothing is deleted on a listing that failed: the next holder tidies
        for generation in older[:max(0, len(older) - (KEEP_GENERATIONS - 1))]:
            with contextlib.suppress(OSError):
                fs.delete_file(self.fs, self._file(generation))


class LeaseCheck:
    """A writer's check that its attempt still holds the job (no newer generation exists).

    Cached for `every_s`: writers call it before each write and a check is one listing of the
    lease folder. A listing that fails proves nothing, so it counts as still current for up to a
    lease length (`ttl`) since the last listing that confirmed it: a transient storage error never
    stops a live attempt, but a writer that cannot confirm it is current for a whole lease length
    stops (another start may have taken the job over by then)."""

    def __init__(self, storage: str, name: str, generation: int, every_s: float = 1.0,
                 ttl: float | None = None, nonce: str = "") -> None:
        self.name, self.generation, self.every_s, self.nonce = name, generation, every_s, nonce
        self.ttl_s = ttl if ttl is not None else ttl_s()
        self.fs, self.path = lease_path(storage, name)
        self._checked_at = -float("inf")
        self._confirmed_at = time.monotonic()  # the driver confirmed it when it took the lease
        self._newer: Holder | None = None
        self._unconfirmed = False

    @classmethod
    def from_config(cls, storage: str, name: str, config: dict[str, Any] | None) -> LeaseCheck | None:
        if not config:
            return None
        ttl = config.get("ttl_s")
        return cls(storage, name, int(config["generation"]), ttl=float(ttl) if ttl is not None else None,
                   nonce=str(config.get("nonce") or ""))

    def current(self, fresh: bool = False) -> bool:
        if self._newer is not None or self._unconfirmed:
            return False  # once superseded, always: a newer generation never goes away
        if fresh or time.monotonic() - self._checked_at >= self.every_s:
            self._checked_at = time.monotonic()
            try:
                newest = latest(self.fs, self.path, strict=True)
            except OSError as e:
                log.debug("lease check of %s failed: %s", self.path, e)
                if time.monotonic() - self._confirmed_at > self.ttl_s:
                    self._unconfirmed = True
                    return False
                return True
            if newest is not None and (newest.generation > self.generation
                                       or _tied(newest, self.generation, self.nonce)):
                self._newer = newest
            else:
                self._confirmed_at = time.monotonic()
        return self._newer is None

    def why(self) -> str:
        """Why this attempt stopped (after `current` said False)."""
        if self._unconfirmed and self._newer is None:
            return (f"job {self.name!r}'s lease at {self.path} could not be read for over {self.ttl_s:.0f}s, so "
                    "this attempt cannot tell whether another start took the job over: it stops without writing; "
                    "start the job again once the storage answers (it goes on from the latest checkpoint)")
        newer = self._newer
        by = newer.describe(time.time()) if newer else "another start"
        return (f"job {self.name!r} was started again while this attempt's driver did not renew its lease "
                f"(generation {self.generation}; now {newer.generation if newer else '?'}: {by}); "
                "this attempt stops without writing, and the newer one goes on from the latest checkpoint")


def submission_id(environ: Mapping[str, str] | None = None) -> str:
    """This driver's Ray Jobs submission id, when it is a submitted job's entrypoint: Ray's job
    supervisor hands it over in the job's config (metadata `job_submission_id`)."""
    env = os.environ if environ is None else environ
    try:
        config = json.loads(env.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "") or "{}")
        return str((config.get("metadata") or {}).get("job_submission_id") or "")
    except (ValueError, AttributeError):
        return ""


def driver_command() -> str:
    """How this driver was started, for a refusal that names it (`tidal run jobs/x.yaml`, a
    notebook's kernel...); credentials on the command line are masked."""
    import sys

    from tidal.redact import redact_text

    argv = [os.path.basename(sys.argv[0] or "python"), *sys.argv[1:]] if sys.argv else ["python"]
    text = redact_text(" ".join(argv))  # before the cut: a credential cut in half is no longer recognised
    return text if len(text) <= 80 else text[:77] + "..."


def refusal(name: str, holder: Holder, now: float) -> str:
    return (f"job {name!r} is already running: {holder.describe(now)}.\n"
            "Two starts of one job would train into the same checkpoints and MLflow run, so this one stops here.\n"
            f"  stop it:      {holder.stop_hint()}\n"
            "  wait for it:  run the same command with --wait, to start once it has ended\n"
            f"  A driver that died without ending its lease frees the job {holder.ttl_s:.0f}s after its last renewal "
            "(at once when it ran on this host).")


# --- storage ------------------------------------------------------------------------------------
def generations(store: pafs.FileSystem, path: str, strict: bool = False) -> list[int]:
    """The generation numbers in the lease folder, oldest first. `strict`: a failed listing
    raises OSError instead of reading as empty."""
    try:
        infos = store.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    except OSError:
        if strict:
            raise
        return []
    out = []
    for info in infos:
        stem = info.base_name.removesuffix(".json")
        if info.type == pafs.FileType.File and stem.isdigit() and info.base_name.endswith(".json"):
            out.append(int(stem))
    return sorted(out)


def latest(store: pafs.FileSystem, path: str, strict: bool = False) -> Holder | None:
    """The newest generation's holder; None when the job has never been leased. A generation
    file that cannot be parsed (a create caught half-way on a filesystem without atomic
    creates) counts as a holder that renewed at its file's modification time."""
    found = generations(store, path, strict)
    if not found:
        return None
    generation = found[-1]
    doc = fs.read_json(store, f"{path}/{generation:012d}.json")
    if not isinstance(doc, dict):
        mtime = store.get_file_info(f"{path}/{generation:012d}.json").mtime
        stamp = mtime.timestamp() if mtime else time.time()
        return Holder(generation, "?", 0, 0.0, stamp, stamp, ttl_s())
    return _holder(generation, doc)


def _holder(generation: int, doc: dict[str, Any]) -> Holder:
    def num(key: str, default: float = 0.0) -> float:
        try:
            return float(doc.get(key, default))
        except (TypeError, ValueError):
            return default
    return Holder(generation, str(doc.get("host", "?")), int(num("pid")), num("pid_started"), num("since"),
                  num("renewed"), num("ttl_s", ttl_s()), str(doc.get("face", "tidal run")),
                  str(doc.get("submission_id", "")), bool(doc.get("released", False)), str(doc.get("nonce", "")))


def _tied(holder: Holder, generation: int, nonce: str) -> bool:
    """Whether `holder` is another start's file under this generation's name: a store that let
    two creates of one file succeed, the other's write last."""
    return holder.generation == generation and bool(nonce) and bool(holder.nonce) and holder.nonce != nonce


def _pause(seconds: float) -> None:
    time.sleep(seconds)


def _this_process() -> float:
    return _process_started(os.getpid())


def _process_started(pid: int) -> float:
    import psutil

    try:
        return round(psutil.Process(pid).create_time(), 2)
    except psutil.Error:
        return 0.0


def _process_alive(pid: int, started: float) -> bool:
    import psutil

    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        return not started or abs(round(p.create_time(), 2) - started) < 0.05
    except psutil.Error:
        return False


__all__ = ["Holder", "JobAlreadyRunning", "Lease", "LeaseCheck", "LeaseUnreadable", "latest", "refusal"]
