"""Helpers shared by the benchmarks: run a Tidal job in a subprocess, read MLflow, write the doc."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from tidal.spec.job import JobSpec
from tidal.testing.doc_sections import with_section
from tidal.testing.processes import kill_session, start_in_session, venv_tools_first, wait_for

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"


def pair_args(doc: str | None) -> argparse.Namespace:
    """The options of an A/B benchmark whose pairs alternate which run goes first."""
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--pairs", type=int, default=4, help="alternating pairs, each reported (at least 4)")
    ap.add_argument("--steps", type=int, default=80, help="steps per run, timed from step 11 to N-10")
    return ap.parse_args()


def in_turn(pair: int, *kinds: Any) -> tuple[Any, ...]:
    """The order pair number `pair` runs `kinds` in: as given for even pairs, reversed for odd, so
    each goes first as often (a machine warming up, a cache filling, favours neither side)."""
    return kinds if pair % 2 == 0 else kinds[::-1]


def paired_rounds(pairs: int, kinds: tuple[str, str], measure: Callable[[int, str], Any],
                  compare: Callable[[dict[str, Any]], dict[str, Any]],
                  line: Callable[[int, dict[str, Any]], str]) -> list[dict[str, Any]]:
    """`pairs` rounds of the two `kinds` measured in turn (`in_turn`), each round printed as it ends: the shape of
    every benchmark that alternates two kinds. `measure(round, kind)` gives the kind's number (stored under the
    kind) or a dict of several; `compare(round)` adds what the pair says (a ratio, a difference); `line(round
    index, round)` is the round's printed line. Every round is returned, for the report's table of every pair."""
    rounds = []
    for i in range(pairs):
        r: dict[str, Any] = {}
        for kind in in_turn(i, *kinds):
            got = measure(i, kind)
            r.update(got if isinstance(got, dict) else {kind: got})
        r.update(compare(r))
        print(line(i, r), flush=True)
        rounds.append(r)
    return rounds


venv_tools_first()  # before any benchmark starts Ray or a job: their processes inherit it


def write_spec(spec: JobSpec, path: Path) -> Path:
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False))
    return path


def tidal_run(spec_path: Path, *args: str, timeout: float = 900, env_extra: dict[str, str] | None = None) -> str:
    """`tidal run` in a process of its own (its own local Ray instance, which inherits `env_extra`)."""
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **(env_extra or {})}
    proc = subprocess.run([sys.executable, "-m", "tidal", "run", str(spec_path), *args], capture_output=True,
                          text=True, timeout=timeout, env=env)
    if proc.returncode:
        raise RuntimeError(proc.stdout[-3000:] + proc.stderr[-3000:])
    return proc.stdout


def history(spec: JobSpec, run_id: str, key: str) -> dict[int, tuple[float, int]]:
    """step -> (value, timestamp ms)."""
    from mlflow.tracking import MlflowClient  # imported here: the GPU machine has no MLflow

    return {m.step: (m.value, m.timestamp) for m in MlflowClient(spec.tracking.uri).get_metric_history(run_id, key)}


def latest_run_id(spec: JobSpec) -> str:
    from mlflow.tracking import MlflowClient

    c = MlflowClient(spec.tracking.uri)
    exp = c.get_experiment_by_name(spec.tracking.experiment)
    runs = c.search_runs([exp.experiment_id], filter_string=f"tags.`tidal.job` = '{spec.name}'",
                         order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0].info.run_id


def engine_state(engine: Any) -> dict[str, Any]:
    """A DeepSpeed engine's model and optimizer state, as a naive checkpoint would save them."""
    return {"model": engine.module.state_dict(), "optim": engine.optimizer.state_dict()}


def torch_save_fsync(state: Any, path: Path) -> tuple[float, int]:
    """The naive baseline every checkpoint benchmark compares with: a synchronous `torch.save` of
    `state` into a local file, fsynced. Returns (seconds, bytes); the file is removed."""
    import torch

    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    size = path.stat().st_size
    path.unlink()
    return seconds, size


RAY_DAEMONS = ("raylet/raylet", "gcs_server", "dashboard/dashboard.py", "dashboard/agent.py")


