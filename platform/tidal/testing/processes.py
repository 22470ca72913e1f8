"""The processes a test or benchmark starts: find them, kill them, and give them this venv's tools."""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path

import psutil


def venv_tools_first() -> None:
    """Put this venv's bin first on PATH, as an activated venv does (tests and benchmarks alike).

    DeepSpeed compiles its CPU shared-memory op with whichever `ninja` is on PATH, and two ninja
    versions (the venv's and the system's) read each other's build log as stale: every switch
    between them recompiled the op, about 40 s of both cores, in the middle of a run."""
    bin_dir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != bin_dir:
        os.environ["PATH"] = f"{bin_dir}{os.pathsep}{path}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def our_processes(fragment: str, root: int | None = None) -> list[psutil.Process]:
    """Descendants of `root` (default: this process) whose command line contains `fragment`."""
    procs = psutil.Process(root or os.getpid()).children(recursive=True)
    out = []
    for p in procs:
        try:
            if fragment in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:  # it exited meanwhile, or is not ours to read
            continue
    return out


def kill(proc: psutil.Process, sig: int = signal.SIGKILL) -> None:
    proc.send_signal(sig)
