"""Convert a checkpoint to DeepSpeed's universal form for a resize, outside any collective.

This module holds the converter's process, its heartbeat and its waits, and converts on rank 0
alone: what tidal.worker.checkpoint.universal_spread (which spreads a plain data-parallel checkpoint's
conversion over every rank) falls back to for tensor- or pipeline-parallel checkpoints.

Rank 0 converts while the other ranks wait by polling storage, not inside a collective: a
conversion longer than the process group's timeout (Ray's 1800 s) would time the group out
while every rank sat in a broadcast, and each next attempt would start it over. Polling ranks
hold no collective open; rank 0 writes a status file beside the checkpoint every few seconds
(`tidal-converting-<tag>.json`), so a waiter fails with a clear error when rank 0 reports
a failure or stops reporting (its process died), and has a deadline of its own.

Why in the worker group rather than before it forms (on the driver, as a Ray task): the world
size that makes a conversion necessary is known only once Ray Train has formed the group (an
elastic resize restarts it inside Ray's controller, with no public hook between choosing the
size and starting the workers), and the group's nodes already have the storage credentials and
the CPUs a conversion needs. Converting eagerly before every start would cost a full
conversion even when the size did not change.

The conversion reads only private copies of the files the checkpoint's manifests list (a dead
attempt's stray partition would make `ds_to_universal` infer the wrong data-parallel degree, and
it unpickles without weights-only: the copies are checked weights-only first, and a file swapped
in storage after the check never reaches it), uses DeepSpeed's parallel extract and merge
workers, and is published once (`fs.publish_dir`, marker last, with an id that tells one
conversion's copy on a node from another's). Rank 0 verifies a published conversion once
(`published`) and hands its file list to every rank.

Its console output is one `[tidal]` line saying that a resize conversion ran and how long it
took; DeepSpeed's own prints go to a log file beside the conversion, and Tidal's stage lines are
logged only under TIDAL_DEBUG=1.
It runs in its own process group that kills itself if rank 0 dies, so nothing is left running;
a conversion killed half-way left no marker, and the next attempt converts again from scratch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from tidal import fs
from tidal.errors import CheckpointError
from tidal.storage import Found, listed_files
from tidal.worker.checkpoint import safe_load
from tidal.worker.checkpoint.fetch import LocalDiskFull, NodeCache

log = logging.getLogger("tidal")

TIMEOUT_ENV = "TIDAL_RESHARD_TIMEOUT_S"  # a conversion's deadline, rank 0's and the waiters' alike
DEFAULT_TIMEOUT_S = 8 * 3600.0
HEARTBEAT_S = 5.0  # rank 0 rewrites its status this often
STALE_S = 120.0  # a status unchanged this long means rank 0's attempt died
POLL_S = 2.0


def marker(step_tag: str) -> str:
    """Written after a universal conversion's last file: without it the conversion does not count."""
    return f"tidal-universal-{step_tag.removesuffix('_universal')}.json"


def status_name(step_tag: str) -> str:
    return f"tidal-converting-{step_tag}.json"


def workers(cpus: int, partitions: int, largest: int, available_mem: int) -> int:
    """Extract/merge worker processes for `ds_to_universal`: one per CPU, no more than there are
    partitions, and few enough that each can hold two copies of the largest partition in memory."""
    by_memory = available_mem // max(1, 2 * largest)
    return max(1, min(cpus, partitions, by_memory))


def timeout_s() -> float:
    return float(os.environ.get(TIMEOUT_ENV) or DEFAULT_TIMEOUT_S)


def debug() -> bool:
    return os.environ.get("TIDAL_DEBUG") == "1"


def _say(msg: str, *args: Any) -> None:
    """A conversion's progress: in the log, on the console only under TIDAL_DEBUG=1."""
    log.log(logging.WARNING if debug() else logging.INFO, msg, *args)


