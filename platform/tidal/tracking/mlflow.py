"""One MLflow run per job, kept across restarts and resizes, logged from one place.

Ray 2.60 has no MLflow integration for Train V2 (MLflowLoggerCallback is Tune-only), and
`ray.train.report` is no channel for per-step metrics: each call blocks until the controller
polls (every 2 s by default), so reporting every few steps would stall training. Instead rank 0
sends its metrics, fire-and-forget, to a `Tracker` actor on the driver's node. The tracker
appends each step to a buffer file in the run folder, sends the buffer to MLflow in batches,
logs each step once (a step replayed after a restart is skipped), prints the progress line, and
never stops training when MLflow is unreachable: points wait in the buffer until it answers.
Before a checkpoint is saved, rank 0 waits until the tracker has buffered every step up to it:
a checkpoint that becomes the resume point must not leave metrics behind in a dead driver's
queue (they would never be logged, since training resumes after them).
`ray.train.report` is used for checkpoints only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import Metric, Param, RunStatus
from mlflow.tracking import MlflowClient

from tidal import __version__
from tidal.launch.result import print_record
from tidal.spec.job import JobSpec
from tidal.storage import JOB_FILE, RunDir
from tidal.tracking.buffer import MetricsBuffer

log = logging.getLogger("tidal")

# MLflow's HTTP client retries a dead server for minutes by default (7 tries, doubling waits).
# Tidal buffers and retries on its own schedule instead, so fail fast (user settings win).
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
NOT_METRICS = ("step", "preempted")
SENT_FILE = "tidal-mlflow-sent.json"  # beside the buffer: the highest steps MLflow holds


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
    exp_id = exp.experiment_id if exp else c.create_experiment(spec.tracking.experiment, _artifact_root(spec.tracking.uri))
    run = c.create_run(exp_id, run_name=spec.name, tags={"tidal.job": spec.name, "tidal.version": __version__, **tags})
    params = [Param(k, str(v)) for k, v in spec.flat().items()]
    for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
        c.log_batch(run.info.run_id, params=params[i : i + 100])
    return run.info.run_id


def _artifact_root(uri: str) -> str | None:
    """Beside a SQLite store, not in whatever directory the creating process ran in (./mlruns)."""
    if uri.startswith("sqlite:///"):
        return str(Path(uri[len("sqlite:///"):]).parent / "mlartifacts")
    return None  # a server decides


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
    """Logs rank 0's metrics to MLflow once per step and prints progress (a Ray actor in a run).

    Points go to a buffer first (objects in the run folder on the job's storage, so a dead
    driver loses none, whichever node it ran on); a sender thread sends whatever is pending as soon as its last send is done, so
    points batch up by themselves when steps outpace MLflow, and no call from a worker ever
    waits on MLflow. While MLflow is unreachable the tracker keeps buffering and retries every
    `retry_s` seconds. If MLflow was down when the job started, the run itself
    is created on the first successful contact.
    """

    def __init__(self, spec: JobSpec, run_id: str | None, tags: dict[str, str] | None = None,
                 retry_s: float = 5.0, record: dict[str, Any] | None = None, system_metrics: bool = True) -> None:
        self.spec, self.run_id, self.tags, self.record = spec, run_id, tags or {}, record
        self.run_dir = RunDir(spec.checkpoint.storage, spec.name)
        self.buffer = MetricsBuffer(self.run_dir.fs, self.run_dir.path)
        self.pending: list[dict[str, Any]] = self.buffer.load()
        self.recovered = list(self.pending)  # left by an earlier driver: some may have reached MLflow
        # How far MLflow is known to hold this run's points, kept beside the buffer: a new driver
        # learns it without asking MLflow, which may be down just then.
        sent = self.run_dir.read_json(SENT_FILE) or {}
        self.sent = sent if run_id and sent.get("run_id") == run_id else {}
        self.lock = threading.Lock()  # guards `pending` and the buffer against the sender
        self.sending = threading.Lock()  # one sender at a time: the thread, or the driver's final flush
        self.retry_s, self.retry_at = retry_s, 0.0
        self.last_step: int | None = None  # highest step already in MLflow
        self.reported_step = 0  # highest step seen from rank 0 in this launch
        self.last_checkpoint_step: int | None = None  # highest step with checkpoint metrics in MLflow
        self.failed_since_resume = False
        self.world_size: int | None = None
        # Fault counters, logged with every step so MLflow shows when each changed.
        self.counters = {"restarts": 0.0, "resizes": 0.0, "steps_lost": 0.0, "max_steps_lost": 0.0}
        self.latest: dict[str, float] = {}
        self.t0 = time.time()
        self.first_step: int | None = None
        self.down_since: float | None = None
        self.monitor = self._start_system_metrics() if system_metrics else None
        self.stopped, self.pending_added = threading.Event(), threading.Event()
        self.sender = threading.Thread(target=self._send_loop, daemon=True, name="mlflow-sender")
        if self.pending:  # left in the buffer file by an earlier driver
            self.pending_added.set()
        self.sender.start()

    # --- called by rank 0 and by the controller callback ----------------------------------
    def log(self, m: dict[str, Any]) -> None:
        """Rank 0's metrics for one step (with `step`), printed and logged unless already logged.

        When this returns the step is in the buffer file, so waiting on the call makes it durable.
        """
        step = int(m["step"])
        self.reported_step = max(self.reported_step, step)
        self._note_world_size(step, int(m.get("world_size", 0)))
        if "loss" in m:
            print(self._progress_line(m), flush=True)
        if self._already_logged(step):
            return  # a step replayed after a restart: MLflow already has it
        self.latest.update({k: v for k, v in m.items() if isinstance(v, (int, float))})
        self.last_step = step
        self._add(step, {**_values(m), **self.counters})

    def checkpointed(self, step: int, m: dict[str, float]) -> None:
        """A checkpoint at `step` is saved: say so and log its size and timings at that step."""
        print(f"[tidal] checkpoint at step {step}: {m['checkpoint_bytes'] / 2**20:.1f} MiB on rank 0, "
              f"written in {m['checkpoint_save_s']:.2f}s, training blocked {m['checkpoint_blocked_s']:.2f}s", flush=True)
        self.latest.update(m)
        if self.last_checkpoint_step is None:
            self.last_checkpoint_step = self._known_sent("checkpoint_step", "checkpoint_bytes")
        if step > self.last_checkpoint_step:  # a checkpoint saved again after a restart is logged once
            self.last_checkpoint_step = step
            self._add(step, _values(m))

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
            line += f"; checkpoint written at world size {old_world} resharded for {world}"
        self.say(line)

    def _note_world_size(self, step: int, world: int) -> None:
        """Count every change of world size, whether or not a checkpoint was there to resume from."""
        if world and self.world_size and world != self.world_size:
            self.counters["resizes"] += 1
            why = "after a failure" if self.failed_since_resume else "capacity changed"
            self.say(f"resized: world size {self.world_size} -> {world} ({why}), training again at step {step}")
        if world and world != self.world_size:
            self.failed_since_resume = False
        self.world_size = world or self.world_size

    def flush(self, force: bool = False) -> int:
        """Send buffered points unless MLflow failed less than `retry_s` ago (`force` tries now);
        returns the points left unsent."""
        with self.sending:
            return self._flush(force)

    def _flush(self, force: bool) -> int:
        with self.lock:
            todo = list(self.pending)
        if not todo or (not force and time.time() < self.retry_at):
            return len(todo)
        sent = 0
        try:
            self._ensure_run()
            todo = self._skip_recovered_already_sent(todo)
            while sent < len(todo):
                chunk = _batch(todo[sent:])
                _send(self.spec, self.run_id, chunk)
                sent += len(chunk)
        except Exception as e:  # noqa: BLE001 - any tracking failure must leave training running
            self.retry_at = time.time() + self.retry_s
            if self.down_since is None:
                self.down_since = time.time()
                print(f"[tidal] WARNING: MLflow at {self.spec.tracking.uri} is unreachable ({type(e).__name__}); "
                      f"training continues and metrics wait in {self.buffer.path} until it is back", flush=True)
        finally:
            with self.lock:
                del self.pending[:sent]  # sent: never sent twice (log() only appends behind them)
                left = len(self.pending)
            # The mark goes first: entries forgotten without it would be replayed after a restart.
            if sent and self._mark_sent(todo[:sent]):
                self.buffer.forget(todo[:sent])
        if self.down_since is not None and sent == len(todo):
            print(f"[tidal] MLflow is reachable again after {time.time() - self.down_since:.0f}s: "
                  f"sent {sent} buffered point(s)", flush=True)
            self.down_since = None
        return left

    def close(self) -> tuple[str | None, dict[str, float], int]:
        """(MLflow run id, last values seen, points still unsent) after one more try to send."""
        self.stopped.set()
        self.pending_added.set()
        self.sender.join()
        if self.monitor is not None:
            # MLflow publishes a sample only after a full interval; keep a short run's samples too.
            with contextlib.suppress(Exception):
                self.monitor.publish_metrics(self.monitor.aggregate_metrics())
            self.monitor.finish()
        left = self.flush(force=True)
        return self.run_id, dict(self.latest), left

    # --- helpers ------------------------------------------------------------------------
    def _send_loop(self) -> None:
        while not self.stopped.is_set():
            self.pending_added.wait(timeout=self.retry_s)  # new points, or time to retry an outage
            self.pending_added.clear()
            if not self.stopped.is_set():
                try:
                    self.flush()
                except Exception as e:  # noqa: BLE001 - a storage hiccup must not end the sender
                    log.warning("metrics buffer: %s; retrying", e)

    def _mark_sent(self, entries: list[dict[str, Any]]) -> bool:
        """Record how far MLflow now holds this run; False if storage refused (entries stay buffered,
        and a later driver dedupes them against MLflow)."""
        mark = {"run_id": self.run_id, "step": self.sent.get("step", 0),
                "checkpoint_step": self.sent.get("checkpoint_step", 0)}
        for e in entries:
            kind = "checkpoint_step" if "checkpoint_bytes" in e["values"] else "step"
            mark[kind] = max(mark[kind], int(e["step"]))
        try:
            self.run_dir.write_json(SENT_FILE, mark)
        except OSError as e:
            log.warning("could not record sent metrics in %s: %s", self.run_dir.path, e)
            return False
        self.sent = mark
        return True

    def _ensure_run(self) -> None:
        """Create the MLflow run now if MLflow was unreachable when the job started."""
        if self.run_id is None:
            self.run_id = start_run(self.spec, None, self.tags)
            self.run_dir.write_json(JOB_FILE, {**(self.run_dir.read_json(JOB_FILE) or {}), "mlflow_run_id": self.run_id})
            print(f"[tidal] MLflow run {self.run_id} created", flush=True)
            if self.record is not None:  # a submitted job: tell the submitter which run it is now
                print_record({**self.record, "mlflow_run_id": self.run_id})

    def _start_system_metrics(self) -> Any:
        """MLflow's system metrics (CPU, memory, GPU, disk, network) of the driver's node."""
        if self.run_id is None:
            return None
        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            monitor = SystemMetricsMonitor(self.run_id, sampling_interval=10, resume_logging=True,
                                           node_id="driver", tracking_uri=self.spec.tracking.uri)
            monitor.start()
            return monitor
        except Exception as e:  # noqa: BLE001 - optional telemetry; say why it is missing
            log.warning("MLflow system metrics are off: %s", e)
            return None

    def _already_logged(self, step: int) -> bool:
        if self.last_step is None:
            self.last_step = self._known_sent("step", "loss")
            with self.lock:
                self.last_step = max([self.last_step, *(e["step"] for e in self.pending)])
        return step <= self.last_step

    def _known_sent(self, kind: str, key: str) -> int:
        """The highest step of this kind MLflow holds: from the mark, else (a run from before
        marks existed) from MLflow itself."""
        if kind in self.sent:
            return int(self.sent[kind])
        return _max_logged_step(self.spec, self.run_id, key) if self.run_id else 0

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

    def _add(self, step: int, values: dict[str, float]) -> None:
        entry = {"step": step, "values": values, "ts": int(time.time() * 1000)}
        with self.lock:  # appended in step order, behind anything the sender is sending
            self.pending.append(self.buffer.append(entry))
        self.pending_added.set()

    def _skip_recovered_already_sent(self, todo: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Entries an earlier driver sent but died before forgetting: MLflow has their step already.

        A batch reaches MLflow whole or not at all, so checking each entry's first metric is enough.
        """
        if not self.recovered:
            return todo
        c, logged = client(self.spec), {}
        done = []
        for e in self.recovered:
            kind = "checkpoint_step" if "checkpoint_bytes" in e["values"] else "step"
            if e["step"] <= self.sent.get(kind, 0):  # sent and marked, then the driver died
                done.append(e)
                continue
            key = next(iter(e["values"]), None)
            if key is not None and key not in logged:
                logged[key] = {m.step for m in c.get_metric_history(self.run_id, key)}
            if key is None or e["step"] in logged[key]:
                done.append(e)
        self.recovered = []
        if not done:
            return todo
        ids = {e["id"] for e in done}
        with self.lock:
            self.pending = [e for e in self.pending if e["id"] not in ids]
        self.buffer.forget(done)
        return [e for e in todo if e["id"] not in ids]


def _batch(entries: list[dict[str, Any]], limit: int = 1000) -> list[dict[str, Any]]:
    """The longest prefix of whole steps within MLflow's 1000-metrics-per-batch limit."""
    n = total = 0
    for e in entries:
        total += len(e["values"])
        if total > limit and n:
            break
        n += 1
    return entries[:n]


def _send(spec: JobSpec, run_id: str, entries: Iterable[dict[str, Any]]) -> None:
    metrics = [Metric(k, v, e["ts"], e["step"]) for e in entries for k, v in e["values"].items()]
    client(spec).log_batch(run_id, metrics=metrics, synchronous=True)


def _values(m: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in m.items() if k not in NOT_METRICS and isinstance(v, (int, float))}


def _max_logged_step(spec: JobSpec, run_id: str, key: str = "loss") -> int:
    try:
        return max((m.step for m in client(spec).get_metric_history(run_id, key)), default=0)
    except Exception:  # noqa: BLE001 - unreachable: nothing known to be logged yet
        return 0


def _hms(seconds: float) -> str:
    if seconds != seconds:  # NaN: no estimate yet
        return "--:--"
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
