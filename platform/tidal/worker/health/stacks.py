"""Where a process is: its own threads' Python stacks, another process's as a tool can read them,
and what a stack says (waiting in a collective, or not, and where).

A rank reads its own stacks from a thread of its own (`sys._current_frames`): the training thread
blocked in a collective releases the GIL, so the watchdog's thread still runs. A rank that does
not answer (stopped by SIGSTOP, or wedged with the GIL held) is read from outside: py-spy
(`dump --native` pauses it and adds the C frames where it waits; a stopped one cannot be paused, and
`dump --nonblocking` reads its memory, Python frames only) where it is installed (`pip install py-spy`, or tidal's `debug` extra), and always the kernel's
view of it (`/proc/PID/status`'s state, T for stopped, and `wchan`, the kernel function it sleeps
in). Both are read on the process's own node, by a Ray task placed there (`inspect_on_node`).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# A stack with a frame in these is waiting in a collective (DeepSpeed's comm wraps torch's).
COLLECTIVE_PATHS = ("torch/distributed/", "deepspeed/comm/")
PY_SPY_TIMEOUT_S = 20.0
PID_MAX = 1 << 22  # Linux's largest pid_max


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    def short(self) -> str:
        return f"{self.func} ({short_path(self.file)}:{self.line})"


def short_path(path: str) -> str:
    """A frame's file as a reader finds it: from the package down (`torch/distributed/...`)."""
    for marker in ("site-packages/", "dist-packages/", "platform/"):
        if marker in path:
            return path.split(marker, 1)[1]
    if "/tidal/" in path:
        return "tidal/" + path.rsplit("/tidal/", 1)[1]
    return "/".join(path.split("/")[-2:])


def own_stacks(focus: int | None = None) -> tuple[str, list[Frame]]:
    """Every thread's Python stack in this process, as text (thread `focus` first: the training
    thread, which in a Ray Train worker is not the main thread; default the main one), and that
    thread's frames, outermost first."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = focus or threading.main_thread().ident
    frames = sys._current_frames()
    text, main_frames = [], []
    for ident in sorted(frames, key=lambda i: i != main):
        summary = traceback.extract_stack(frames[ident])
        text.append(f'Thread {ident} "{names.get(ident, "?")}" (most recent call last):')
        text.extend(line.rstrip("\n") for line in traceback.format_list(summary))
        text.append("")
        if ident == main:
            main_frames = [Frame(f.filename, f.lineno or 0, f.name) for f in summary]
    return "\n".join(text), main_frames


def in_collective(frames: Sequence[Frame]) -> bool:
    """Whether a training thread's frames are inside a collective."""
    return any(p in f.file for f in frames for p in COLLECTIVE_PATHS)


def where(frames: Sequence[Frame]) -> str:
    """Where a training thread waits, as a person reads it: the collective it is in and what called
    it, or else its innermost frame."""
    if not frames:
        return "an unknown place (no Python frame)"
    inside = [i for i, f in enumerate(frames) if any(p in f.file for p in COLLECTIVE_PATHS)]
    if not inside:
        return frames[-1].short()
    # The innermost collective frame is the collective itself (DeepSpeed's outer ones are wrappers);
    # the frame before the outermost one is what called into the library.
    caller = f" called from {frames[inside[0] - 1].short()}" if inside[0] > 0 else ""
    return frames[inside[-1]].short() + caller


def process_state(pid: int, proc: Path = Path("/proc")) -> str:
    """The kernel's view of a process: its state (T: stopped) and the kernel function it waits in."""
    try:
        status = (proc / str(pid) / "status").read_text()
    except OSError as e:
        return f"no such process here ({type(e).__name__})"
    state = next((line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("State:")), "?")
    try:
        wchan = (proc / str(pid) / "wchan").read_text().strip() or "-"
    except OSError:
        wchan = "?"
    return f"state {state}, wchan {wchan}"


