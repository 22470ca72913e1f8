"""The processes a test or benchmark starts: free ports, waits, finding and stopping them by PID
(never by name: other agents' and users' Ray instances share the machine), and this venv's tools."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import TypeVar

import psutil

T = TypeVar("T")


def venv_tools_first() -> None:
    """Put this venv's bin first on PATH, as an activated venv does (tests and benchmarks alike).

    DeepSpeed compiles its CPU shared-memory op with whichever `ninja` is on PATH, and two ninja
    versions (the venv's and the system's) read each other's build log as stale: every switch
    between them recompiled the op, about 40 s of both cores, in the middle of a run."""
    bin_dir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != bin_dir:
        os.environ["PATH"] = f"{bin_dir}{os.pathsep}{path}"


def venv_tool(name: str) -> str:
    """A console script of this venv (`moto_server`, `mlflow`, `ray`), whatever PATH says."""
    return str(Path(sys.executable).parent / name)


def free_port() -> int:
    """A TCP port nobody listens on now, on 127.0.0.1 (what every test server binds)."""
    return free_ports(1)[0]


def free_ports(n: int, exclude: Collection[int] = ()) -> list[int]:
    """`n` distinct free ports on 127.0.0.1, none in `exclude`, for one process's several listeners.

    Held open together while drawn: a port is free again once its draw closes it, so draws one at
    a time can repeat (a head's agent then dies on "port ... used by other components")."""
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        while len(ports) < n:
            s = stack.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            if (port := s.getsockname()[1]) not in exclude:
                ports.append(port)
        return ports


TIMEOUT_SCALE_VAR = "TIDAL_TEST_TIMEOUT_SCALE"


def scaled(timeout: float) -> float:
    """`timeout` (seconds, right for an unloaded machine) stretched by TIDAL_TEST_TIMEOUT_SCALE, which a
    shared or slow machine sets (2, 3) for every wait of the tests and benchmarks at once; `wait_for`
    applies it itself, other waits (a job's `wait(timeout=...)`) call this."""
    return timeout * float(os.environ.get(TIMEOUT_SCALE_VAR, "1"))


def wait_for(what: str, check: Callable[[], T], timeout: float, every: float = 0.2,
             context: Callable[[], str] | None = None) -> T:
    """`check()`'s first truthy value; TimeoutError naming `what` if none comes within `timeout` s
    (`scaled`), with what `context()` says then (a job's logs, a queue's state): a wait that failed on
    CI once must say why without a rerun."""
    timeout = scaled(timeout)
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}{_said(context)}")
        time.sleep(every)


def _said(context: Callable[[], str] | None) -> str:
    if context is None:
        return ""
    try:
        return f"; then:\n{context()}"
    except Exception as e:  # noqa: BLE001 - the timeout is the error; a context that fails must not hide it
        return f"; its context could not be read ({type(e).__name__}: {e})"


def listens(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def wait_for_server(ready: Callable[[], bool], proc: subprocess.Popen, log: Path, what: str,
                    timeout: float) -> None:
    """Until `ready()`; fails with the end of the server's log if it exits first or never gets ready."""
    def check() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {_tail(log)}")
        return ready()

    try:
        wait_for(what, check, timeout, every=0.3)
    except TimeoutError as e:
        raise TimeoutError(f"{e}: {_tail(log)}") from None


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"


def start_in_session(cmd: list[str], log: Path, env: Mapping[str, str] | None = None,
                     cwd: Path | None = None) -> subprocess.Popen:
    """`cmd` in a process group of its own (so that stopping it reaches what it starts), output
    appended to `log`."""
    with log.open("a") as out:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(env) if env is not None else None, cwd=cwd)


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def stop_session(proc: subprocess.Popen, grace_s: float = 30, also: list[psutil.Process] | None = None) -> None:
    """SIGTERM the process group `proc` leads (started with start_new_session=True), SIGKILL what of
    it lingers after `grace_s` (0: SIGKILL at once, no SIGTERM), and SIGKILL `also` (processes it
    started in sessions of their own, found beforehand with `descendants`). A process that already
    exited is fine."""
    also = [*(also or []), *descendants(proc.pid)]
    if grace_s > 0:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
        with contextlib.suppress(TimeoutError):  # the rest of the group a moment to follow its leader
            wait_for("the process group to end", lambda: not _group_alive(proc.pid), 1.0, every=0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # anything of that session still alive
    for p in also:
        with contextlib.suppress(psutil.Error):
            p.kill()
    proc.wait()
    with contextlib.suppress(TimeoutError):  # a SIGKILL takes effect a moment later on a busy machine
        wait_for("the server's processes to exit", lambda: all(_gone(p) for p in also), 10.0, every=0.05)


def _gone(p: psutil.Process) -> bool:
    """Exited (a zombie counts: it runs nothing, and only its parent can reap it)."""
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:  # gone (or no longer ours to look at)
        return True


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the session `proc` leads (started with start_new_session=True) at once, as a crash
    does, and wait until every member has exited (e.g. a driver's local Ray instance)."""
    members = [p for p in psutil.process_iter(["pid"]) if _sid(p.pid) == proc.pid]
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    psutil.wait_procs(members, timeout=30)


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


@contextlib.contextmanager
def patched_env(values: Mapping[str, str | None]) -> Iterator[None]:
    """`values` in os.environ (None: unset) for the block, the old values put back after it."""
    old = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    try:
        yield
    finally:
        restore_env(old)


def restore_env(old: Mapping[str, str | None]) -> None:
    """Put back the environment variables a fixture changed (None: it was unset)."""
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def our_processes(fragment: str, root: int | None = None) -> list[psutil.Process]:
    """Descendants of `root` (default: this process) whose command line contains `fragment`."""
    out = []
    for p in descendants(root or os.getpid()):
        try:
            if fragment in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:  # it exited meanwhile, or is not ours to read
            continue
    return out


def kill(proc: psutil.Process, sig: int = signal.SIGKILL) -> None:
    proc.send_signal(sig)