def prepare(found: Found, step_tag: str) -> None:
    """Rank 0, before it tells the others the resume point, when the conversion must be made: a
    marker that does not verify goes (a waiter must not take it for this attempt's), and a status
    of this attempt replaces any earlier attempt's, so no waiter reads a failure that is not this
    attempt's."""
    fs.delete_file(found.fs, f"{found.path}/{marker(step_tag)}")
    fs.delete_dir(found.fs, f"{found.path}/{step_tag}_universal")  # an earlier attempt's half, its work folder too
    # `work` names this attempt's conversion: a spread one (tidal.worker.checkpoint.universal_spread) keeps
    # its ranks' exchanges under it, apart from a killed attempt's.
    fs.write_json(found.fs, f"{found.path}/{status_name(step_tag)}",
                  {"state": "pending", "beats": 0, "work": uuid.uuid4().hex})


def ready(found: Found, step_tag: str) -> bool:
    """Rank 0: whether a conversion of `step_tag` is published whole (an earlier attempt's)."""
    return fs.published(found.fs, f"{found.path}/{step_tag}_universal", f"{found.path}/{marker(step_tag)}")


def ensure(found: Found, step_tag: str, rank: int) -> str:
    """The universal tag of `step_tag`, converted and published by rank 0 if need be; every
    other rank waits for its marker by polling storage (one small read per poll: rank 0 verifies
    the folder, `published`, and hands its list to the others)."""
    out_tag = f"{step_tag}_universal"
    if rank == 0:
        if not ready(found, step_tag):
            _convert(found, step_tag, out_tag)
    else:
        wait_for(found, step_tag, out_tag)
    return out_tag


def published(found: Found, step_tag: str) -> dict[str, Any]:
    """Rank 0, once the conversion is there: its marker's document (file list with sizes, names
    checked, and the conversion's id). A folder that does not match its marker is discarded (the
    marker deleted): the next attempt converts again."""
    done = f"{found.path}/{marker(step_tag)}"
    doc = fs.published_files(found.fs, f"{found.path}/{step_tag}_universal", done)
    if doc is None:
        fs.delete_file(found.fs, done)
        raise CheckpointError(f"the universal conversion of {found.name} does not match its marker (a file missing, "
                              "resized or unsafely named); it is discarded and made again on the next attempt")
    return doc


def wait_for(found: Found, step_tag: str, out_tag: str) -> None:
    status_path = f"{found.path}/{status_name(step_tag)}"
    done = f"{found.path}/{marker(step_tag)}"
    t0 = said = last_change = time.monotonic()
    beats = None
    # The marker alone, written last: rank 0 cleared any stale one before the others started.
    while not fs.exists(found.fs, done):
        now = time.monotonic()
        status = fs.read_json(found.fs, status_path) or {}
        if status.get("state") == "failed":
            raise CheckpointError(f"rank 0 could not convert {found.name} to universal form: {status.get('error')}")
        if status.get("beats") != beats:
            beats, last_change = status.get("beats"), now
        elif now - last_change > STALE_S:
            raise CheckpointError(f"rank 0's conversion of {found.name} reported nothing for {STALE_S:.0f} s (its "
                                  "process died?); this attempt ends and the next one converts again")
        if now - t0 > timeout_s() + STALE_S:
            raise CheckpointError(f"waited {now - t0:.0f} s for rank 0's conversion of {found.name}, past "
                                  f"{TIMEOUT_ENV}={timeout_s():.0f}")
        if now - said >= 60:
            _say("Resharding: waiting for rank 0 to convert %s (%.0f s; %s)", found.name, now - t0,
                        status.get("stage", "starting"))
            said = now
        time.sleep(POLL_S)