def plain_pid(value: object) -> int | None:
    """`value` when it can be a process id, else None. A pid read from storage gets a `py-spy dump`:
    nothing but an int above 1 (not init) and below Linux's largest pid_max passes."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 1 < value < PID_MAX else None


def py_spy() -> str | None:
    """py-spy's executable, beside this Python's or on the PATH; None where it is not installed."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def inspect_process(pid: int) -> dict[str, Any]:
    """What can be read of process `pid` on this node without its help: its state, and its
    Python stacks through py-spy where installed (else a line saying how to get them). `pid` comes
    from the job's storage: only a plain process id gets a `py-spy dump`."""
    if plain_pid(pid) is None:
        raise ValueError(f"{pid!r} is not a process id")
    state = process_state(pid)
    tool = py_spy()
    if tool is None:
        stacks = ("py-spy is not installed on this node, so this process's Python stacks cannot be read from "
                  "outside it (pip install py-spy, or tidal[debug]); its kernel state is above")
    else:
        # Native frames first (where a rank wedged in C code, a collective or a driver, waits): py-spy
        # pauses the process for that, which it cannot do to one already stopped (SIGSTOP: "Failed to
        # suspend process"); that one is read without pausing, its Python frames only.
        stacks = _py_spy_dump(tool, pid, "--native")
        if stacks.startswith("py-spy dump failed"):
            stacks = _py_spy_dump(tool, pid, "--nonblocking")
    return {"state": state, "host": socket.gethostname(), "stacks": stacks}


def _py_spy_dump(tool: str, pid: int, mode: str) -> str:
    """`py-spy dump` of `pid` in `mode` (--native, --nonblocking): its text, or why it failed."""
    try:
        out = subprocess.run([tool, "dump", "--pid", str(pid), mode], capture_output=True, text=True,
                             timeout=PY_SPY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"py-spy dump failed: {type(e).__name__}: {e}"
    if out.returncode != 0:
        return f"py-spy dump failed ({out.returncode}): {(out.stderr or out.stdout).strip()[:500]}"
    return out.stdout


def inspect_on_node(node_id: str, pid: int, timeout_s: float = 30.0) -> dict[str, Any]:
    """`inspect_process(pid)` on node `node_id`, through a Ray task placed there (a process's
    /proc and memory are readable on its own node only)."""
    return _on_node(inspect_process, "tidal-inspect-hung-rank", node_id, pid, timeout_s)


def state_on_node(node_id: str, pid: int, timeout_s: float = 10.0) -> str:
    """`process_state(pid)` on node `node_id`, through a Ray task placed there: the kernel's view
    alone, without py-spy (a heartbeat's silence is confirmed by it before a hang is declared)."""
    if plain_pid(pid) is None:
        raise ValueError(f"{pid!r} is not a process id")
    return _on_node(process_state, "tidal-read-silent-rank", node_id, pid, timeout_s)


def end_process(pid: int, proc: Path = Path("/proc")) -> str:
    """SIGKILL process `pid` on this node, if it is a Ray Train worker (its command line says
    RayTrainWorker): a hung rank that stopped answering, ended so that Ray's teardown of the group does
    not wait for it (Ray gives each worker's shutdown 5 s). What was done, in words."""
    if plain_pid(pid) is None:
        raise ValueError(f"{pid!r} is not a process id")
    try:
        cmdline = (proc / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError as e:
        return f"no such process here ({type(e).__name__})"
    if "RayTrainWorker" not in cmdline:
        return f"not ended: pid {pid} is not a Ray Train worker ({cmdline[:80]!r})"
    os.kill(pid, signal.SIGKILL)
    return "ended"


def end_on_node(node_id: str, pid: int, timeout_s: float = 10.0) -> str:
    """`end_process(pid)` on node `node_id`, through a Ray task placed there."""
    return _on_node(end_process, "tidal-end-hung-rank", node_id, pid, timeout_s)


def _on_node(fn: Callable[[int], Any], name: str, node_id: str, pid: int, timeout_s: float) -> Any:
    """`fn(pid)` as a Ray task named `name` on node `node_id` (pinned: a process is seen on its own node only)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(fn).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False), name=name)
    return ray.get(task.remote(pid), timeout=timeout_s)
