"""Test helpers shared by several test files (a test file never imports another): run the CLI and
a driver as a user does, kill a worker mid-run, fake a checkpoint folder, register checkpoints with
Ray Train's own checkpoint manager, the batch a job trained on at a step, the text sources of
tests/test_models_data.py (and of its stored reference, tests/golden.py). The real servers and
processes are tidal.testing's (re-exported here where tests already import them from here)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tidal.spec.job import JobSpec
from tidal.storage import STATE_FILE, RunDir, checkpoint_dir_name, manifest_name
from tidal.testing.processes import kill as kill
from tidal.testing.processes import our_processes as our_processes
from tidal.testing.runs import StepHolds
from tidal.testing.runs import job_run_id as job_run_id
from tidal.testing.runs import wait_for_step as wait_for_step
from tidal.testing.runs import wait_for_world_size as wait_for_world_size

ROOT = Path(__file__).resolve().parents[1]
# The storages a storage-level test runs on: local in the quick tier, the S3 test server (a moto
# server, boto3 and an S3 round trip per call: 0.3-3 s a test) in the slow one, so
# `-m "not slow"` stays a quick tier while every claim is still tested against a real S3 API.
STORAGES = ["local", pytest.param("s3", marks=pytest.mark.slow)]
# An exported model's loss on a batch against the loss the distributed job logged for it.
EXPORT_TOLERANCE = 1e-4


def tidal_cli(*args: str, cwd: os.PathLike[str] | str = ROOT, timeout: float = 120,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`tidal ARGS` from this worktree's sources, without TIDAL_DEBUG (tracebacks would be expected);
    `env` on top of this process's environment."""
    full = {**os.environ, **(env or {}), "PYTHONPATH": f"{ROOT / 'platform'}{os.pathsep}{ROOT}"}
    full.pop("TIDAL_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "tidal", *args], capture_output=True, text=True, env=full, cwd=cwd,
                          timeout=timeout)


# What a person should not have to read in `tidal run`'s console on a run that went as Tidal says:
# a Ray process prefix, colour codes in output that is no terminal, DeepSpeed's or Ray's chatter.
ANSI = re.compile(r"\x1b\[[0-9;]*m")
RAY_PREFIX = re.compile(r"^\((?:\w+ )?pid=\d+|^\(raylet\)|^\(autoscaler")
# DeepSpeed's logger: "[2026-11-27 10:00:00,000] [WARNING] [file.py:123:func] ..."
DEEPSPEED_LINE = re.compile(r"\[(?:INFO|WARNING|DEBUG)\] \[[\w.]+:\d+:\w+\]")
CHATTER = ("MPU is not provided", "Extracting ZeRO fragments", "Merging slices", "*** Done!", "Resharding",
           "A worker died or was killed", "Convert DeepSpeed Checkpoint", "Graceful shutdown of backend failed",
           "Restore: ", "Traceback",
           # what tracking/quiet.py lowers at its source (each line there says why)
           "TrainingReport(", "Setting accelerator to CPU", "all_gather_into_tensor", "lr_scheduler.step()",
           "optimizer.step()` has been overridden", "built successfully", "Creating initial MLflow database tables",
           "Failed to query Ray Train Controller actor state", "Token authentication is enabled for this Ray cluster")


def chatter_in(out: str) -> list[str]:
    """The lines of a console's `out` a person should not have to read."""
    return [line for line in out.splitlines()
            if ANSI.search(line) or DEEPSPEED_LINE.search(line) or any(c in line for c in CHATTER)
            or RAY_PREFIX.search(line)]


def short_run_problems(out: str) -> list[str]:
    """What the console of a short `tidal run` that went well must not hold: `chatter_in`'s lines, a
    Python warning, Ray's C++ `E` line ("[2026-11-25 15:01:02,345 E 1234 1234] file.cc:12: ..."),
    a `[tidal]` line with Ray's process prefix, or more than 30 lines."""
    lines = out.splitlines()
    problems = chatter_in(out) + [line for line in lines if re.search(r"\b\w+Warning: ", line)
                                  or re.search(r"\d E \d+ \d+\]", line) or ("[tidal]" in line and "pid=" in line)]
    return problems + ([f"{len(lines)} lines, more than 30:\n{out}"] if len(lines) > 30 else [])


def set_args(overrides: list[str]) -> list[str]:
    """`--set` before each `a.b=value`, as the CLI takes them."""
    return [arg for o in overrides for arg in ("--set", o)]


