"""Helpers shared by the benchmarks: run a Tidal job in a subprocess, read MLflow, write the doc."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from tidal.spec.job import JobSpec
from tidal.testing.processes import venv_tools_first

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"


def pair_args(doc: str | None) -> argparse.Namespace:
    """The options of an A/B benchmark whose pairs alternate which run goes first."""
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--pairs", type=int, default=4, help="alternating pairs, each reported (at least 4)")
    ap.add_argument("--steps", type=int, default=80, help="steps per run, timed from step 11 to N-10")
    return ap.parse_args()


venv_tools_first()  # before any benchmark starts Ray or a job: their processes inherit it


def write_spec(spec: JobSpec, path: Path) -> Path:
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False))
    return path


def tidal_run(spec_path: Path, *args: str, timeout: float = 900) -> str:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
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

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        busy = False
        for p in psutil.process_iter(["cmdline"]):
            cmd = " ".join(p.info["cmdline"] or [])
            busy |= any(d in cmd for d in RAY_DAEMONS)
        if not busy:
            break
        time.sleep(0.5)
    time.sleep(quiet_s)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def update_doc(section: str, body: str, doc: Path = DOC) -> None:
    """Replace `## section` in `doc` (docs/benchmarks.md) where it is (or append it), keeping the other sections."""
    text = doc.read_text() if doc.exists() else "# Benchmarks\n\nEvery figure below is a ratio or a time measured in one invocation on one machine; the command that produced it is given with it.\n"
    parts = text.split("\n## ")
    new = f"{section}\n\n{body.strip()}\n"
    sections = [new if p.startswith(section) else p.rstrip() + "\n" for p in parts[1:]]
    if new not in sections:  # a new section goes last; an existing one keeps its place
        sections.append(new)
    text = "\n## ".join([parts[0].rstrip() + "\n", *sections]).rstrip() + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
