"""One MLflow run per job, kept across restarts and resizes, logged from the Ray Train controller.

Ray 2.60 has no MLflow callback for Train V2 (its MLflowLoggerCallback is Tune-only), so the
controller-side `ray.train.UserCallback` below is ours. It gets rank 0's metrics of every
`ray.train.report`, logs each step once (a step replayed after a restart is skipped), prints
the progress line, and never stops training when MLflow is unreachable: metrics wait in a
buffer file in the run folder and are sent when the server answers again.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import Metric, Param, RunStatus
from mlflow.tracking import MlflowClient
from ray.train import Checkpoint, UserCallback

from tidal import __version__
from tidal.spec.job import JobSpec

log = logging.getLogger("tidal")
BUFFER_FILE = "tidal-mlflow-buffer.jsonl"
NOT_METRICS = ("step", "preempted")


def client(spec: JobSpec) -> MlflowClient:
    return MlflowClient(tracking_uri=spec.tracking.uri)


def start_run(spec: JobSpec, run_id: str | None, tags: dict[str, str]) -> str:
    """Reopen `run_id` if it exists, else create the job's run and log the spec as params."""
    c = client(spec)
    if run_id:
        try:
            c.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
            return run_id
        except mlflow.exceptions.MlflowException:
            log.warning("MLflow run %s of this job is gone; starting a new one", run_id)
    exp = c.get_experiment_by_name(spec.tracking.experiment)
    exp_id = exp.experiment_id if exp else c.create_experiment(spec.tracking.experiment)
    run = c.create_run(exp_id, run_name=spec.name, tags={"tidal.job": spec.name, "tidal.version": __version__, **tags})
    params = [Param(k, str(v)) for k, v in spec.flat().items()]
    for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
        c.log_batch(run.info.run_id, params=params[i : i + 100])
    return run.info.run_id


def end_run(spec: JobSpec, run_id: str, ok: bool) -> None:
    status = RunStatus.FINISHED if ok else RunStatus.FAILED
    try:
        client(spec).set_terminated(run_id, RunStatus.to_string(status))
    except Exception as e:  # noqa: BLE001 - tracking must never turn a finished job into a crash
        log.warning("Could not mark MLflow run %s as %s: %s", run_id, status, e)


def last_metrics(spec: JobSpec, run_id: str) -> dict[str, float]:
    return dict(client(spec).get_run(run_id).data.metrics)


def run_url(spec: JobSpec, run_id: str) -> str:
    """How a person opens this run."""
    uri = spec.tracking.uri
    if uri.startswith(("http://", "https://")):
        exp = client(spec).get_run(run_id).info.experiment_id
        return f"{uri.rstrip('/')}/#/experiments/{exp}/runs/{run_id}"
    return f"mlflow ui --backend-store-uri {uri}   (then open http://127.0.0.1:5000, run {run_id})"