def tidal_main(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """`tidal ARGS` in this process (`tidal.cli.main`, what the `tidal` script calls), without
    TIDAL_DEBUG unless `env` sets it: (exit code, stdout, stderr). A subprocess pays 0.6-0.9 s of
    interpreter and imports per call; `tidal_cli` keeps that for what only a process shows (its
    imports, `python -m tidal`)."""
    import contextlib
    import io
    from unittest import mock

    from tidal.cli import main

    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        os.environ.pop("TIDAL_DEBUG", None)
        os.environ.update(env or {})
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse: bad usage (2) and --help (0)
            code = e.code if isinstance(e.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def driver_in(ray_tmpdir: Path) -> subprocess.CompletedProcess[str]:
    """A fresh driver process, no RAY_ADDRESS, whose Ray temp dir is `ray_tmpdir`: it connects as Tidal
    does and prints the GCS address it got, then disconnects."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": str(ray_tmpdir)}
    code = ("from tidal.launch.connect import connect_ray; import ray; connect_ray(); "
            "print('gcs', ray.get_runtime_context().gcs_address); ray.shutdown()")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)


def kill_a_worker_at(spec: JobSpec, step: int, killed: list[int]) -> tuple[JobSpec, threading.Thread]:
    """The job, its rank 0 held once `step` is done (StepHolds), and a started thread that SIGKILLs
    one Ray Train worker while it holds (the pid goes in `killed`), then lets it go. Run the returned
    spec: the kill lands after `step` however fast the machine trains."""
    holds = StepHolds(step)

    def kill_one() -> None:
        holds.wait(step)
        workers = our_processes("RayTrainWorker")
        if workers:
            killed.append(workers[-1].pid)
            kill(workers[-1])
        holds.release(step)

    killer = threading.Thread(target=kill_one, daemon=True)
    killer.start()
    return holds.spec(spec), killer


def run_killing_a_worker(spec: JobSpec, after_step: int) -> tuple[Any, bool]:
    """`tidal.run(spec)` while a thread SIGKILLs one Ray Train worker once `after_step` is done;
    returns (the run's result, whether a worker was killed)."""
    import tidal

    killed: list[int] = []
    held, killer = kill_a_worker_at(spec, after_step, killed)
    result = tidal.run(held)
    killer.join(timeout=5)
    return result, bool(killed)


def fake_checkpoint(run: Path, step: int, world: int = 2, spec: JobSpec | None = None) -> Path:
    """A complete checkpoint folder as Tidal writes one (state file, per-rank files and manifests),
    with placeholder bytes instead of DeepSpeed's state."""
    d = run / checkpoint_dir_name(step)
    (d / f"global_step{step}").mkdir(parents=True)
    fp = (spec or JobSpec()).resume_fingerprint()
    (d / STATE_FILE).write_text(json.dumps({"step": step, "world_size": world, "fingerprint": fp}))
    for rank in range(world):
        f = d / f"global_step{step}" / f"zero_pp_rank_{rank}_optim_states.pt"
        f.write_bytes(b"x" * (100 + rank))
        files = {str(f.relative_to(d)): f.stat().st_size}
        if rank == 0:
            files[STATE_FILE] = (d / STATE_FILE).stat().st_size
        (d / manifest_name(rank)).write_text(json.dumps({"step": step, "files": files}))
    return d


def batch_of_step(spec: JobSpec, step: int) -> tuple[Any, Any]:
    """The whole global batch the job trained on at `step` (tidal.worker.data's order): (inputs, targets)."""
    from tidal.worker.data import SyntheticTask

    t, m = spec.train, spec.model
    rows = SyntheticTask(m.vocab_size, m.seq_len, t.seed).samples((step - 1) * t.global_batch, t.global_batch)
    return rows[:, :-1], rows[:, 1:]


def ray_registers(run: RunDir, keep: int) -> Callable[[int], None]:
    """Ray Train's own checkpoint manager over the run folder, as its controller runs it (no Ray
    instance needed): registering a step writes Ray's snapshot and deletes what num_to_keep drops,
    and fails, as in the controller, if a checkpoint it registered has vanished."""
    from ray.train import Checkpoint, CheckpointConfig
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
    from ray.train.v2._internal.execution.storage import StorageContext
    from ray.train.v2._internal.execution.training_report import _TrainingReport

    root, name = run.path.rsplit("/", 1)
    manager = CheckpointManager(CheckpointConfig(num_to_keep=keep), StorageContext(root, name, run.fs))

    def register(step: int) -> None:
        async def in_controller() -> None:  # it notifies its listeners on the controller's event loop
            checkpoint = Checkpoint(f"{run.path}/{checkpoint_dir_name(step)}", filesystem=run.fs)
            manager.register_checkpoint(_TrainingReport(checkpoint, {"step": step}, validation=False))

        asyncio.run(in_controller())

    return register


_rng = random.Random(0)
TEXT = ["".join(_rng.choice("abcdefghij klmnop") for _ in range(240)) for _ in range(60)]  # windows all differ


def write_sources(tmp: Path) -> dict[str, str]:
    """TEXT as a jsonl and a parquet source in `tmp` (tests/golden.py trains a stored reference on the
    parquet one: the same rows, wherever it is written)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = tmp / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(TEXT)))
    parquet = tmp / "docs.parquet"
    pq.write_table(pa.table({"text": TEXT}), parquet)
    return {"jsonl": str(jsonl), "parquet": str(parquet)}


def cluster_spec(path: Path) -> dict:
    """The RayCluster spec of a KubeRay manifest: a RayCluster's own, or a RayJob's rayClusterSpec."""
    import yaml

    doc = yaml.safe_load(path.read_text())
    return doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]


def prestop_command(path: Path | None = None) -> list[str]:
    """The first worker group's preStop command in cluster_configs/kuberay/raycluster.yaml (or
    `path`), as the pod runs it."""
    from tests.conftest import ROOT

    spec = cluster_spec(path or ROOT / "cluster_configs" / "kuberay" / "raycluster.yaml")
    ray = spec["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    return [str(w) for w in ray["lifecycle"]["preStop"]["exec"]["command"]]