def settle(timeout_s: float = 60.0, quiet_s: float = 5.0) -> None:
    """Before a timed run: wait until the previous run's local Ray instance has fully exited, then
    a few seconds more. Without it the run that goes second in a pair trained about 5% slower on
    this 2-core machine (the first one's daemons were still winding down), whichever kind it was."""
    import psutil

    def exited() -> bool:
        return not any(d in " ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])
                       for d in RAY_DAEMONS)

    with contextlib.suppress(TimeoutError):  # a daemon that lingers past it slows the run, it does not spoil it
        wait_for("the previous run's Ray daemons to exit", exited, timeout_s, every=0.5)
    time.sleep(quiet_s)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def update_doc(section: str, body: str, doc: Path = DOC) -> None:
    """Replace `## section` in `doc` (docs/benchmarks.md) where it is (or append it), keeping the other sections."""
    text = doc.read_text() if doc.exists() else "# Benchmarks\n\nEvery figure below is a ratio or a time measured in one invocation on one machine; the command that produced it is given with it.\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(with_section(text, section, body))


def read_trace(path: Path) -> list[dict[str, Any]]:
    """The records of a loss trace (TIDAL_LOSS_TRACE: rank 0's step, loss, world, time of every
    step of every life); a line cut short by a kill mid-write is skipped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


class Job:
    """A `tidal run` process against a cluster at `address`, and the loss trace its rank 0 writes.
    A driver killed and started again (`restart`) is the same job resuming, as a user or Ray Jobs
    would run the command again."""

    def __init__(self, spec_path: Path, address: str, trace: Path, log: Path) -> None:
        self.cmd = [sys.executable, "-m", "tidal", "run", str(spec_path)]
        self.env = {**os.environ, "RAY_ADDRESS": address}
        self.trace, self.log, self.proc = trace, log, None
        self.lock = threading.Lock()  # a fault thread restarts the driver while another waits on it

    def start(self) -> None:
        with self.lock:
            self.proc = start_in_session(self.cmd, self.log, env=self.env)

    def stop(self) -> None:
        """SIGKILL the driver (a crash, not a shutdown)."""
        with self.lock:
            proc = self.proc
        if proc and proc.poll() is None:
            kill_session(proc)

    def restart(self) -> None:
        self.stop()
        self.start()

    def wait_exit(self, timeout_s: float) -> int:
        """Until a driver exits by itself (not killed by a fault); its exit code."""
        def own_exit() -> tuple[int] | None:  # a tuple: an exit code of 0 is an answer too
            with self.lock:
                proc = self.proc
            code = proc.poll() if proc else None
            return (code,) if code is not None and code != -signal.SIGKILL else None

        return wait_for(f"the job to end (see {self.log})", own_exit, timeout_s, every=0.5)[0]

    def records(self) -> list[dict[str, Any]]:
        return read_trace(self.trace)

    def steps_done(self) -> int:
        return len(self.records())

    def new_life_after(self, seen: int, timeout_s: float = 900) -> float:
        """The time of the first step of a life that starts after record `seen` (steps go back)."""
        def first_of_new_life() -> float | None:
            recs = self.records()
            return next((r["ts"] for prev, r in zip(recs[seen - 1:], recs[seen:], strict=False)
                         if r["step"] <= prev["step"]), None)

        return wait_for(f"a new life of the job (see {self.log})", first_of_new_life, timeout_s)

    def wait_steps(self, n: int, timeout_s: float = 600) -> None:
        wait_for(f"{n} trace records of the job (see {self.log})", lambda: self.steps_done() >= n, timeout_s, every=0.5)


def child_run(module: str, mark: str, kind: str, folder: Path) -> tuple[dict[str, Any], str]:
    """`python -m <module> --child <kind> <folder>`: one measured run in a process of its own (as a user's
    `tidal run` is, with its own Ray); the result it printed after `mark`, and its whole output."""
    folder.mkdir(parents=True)
    proc = subprocess.run([sys.executable, "-m", module, "--child", kind, str(folder)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    for line in proc.stdout.splitlines():
        if line.startswith(mark):
            return json.loads(line[len(mark):]), proc.stdout
    raise RuntimeError(f"{kind} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def first_step_after(loss_trace: Path, t: float) -> float:
    """Seconds from `t` to the first step rank 0's loss trace holds after it."""
    return min(r["ts"] for r in read_trace(loss_trace) if r["ts"] > t) - t


def pairs_main(doc: str | None, section: str, prefix: str, run: Callable[[int, Path], Any],
               report: Callable[[Any, int], str]) -> None:
    """The command line of a benchmark of alternating pairs: `run(pairs, tmp)` in a temporary folder,
    its `report` printed and written as `section` of docs/benchmarks.md (unless --no-doc)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=4, help="alternating pairs, each reported (at least 4)")
    ap.add_argument("--no-doc", action="store_true", help="print the report only")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix=prefix) as d:
        text = report(run(args.pairs, Path(d)), args.pairs)
    print(text)
    if not args.no_doc:
        update_doc(section, text)