class MlflowReporter(UserCallback):
    """Runs in the Ray Train controller: logs rank 0's reports, prints progress, notes restarts."""

    def __init__(self, spec: JobSpec, run_id: str, run_dir: str | None) -> None:
        self.spec, self.run_id = spec, run_id
        self.buffer = Path(run_dir) / BUFFER_FILE if run_dir else None
        self.last_step: int | None = None  # highest step already in MLflow
        self.world_size: int | None = None
        self.restarts = 0
        self.t0 = time.time()
        self.first_step: int | None = None
        self._warned = False

    # --- Ray Train hooks ---------------------------------------------------------------
    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Checkpoint | None) -> None:
        m = metrics[0] if metrics else {}
        if "step" not in m:
            return
        step = int(m["step"])
        self._note_resize(step, int(m.get("world_size", 0)))
        print(self._progress_line(m), flush=True)
        if checkpoint is not None:
            print(f"[tidal] checkpoint step {step} -> {checkpoint.path} "
                  f"({m.get('checkpoint_bytes', 0) / 2**20:.1f} MiB, saved in {m.get('checkpoint_save_s', 0):.2f}s)", flush=True)
        if self._already_logged(step):
            return  # a step replayed after a restart: MLflow already has it
        self.last_step = step
        values = {k: float(v) for k, v in m.items() if k not in NOT_METRICS and isinstance(v, (int, float))}
        self._log({"step": step, "values": values, "ts": int(time.time() * 1000)})

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        self.restarts += 1
        for rank, exc in sorted(worker_exceptions.items()):
            first = str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc).__name__
            print(f"[tidal] worker rank {rank} failed: {first}", flush=True)
        print(f"[tidal] restart {self.restarts}: the worker group restarts from the latest complete checkpoint "
              f"(last step reported: {self.last_step})", flush=True)
        if self.last_step is not None:
            self._log({"step": self.last_step, "values": {"restarts": float(self.restarts)}, "ts": int(time.time() * 1000)})

    # --- helpers ------------------------------------------------------------------------
    def _already_logged(self, step: int) -> bool:
        if self.last_step is None:
            self.last_step = _max_logged_step(self.spec, self.run_id)
        return step <= self.last_step

    def _note_resize(self, step: int, world: int) -> None:
        if self.world_size is not None and world and world != self.world_size:
            print(f"[tidal] resized: world size {self.world_size} -> {world} at step {step}", flush=True)
        self.world_size = world or self.world_size

    def _progress_line(self, m: dict[str, Any]) -> str:
        step, total = int(m["step"]), self.spec.train.steps
        if self.first_step is None:
            self.first_step, self.t0 = step, time.time()
        elapsed = time.time() - self.t0
        done = step - self.first_step
        eta = elapsed / done * (total - step) if done > 0 else float("nan")
        return (f"[tidal] step {step}/{total} | loss {m['loss']:.4f} | {m['tokens_per_s']:,.0f} tok/s | "
                f"{m['samples_per_s']:,.1f} samples/s | MFU {100 * m['mfu']:.1f}% | world {m['world_size']} | "
                f"elapsed {_hms(elapsed)} | ETA {_hms(eta)}")

    def _log(self, entry: dict[str, Any]) -> None:
        pending = [*self._read_buffer(), entry]
        try:
            _send(self.spec, self.run_id, pending)
        except Exception as e:  # noqa: BLE001 - any tracking failure must leave training running
            self._write_buffer(pending)
            if not self._warned:
                print(f"[tidal] WARNING: MLflow at {self.spec.tracking.uri} is unreachable ({type(e).__name__}); "
                      f"training continues and metrics are kept in {self.buffer or 'memory'} until it is back", flush=True)
                self._warned = True
            return
        if self._warned:
            print(f"[tidal] MLflow is reachable again: sent {len(pending)} buffered point(s)", flush=True)
            self._warned = False
        self._write_buffer([])

    def _read_buffer(self) -> list[dict[str, Any]]:
        if self.buffer is None:
            return getattr(self, "_mem", [])
        if not self.buffer.exists():
            return []
        return [json.loads(line) for line in self.buffer.read_text().splitlines() if line.strip()]

    def _write_buffer(self, entries: list[dict[str, Any]]) -> None:
        if self.buffer is None:
            self._mem = entries
        elif entries:
            self.buffer.parent.mkdir(parents=True, exist_ok=True)
            self.buffer.write_text("".join(json.dumps(e) + "\n" for e in entries))
        else:
            self.buffer.unlink(missing_ok=True)


def flush_buffer(spec: JobSpec, run_id: str, run_dir: str) -> int:
    """Send what a reporter left buffered (the driver calls this at the end). Returns points left."""
    reporter = MlflowReporter(spec, run_id, run_dir)
    pending = reporter._read_buffer()
    if not pending:
        return 0
    try:
        _send(spec, run_id, pending)
    except Exception:  # noqa: BLE001
        return len(pending)
    reporter._write_buffer([])
    return 0


def _send(spec: JobSpec, run_id: str, entries: Iterable[dict[str, Any]]) -> None:
    metrics = [Metric(k, v, e["ts"], e["step"]) for e in entries for k, v in e["values"].items()]
    c = client(spec)
    for i in range(0, len(metrics), 1000):  # MLflow's batch limit
        c.log_batch(run_id, metrics=metrics[i : i + 1000], synchronous=True)


def _max_logged_step(spec: JobSpec, run_id: str) -> int:
    try:
        return max((m.step for m in client(spec).get_metric_history(run_id, "loss")), default=0)
    except Exception:  # noqa: BLE001 - unreachable: nothing known to be logged yet
        return 0


def _hms(seconds: float) -> str:
    if seconds != seconds:  # NaN: no estimate yet
        return "--:--"
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