class Status:
    """Rank 0's heartbeat: rewrites the status file every HEARTBEAT_S with the current stage."""

    def __init__(self, storage: pafs.FileSystem, path: str, **extra: Any) -> None:
        self.storage, self.path, self.stage, self.beats = storage, path, "starting", 0
        self.extra = extra  # kept in every write (a spread conversion's work id)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="tidal-reshard-status")

    def _run(self) -> None:
        while not self.stop.wait(HEARTBEAT_S):
            self.write("converting")

    def write(self, state: str, **extra: Any) -> None:
        self.beats += 1
        with contextlib.suppress(OSError):  # a missed beat is retried; a waiter allows STALE_S
            fs.write_json(self.storage, self.path, {"state": state, "beats": self.beats, "stage": self.stage,
                                                    "host": os.uname().nodename, "pid": os.getpid(),
                                                    **self.extra, **extra})

    def __enter__(self) -> Status:
        self.thread.start()
        return self

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> None:
        self.stop.set()
        self.thread.join()  # first: no beat may overwrite the final state
        if error is None:
            self.write("done")
        else:
            self.write("failed", error=f"{type(error).__name__}: {error}"[:2000])


def step_files(found: Found, step_tag: str) -> dict[str, int]:
    """The files of the folder `step_tag` of `found` that its manifests list (relative to the run
    folder -> size): from the list rank 0 handed out (`Found.files`), read from storage only without one."""
    listed = found.files if found.files is not None else listed_files(found.fs, found.path)
    return {rel: size for rel, size in listed.items() if rel.startswith(f"{step_tag}/")}


def _convert(found: Found, step_tag: str, out_tag: str) -> None:
    t0 = time.monotonic()
    out, done = f"{found.path}/{out_tag}", f"{found.path}/{marker(step_tag)}"
    fs.delete_file(found.fs, done)  # a stale marker must not bless a half-made upload
    files = step_files(found, step_tag)
    if not files:
        raise CheckpointError(f"{found.name} lists no files under {step_tag}: nothing to convert")
    total = sum(files.values())
    with Status(found.fs, f"{found.path}/{status_name(step_tag)}") as status, \
            NodeCache(f"convert:{found.path}/{step_tag}", name=f"convert-{found.name}", keep=False) as cache:
        _check_disk(cache.dir, total, total)
        status.stage = f"fetching {len(files)} files, {total / 2**20:.0f} MiB"
        _say("Resharding: converting %s of %s (%d files, %.0f MiB) to universal form", step_tag, found.name,
             len(files), total / 2**20)
        # Private copies, on every filesystem (tidal.worker.checkpoint.fetch): what is checked is what is read.
        cache.fetch(found.fs, found.path, files)
        # ds_to_universal unpickles with weights_only=False: each copy is first read weights-only
        # (its pickle, not its tensors), so a planted one is refused here instead of run there.
        status.stage = "checking the files' pickles"
        safe_load.check_files(cache.dir, files)
        dst = os.path.join(cache.dir, "out", out_tag)
        t1 = time.monotonic()
        run_converter(cache.path(step_tag), dst, files, status)
        status.stage = "publishing"
        t2 = time.monotonic()
        fs.publish_dir(dst, found.fs, out, done, id=uuid.uuid4().hex)
        t3 = time.monotonic()
    print(f"[tidal] resize: converted {found.name} ({total / 2**20:.0f} MiB) for the new world size in "
          f"{t3 - t0:.1f} s (fetch and check {t1 - t0:.1f} s, convert {t2 - t1:.1f} s, upload {t3 - t2:.1f} s)",
          flush=True)


def conversion_disk(total: int) -> int:
    """Local disk a conversion of a `total`-byte checkpoint holds at its peak: its private copy of
    the input, DeepSpeed's fragments and the output, at once."""
    return 3 * total


def _check_disk(folder: str, total: int, download: int) -> None:
    """The conversion holds its input (a private copy), DeepSpeed's fragments and the output at once."""
    check_disk(folder, conversion_disk(total) - total + download)


def check_disk(folder: str, need: int) -> None:
    """LocalDiskFull, saying what to do, unless `need` bytes are free under `folder`."""
    free = _free(folder)
    if need > free:
        raise LocalDiskFull(f"converting needs about {need:,} bytes of local disk in {folder} and {free:,} are free. "
                            "Free space there or point TIDAL_RESTORE_CACHE at a larger node-local folder; the "
                            "checkpoint itself is sound and is kept.")


def _free(folder: str) -> int:
    return shutil.disk_usage(folder).free


