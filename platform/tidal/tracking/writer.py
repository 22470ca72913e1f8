"""The one writer of MLflow: every run Tidal creates, changes or ends is written here.

A job's run (`RunWriter`) belongs to the job's tracker (tracking/tracker.py) for its whole life:
it creates or reopens the run with the spec as params, sends the step metrics and the progress
tag the ledger hands it, runs MLflow's system metrics, and at the end logs the usage, the
artifacts and the end status. When the tracker actor is gone at the end, the driver builds a
tracker in its own process, which finishes the run through this same code. A sweep's parent run
(`SweepWriter`) is written by the sweep's driver, the one process that sees every trial; the
trials' runs are their own jobs' runs, tagged with the parent.

Ray 2.60 has no MLflow integration for Train V2 (MLflowLoggerCallback is Tune-only), and
`ray.train.report` is no channel for per-step metrics (each call waits for the controller's
poll), so rank 0 writes its metrics to the job's durable event log (tracking/emitter.py) and the
ledger (tracking/ledger.py) brings them here. Reads go through tracking/reader.py. The one other
place that writes is `tidal export --mlflow` (exporter/mlflow.py), which logs a model to a run
on the user's request after the job.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import Metric, Param, RunStatus, RunTag

from tidal.output import print_record
from tidal.redact import redact_data, redact_text
from tidal.spec.job import JobSpec
from tidal.storage import JOB_FILE, RunDir
from tidal.tracking.findings import run_tags
from tidal.tracking.reader import PROGRESS_TAG, client, metrics_frame
from tidal.version import __version__

log = logging.getLogger("tidal")
RUNNING = RunStatus.to_string(RunStatus.RUNNING)


class RunWriter:
    """A job's MLflow run; also the ledger's sink (tracking/ledger.py's `Sink`)."""

    def __init__(self, spec: JobSpec, tags: dict[str, str] | None = None, record: dict[str, Any] | None = None) -> None:
        self.spec, self.tags, self.record = spec, tags or {}, record
        self.monitor: Any = None
        self.reopened: str | None = None  # the run this writer has reopened or created

    # --- lifecycle ------------------------------------------------------------------------
    def start(self, run_id: str | None) -> str:
        """Reopen `run_id` if MLflow still has it, else create the job's run; the job file names it.

        Only MLflow's answer that the run does not exist makes a new run. Any other error (a 5xx,
        SQLite's "database is locked", a timeout) is raised: a new run would split the job in two
        and reset its restart and resize counts. The tracker keeps the run id and the ledger
        reopens it (`open`) when MLflow answers, its points waiting in the event log meanwhile.
        """
        c = client(self.spec)
        if run_id:
            try:
                if reopen(c, run_id, {"tidal.job": self.spec.name}, self.spec.tracking.experiment):
                    self.reopened = run_id
                    return run_id
            except mlflow.exceptions.MlflowException as e:
                log.warning("could not reopen MLflow run %s of this job (%s); the job keeps it, and it is "
                            "retried while the points wait", run_id, redact_text(_short(e)))
                raise
            log.warning("MLflow run %s named by this job is gone or not its own; starting a new one", run_id)
        exp_id = _experiment(c, self.spec.tracking.experiment, _artifact_root(self.spec.tracking.uri))
        # Tags and params are read by everyone who can read the experiment: redacted (tidal/redact.py).
        tags = redact_data({"tidal.job": self.spec.name, "tidal.version": __version__, **self.tags})
        run = c.create_run(exp_id, run_name=self.spec.name, tags=tags)
        params = [Param(k, str(v)) for k, v in self.spec.flat().items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            c.log_batch(run.info.run_id, params=params[i : i + 100])
        run_dir = RunDir(self.spec.checkpoint.storage, self.spec.name)
        run_dir.write_json(JOB_FILE, {**(run_dir.read_json(JOB_FILE) or {}), "mlflow_run_id": run.info.run_id})
        self.reopened = run.info.run_id
        return run.info.run_id

    def open(self, run_id: str | None) -> str:
        """The ledger's call: the run to send to, created now if MLflow was down when the job began
        (and, for a submitted job, announced to the submitter)."""
        if run_id is not None:
            # Reopened when the job's tracker began, unless MLflow failed then: reopen it now
            # (an error propagates, and the ledger retries after its backoff).
            return run_id if run_id == self.reopened else self.start(run_id)
        run_id = self.start(None)
        print(f"[tidal] MLflow run {run_id} created", flush=True)
        if self.record is not None:
            print_record({**self.record, "mlflow_run_id": run_id})
        return run_id

    def finish(self, run_id: str, ok: bool, summary: dict[str, Any],
               goodput: Callable[[], tuple[dict[str, float], list[dict[str, Any]]]] | None = None) -> dict[str, float]:
        """End of a launch: usage (GPU-hours, cost, scaling), artifacts, the goodput account (its
        final metrics and its table, tidal/goodput: `goodput()` ends it, after the rest, since they
        take the job's time too), end status. Each part is tried alone, and none turns a finished
        job into a failed one. Returns the usage."""
        from tidal.tracking.artifacts import write_artifacts

        used = self._log_usage(run_id)
        try:
            with tempfile.TemporaryDirectory() as tmp:
                frame = metrics_frame(self.spec.tracking.uri, run_id)
                write_artifacts(self.spec, frame, {**summary, **used}, Path(tmp))
                client(self.spec).log_artifacts(run_id, tmp)
        except Exception as e:  # noqa: BLE001 - artifacts are a convenience; the job's result stands
            print(f"[tidal] WARNING: could not store the run's artifacts in MLflow: {redact_text(str(e))}", flush=True)
        if goodput is not None:
            self._log_goodput(run_id, *goodput())
        _terminate(self.spec.tracking.uri, run_id, RunStatus.FINISHED if ok else RunStatus.FAILED)
        return used

    def log_texts(self, run_id: str, files: dict[str, str], artifact_path: str) -> None:
        """Text files into the run's artifacts under `artifact_path` (a hang's stacks, as it happens)."""
        with tempfile.TemporaryDirectory() as tmp:
            for name, text in files.items():
                (Path(tmp) / name).write_text(redact_text(text))
            client(self.spec).log_artifacts(run_id, tmp, artifact_path)

    def _log_usage(self, run_id: str) -> dict[str, float]:
        from tidal.tracking.usage import describe, run_usage

        try:
            c = client(self.spec)
            used = run_usage(self.spec, c, run_id)
            step = max((m.step for m in c.get_metric_history(run_id, "world_size")), default=0)
            # A launch that only finishes an earlier one's tracking (nothing trained) must not log
            # the same step's usage twice.
            if step not in {m.step for m in c.get_metric_history(run_id, "gpu_hours")}:
                now = int(time.time() * 1000)
                c.log_batch(run_id, metrics=[Metric(k, v, now, step) for k, v in used.items()], synchronous=True)
        except Exception as e:  # noqa: BLE001 - accounting must not turn a finished job into a failed one
            print(f"[tidal] WARNING: could not work out the run's GPU-hours and cost: {redact_text(str(e))}", flush=True)
            return {}
        print(f"[tidal] {describe(used, self.spec.scaling.gpus_per_worker)}", flush=True)
        return used

    def _log_goodput(self, run_id: str, metrics: dict[str, float], rows: list[dict[str, Any]]) -> None:
        """Every bucket as a metric at the run's last step, and the table `goodput.json`."""
        if not metrics:
            return
        try:
            c = client(self.spec)
            step = max((m.step for m in c.get_metric_history(run_id, "world_size")), default=0)
            # A launch that trained nothing (a finished job run again) has nothing new to log at that step.
            if step in {m.step for m in c.get_metric_history(run_id, "goodput")}:
                return
            now = int(time.time() * 1000)
            c.log_batch(run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()], synchronous=True)
            # The whole job's account, written over the last launch's: log_table would download the
            # old table to append to it (a progress bar on the console) and keep both launches' rows.
            columns = list(rows[0])
            c.log_dict(run_id, {"columns": columns, "data": [[r[k] for k in columns] for r in rows]}, "goodput.json")
        except Exception as e:  # noqa: BLE001 - accounting must not turn a finished job into a failed one
            print(f"[tidal] WARNING: could not store the run's goodput account in MLflow: {redact_text(str(e))}",
                  flush=True)

    # --- metrics --------------------------------------------------------------------------
    def send(self, run_id: str, entries: list[dict[str, Any]]) -> None:
        metrics = [Metric(k, v, e["ts"], e["step"]) for e in entries for k, v in e["values"].items()]
        steps = [e for e in entries if "loss" in e["values"]]
        # The job's progress as one structured tag, in the same transaction as its points:
        # `tidal status/list` and `Job.progress()` read it (launch/jobs.py), never the console.
        tags = [RunTag(PROGRESS_TAG, json.dumps(progress(steps[-1], self.spec.train.steps)))] if steps else []
        found = {k: v for e in entries for k, v in run_tags(e["values"]).items()}  # input-bound, straggler
        tags += [RunTag(k, v) for k, v in found.items()]
        client(self.spec).log_batch(run_id, metrics=metrics, tags=tags, synchronous=True)

    def logged_steps(self, run_id: str, key: str) -> set[int]:
        return {m.step for m in client(self.spec).get_metric_history(run_id, key)}

    def start_system_metrics(self, run_id: str | None) -> None:
        """MLflow's system metrics (CPU, memory, GPU, disk, network) of the tracker's node."""
        if run_id is None:
            return
        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self.monitor = SystemMetricsMonitor(run_id, sampling_interval=10, resume_logging=True,
                                                node_id="driver", tracking_uri=self.spec.tracking.uri)
            self.monitor.start()
        except Exception as e:  # noqa: BLE001 - optional telemetry; say why it is missing
            log.warning("MLflow system metrics are off: %s", redact_text(str(e)))
            self.monitor = None

    def stop_system_metrics(self) -> None:
        if self.monitor is None:
            return
        # MLflow publishes a sample only after a full interval; keep a short run's samples too.
        with contextlib.suppress(Exception):
            self.monitor.publish_metrics(self.monitor.aggregate_metrics())
        self.monitor.finish()
        self.monitor = None


def progress(entry: dict[str, Any], steps: int) -> dict[str, Any]:
    """What `tidal status/list` show of a job: its latest step's numbers (jobs.PROGRESS_FIELDS)."""
    v = entry["values"]
    return {"step": int(entry["step"]), "steps": steps, "loss": v.get("loss"), "tokens_per_s": v.get("tokens_per_s"),
            "world_size": int(v["world_size"]) if "world_size" in v else None}


class SweepWriter:
    """A sweep's parent run: opened (or reopened on resume) with the sweep's settings, closed with
    the trial counts, the best trial's spec and a table of every trial."""

    def __init__(self, base: JobSpec) -> None:
        self.base = base
        self.client = client(base)

    def open(self, settings: dict[str, Any], run_id: str | None) -> str:
        if run_id:
            # A transient error is raised: a second parent run would split the sweep.
            if reopen(self.client, run_id, {"tidal.sweep": self.base.name, "tidal.sweep_role": "parent"},
                      self.base.tracking.experiment):
                return run_id
            print(f"[tidal] WARNING: the sweep's MLflow parent run {run_id} is gone; starting a new one", flush=True)
        exp_id = _experiment(self.client, self.base.tracking.experiment, _artifact_root(self.base.tracking.uri))
        tags = {"tidal.sweep": self.base.name, "tidal.sweep_role": "parent", "tidal.version": __version__}
        run_id = self.client.create_run(exp_id, run_name=f"{self.base.name}-sweep", tags=tags).info.run_id
        self.client.log_batch(run_id, params=[Param(k, str(v)) for k, v in redact_data(settings).items()])
        self.client.log_text(run_id, _yaml(self.base), "base_spec.yaml")
        return run_id

    def close_trials(self, trials: Any, children: dict[str, Any]) -> None:
        """Tune ends a stopped trial by killing its actor, so its run never closed itself: close it here."""
        for _, row in trials.iterrows():
            child = children.get(str(row["trial"]))
            if child is None:
                continue
            self.client.set_tag(child.info.run_id, "tidal.sweep_status", row["status"])
            if row["status"] == "stopped_early" and child.info.status == "RUNNING":
                self.client.set_terminated(child.info.run_id, RunStatus.to_string(RunStatus.KILLED))

    def close(self, parent: str, trials: Any, values: dict[str, float], best_spec: JobSpec | None,
              summary: dict[str, Any]) -> None:
        if best_spec is not None:
            self.client.set_tag(parent, "tidal.best_trial", best_spec.name)
            self.client.log_text(parent, _yaml(best_spec), "best_spec.yaml")
        now = int(time.time() * 1000)
        self.client.log_batch(parent, metrics=[Metric(k, v, now, 0) for k, v in values.items()])
        buf = io.StringIO()
        trials.to_csv(buf, index=False)
        self.client.log_text(parent, buf.getvalue(), "trials.csv")
        self.client.log_dict(parent, redact_data(summary), "summary.json")
        self.end(parent, RunStatus.FINISHED)

    def end(self, run_id: str, status: int) -> None:
        _terminate(self.base.tracking.uri, run_id, status)


def reopen(c: Any, run_id: str, tags: dict[str, str], experiment: str) -> bool:
    """Mark `run_id` running again; False if MLflow says it is gone (missing or deleted), or if it
    is not this job's: its `tags` or its experiment differ. The id comes from the job's storage
    (tidal-job.json, the sweep's state), which anyone who can write there can change: a planted id
    would have this job write into another team's run. Any other MlflowException (a 5xx, a
    locked SQLite database) is raised: it may pass."""
    try:
        run = c.get_run(run_id)
        if run.info.lifecycle_stage == "deleted":  # in MLflow's trash
            return False
        theirs = {k: run.data.tags.get(k) for k in tags}
        exp = c.get_experiment(run.info.experiment_id)
        if theirs != tags or exp is None or exp.name != experiment:
            print(f"[tidal] WARNING: MLflow run {run_id}, named in this job's storage, is not this job's "
                  f"(its tags {theirs}, experiment {exp.name if exp else '?'!r}; this job's {tags}, "
                  f"{experiment!r}): it is left alone and a new run is started", flush=True)
            return False
        c.update_run(run_id, status=RUNNING)
        return True
    except mlflow.exceptions.MlflowException as e:
        if run_is_gone(e):
            return False
        raise


def run_is_gone(e: mlflow.exceptions.MlflowException) -> bool:
    """Whether MLflow said the run does not exist. MLflow 3.17 says so with the error code
    RESOURCE_DOES_NOT_EXIST from both stores: the SQL store raises it itself, and a tracking
    server's 404 body carries it (rest_utils rebuilds the exception from it). Everything else,
    INTERNAL_ERROR for a 5xx or a locked database included, may pass."""
    return e.error_code == "RESOURCE_DOES_NOT_EXIST"


def _short(e: Exception) -> str:
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__


def _experiment(c: Any, name: str, artifact_root: str | None) -> str:
    exp = c.get_experiment_by_name(name)
    return exp.experiment_id if exp else c.create_experiment(name, artifact_root)


def _artifact_root(uri: str) -> str | None:
    """Beside a SQLite store, not in whatever directory the creating process ran in (./mlruns)."""
    if uri.startswith("sqlite:///"):
        return str(Path(uri[len("sqlite:///"):]).parent / "mlartifacts")
    return None  # a server decides


def _terminate(uri: str, run_id: str, status: int) -> None:
    try:
        mlflow.tracking.MlflowClient(uri).set_terminated(run_id, RunStatus.to_string(status))
    except Exception as e:  # noqa: BLE001 - tracking must never turn a finished job into a crash
        print(f"[tidal] WARNING: could not mark MLflow run {run_id} as {RunStatus.to_string(status)}: "
              f"{redact_text(str(e))}", flush=True)


def _yaml(spec: JobSpec) -> str:
    import yaml

    return yaml.safe_dump(spec.redacted(), sort_keys=False)
