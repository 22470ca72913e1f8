"""One MLflow run per job, kept across restarts and resizes, logged from one place.

Ray 2.60 has no MLflow integration for Train V2 (MLflowLoggerCallback is Tune-only), and
`ray.train.report` is no channel for per-step metrics: each call blocks until the controller
polls (every 2 s by default), so reporting every few steps would stall training. Instead rank 0
sends its metrics, fire-and-forget, to a `Tracker` actor on the driver's node. The tracker logs
each step once (a step replayed after a restart is skipped), prints the progress line, and never
stops training when MLflow is unreachable: points wait in a buffer file in the run folder and
are sent when the server answers again. `ray.train.report` is used for checkpoints only.
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
from ray.train import UserCallback

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


class Tracker:
    """Logs rank 0's metrics to MLflow once per step and prints progress (a Ray actor in a run)."""

    def __init__(self, spec: JobSpec, run_id: str, run_dir: str | None) -> None:
        self.spec, self.run_id = spec, run_id
        self.buffer = Path(run_dir) / BUFFER_FILE if run_dir else None
        self.last_step: int | None = None  # highest step already in MLflow
        self.reported_step = 0  # highest step seen from rank 0 in this launch
        self.failed_since_resume = False
        # Fault counters, logged with every step so MLflow shows when each changed.
        self.counters = {"restarts": 0.0, "resizes": 0.0, "steps_lost": 0.0, "max_steps_lost": 0.0}
        self.latest: dict[str, float] = {}
        self.t0 = time.time()
        self.first_step: int | None = None
        self._warned = False

    # --- called by rank 0 and by the controller callback ----------------------------------
    def log(self, m: dict[str, Any]) -> None:
        """Rank 0's metrics for one step (with `step`), printed and logged unless already logged."""
        step = int(m["step"])
        self.reported_step = max(self.reported_step, step)
        if "loss" in m:
            print(self._progress_line(m), flush=True)
        if "checkpoint_bytes" in m:
            print(f"[tidal] checkpoint at step {step}: {m['checkpoint_bytes'] / 2**20:.1f} MiB on rank 0, "
                  f"written in {m.get('checkpoint_save_s', 0):.2f}s, training blocked {m.get('checkpoint_blocked_s', 0):.2f}s", flush=True)
        if self._already_logged(step):
            return  # a step replayed after a restart: MLflow already has it
        self.latest.update({k: v for k, v in m.items() if isinstance(v, (int, float))})
        self.last_step = step
        values = {k: float(v) for k, v in m.items() if k not in NOT_METRICS and isinstance(v, (int, float))}
        values.update(self.counters)
        self._log({"step": step, "values": values, "ts": int(time.time() * 1000)})

    def say(self, message: str) -> None:
        """A line for the person watching: workers speak through here so it is printed once."""
        print(f"[tidal] {message}", flush=True)

    def note_failure(self, failures: dict[int, str]) -> None:
        """The worker group failed; Ray restarts it from the latest complete checkpoint."""
        self.counters["restarts"] += 1
        self.failed_since_resume = True
        for rank, why in sorted(failures.items()):
            print(f"[tidal] worker rank {rank} failed: {why}", flush=True)
        print(f"[tidal] restart {self.counters['restarts']:.0f}: restarting the worker group from the latest "
              f"complete checkpoint (last step reached: {self.reported_step})", flush=True)

    def resumed(self, checkpoint: str, step: int, old_world: int, world: int) -> None:
        """A worker group (re)started from `checkpoint`: count the steps lost and any resize."""
        self._already_logged(0)  # loads what MLflow holds, for a driver that was itself restarted
        lost = max(0, max(self.reported_step, self.last_step or 0) - step)
        self.counters["steps_lost"] += lost
        self.counters["max_steps_lost"] = max(self.counters["max_steps_lost"], lost)
        line = f"resumed from {checkpoint} at step {step}/{self.spec.train.steps}"
        if lost:
            line += f" ({lost} step(s) to redo)"
        if old_world != world:
            self.counters["resizes"] += 1
            why = "after a failure" if self.failed_since_resume else "capacity changed"
            line += f"; resized world size {old_world} -> {world} ({why}), checkpoint resharded"
        self.failed_since_resume = False
        self.say(line)

    def close(self) -> tuple[dict[str, float], int]:
        """(last values seen, points still unsent) after one more try to send the buffer."""
        pending = self._read_buffer()
        if pending:
            try:
                _send(self.spec, self.run_id, pending)
                self._write_buffer([])
                pending = []
            except Exception:  # noqa: BLE001 - reported to the caller as points left
                pass
        return dict(self.latest), len(pending)

    # --- helpers ------------------------------------------------------------------------
    def _already_logged(self, step: int) -> bool:
        if self.last_step is None:
            self.last_step = _max_logged_step(self.spec, self.run_id)
        return step <= self.last_step

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


class FailureNotifier(UserCallback):
    """Ray Train controller callback: tells the tracker when the worker group fails."""

    def __init__(self, tracker: Any) -> None:
        self.tracker = tracker

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        self.tracker.note_failure.remote({r: _last_line(e) for r, e in worker_exceptions.items()})


def _last_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[-1][:300] if text else type(e).__name__


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


def metrics_frame(spec: JobSpec, run_id: str) -> Any:
    """Every metric of a run as a pandas DataFrame: one row per step, one column per metric."""
    import pandas as pd

    c = client(spec)
    rows: dict[int, dict[str, float]] = {}
    for key in c.get_run(run_id).data.metrics:
        for m in c.get_metric_history(run_id, key):
            rows.setdefault(m.step, {})[key] = m.value
    frame = pd.DataFrame.from_dict(rows, orient="index").sort_index()
    frame.index.name = "step"
    return frame.reset_index()