def run_converter(src: str, dst: str, files: dict[str, int], status: Any, module: str = __name__,
                  child: Any = (), on_poll: Callable[[], None] | None = None, ranks_here: int = 1) -> None:
    """Run `ds_to_universal` with parallel workers in its own process group; log its stages.
    `module` runs it (with `child` arguments first), `on_poll` is called every second meanwhile,
    and `ranks_here` converting ranks share the node's CPUs."""
    import psutil

    partitions = [size for rel, size in files.items() if "optim_states" in rel]
    n = workers(max(1, len(os.sched_getaffinity(0)) // ranks_here), max(1, len(partitions)),
                max(partitions, default=1), psutil.virtual_memory().available // ranks_here)
    here = str(Path(__file__).resolve().parents[3])  # the folder holding the tidal package
    env = {**os.environ, "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", module, str(os.getpid()), *child, "--input_folder", src,
           "--output_folder", dst, "--num_extract_workers", str(n), "--num_merge_workers", str(n)]
    out_log = os.path.join(os.path.dirname(dst), "convert.log")
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    status.stage = f"converting with {n} worker(s)"
    t0, deadline = time.monotonic(), time.monotonic() + timeout_s()
    with open(out_log, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        seen = 0
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise CheckpointError(f"the conversion ran past {TIMEOUT_ENV}={timeout_s():.0f} s and was stopped")
            seen = _stages(out_log, seen, status, t0)
            if on_poll is not None:
                on_poll()
            time.sleep(1.0)
        _stages(out_log, seen, status, t0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its pool workers too, whatever ended this
        proc.wait()
    if proc.returncode != 0:
        tail = Path(out_log).read_text(errors="replace")[-3000:]
        raise CheckpointError(f"converting to a universal checkpoint failed (exit {proc.returncode}):\n{tail}")


def _stages(out_log: str, seen: int, status: Any, t0: float) -> int:
    """Log the stage lines (`*** ...`) the converter printed since line `seen`; returns the lines read."""
    with contextlib.suppress(OSError), open(out_log, errors="replace") as f:
        lines = f.read().splitlines()
        for line in lines[seen:]:
            if line.startswith("***"):
                status.stage = line.strip("* ")
                _say("Resharding: %s (%.0f s)", status.stage, time.monotonic() - t0)
        return len(lines)
    return seen


def die_with(parent: int) -> None:
    """In the converter: end the whole process group (its pool workers too) once rank 0 is gone."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os.killpg(0, signal.SIGKILL)


def tensors_of_module(load: Any) -> Any:
    """`torch.load` for the converter, whose module states keep only their tensors.

    DeepSpeed 0.19.8's `ds_to_universal` writes an fp32 file for every module-state entry it has
    none for, calling `.float()` on each: a module's non-tensor extra state (`get_extra_state()`,
    allowed by checkpoint.safe_globals) crashed every resize. It copies the model states file
    whole into the output, so that state still loads from there."""
    import torch

    def loaded(*args: Any, **kwargs: Any) -> Any:
        f = args[0] if args else kwargs.get("f")
        if "mmap" not in kwargs and isinstance(f, str | os.PathLike) and zipfile.is_zipfile(f):
            # Memory-mapped: the ranks of a node converting together read the same copy of the
            # model states (the node cache), so the page cache holds it once, not once a rank.
            kwargs["mmap"] = True
        out = load(*args, **kwargs)
        if isinstance(out, dict) and isinstance(out.get("module"), dict):
            out["module"] = {k: v for k, v in out["module"].items() if isinstance(v, torch.Tensor)}
        return out

    return loaded


def _child(argv: list[str]) -> None:
    threading.Thread(target=die_with, args=(int(argv[0]),), daemon=True).start()
    from deepspeed.checkpoint import ds_to_universal

    ds_to_universal.torch.load = tensors_of_module(ds_to_universal.torch.load)  # this process only
    sys.argv = ["ds_to_universal", *argv[1:]]
    ds_to_universal.main(ds_to_universal.parse_arguments())

if __name__ == "__main__":
    _child(sys.argv[1:])
