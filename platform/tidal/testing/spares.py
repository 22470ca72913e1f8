"""Warm spares seen from outside (tests and benchmarks): a job's idle worker processes on this machine, once warm."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import psutil

from tidal.testing.processes import our_processes
from tidal.worker.spares import IDLE_TITLE


def warm_spares(job: str, count: int, quiet_s: float = 3.0) -> list[psutil.Process]:
    """Ray job `job`'s idle workers among this process's descendants once `count` of them have torch
    mapped (only a spare's preload imports it in an idle worker) and none has used 0.1 s of CPU in
    `quiet_s` (its imports are done: an idle worker uses about 0.01 s in 3 s); [] until then (for
    tidal.testing.processes.wait_for)."""
    first = _cpu_of_warm(job)
    time.sleep(quiet_s)
    later = _cpu_of_warm(job)
    busy = [pid for pid, cpu in later.items() if cpu - first.get(pid, 0.0) > 0.1]
    if len(later) < count or busy:
        return []
    return [p for p in our_processes(IDLE_TITLE) if p.pid in later]


def _cpu_of_warm(job: str) -> dict[int, float]:
    out = {}
    for p in our_processes(IDLE_TITLE):
        with contextlib.suppress(psutil.Error, OSError):  # taken or ended meanwhile
            if p.environ().get("RAY_JOB_ID") == job and "libtorch_python" in Path(f"/proc/{p.pid}/maps").read_text():
                out[p.pid] = sum(p.cpu_times()[:2])
    return out


def memory_mib(procs: list[psutil.Process]) -> list[tuple[float, float]]:
    """(RSS, USS) in MiB of each process still there: what a spare holds (USS: its own pages only)."""
    out = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            m = p.memory_full_info()
            out.append((m.rss / 2**20, m.uss / 2**20))
    return out
