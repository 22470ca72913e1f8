"""One MLflow run per job, kept across restarts and resizes: its lifecycle, and the sink the
tracking ledger sends points to.

Ray 2.60 has no MLflow integration for Train V2 (MLflowLoggerCallback is Tune-only), and
`ray.train.report` is no channel for per-step metrics: each call blocks until the controller
polls (every 2 s by default). So rank 0 writes its metrics to the job's durable event log
(tracking/emitter.py) and the tracker (tracking/tracker.py) sends them here through the
ledger (tracking/ledger.py). `ray.train.report` is used for checkpoints only.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import Metric, Param, RunStatus, RunTag
from mlflow.tracking import MlflowClient

from tidal import __version__
from tidal.launch.result import print_record
from tidal.spec.job import JobSpec
from tidal.storage import JOB_FILE, RunDir

log = logging.getLogger("tidal")

# MLflow's HTTP client retries a dead server for minutes by default (7 tries, doubling waits).
# Tidal buffers and retries on its own schedule instead, so fail fast (user settings win).
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
PROGRESS_TAG = "tidal.progress"


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


class MlflowSink:
    """The ledger's sink (tracking/ledger.py): the job's MLflow run.

    If MLflow was down when the job started, the run is created on the first successful
    contact, recorded in the job file and, for a submitted job, announced to the submitter.
    """

    def __init__(self, spec: JobSpec, tags: dict[str, str] | None = None, record: dict[str, Any] | None = None) -> None:
        self.spec, self.tags, self.record = spec, tags or {}, record

    def open(self, run_id: str | None) -> str:
        if run_id is not None:
            return run_id
        run_id = start_run(self.spec, None, self.tags)
        run_dir = RunDir(self.spec.checkpoint.storage, self.spec.name)
        run_dir.write_json(JOB_FILE, {**(run_dir.read_json(JOB_FILE) or {}), "mlflow_run_id": run_id})
        print(f"[tidal] MLflow run {run_id} created", flush=True)
        if self.record is not None:  # a submitted job: tell the submitter which run it is now
            print_record({**self.record, "mlflow_run_id": run_id})
        return run_id

    def send(self, run_id: str, entries: list[dict[str, Any]]) -> None:
        metrics = [Metric(k, v, e["ts"], e["step"]) for e in entries for k, v in e["values"].items()]
        steps = [e for e in entries if "loss" in e["values"]]
        # The job's progress as one structured tag, in the same transaction as its points:
        # `tidal status/list` and `Job.progress()` read it (launch/jobs.py), never the console.
        tags = [RunTag(PROGRESS_TAG, json.dumps(progress(steps[-1], self.spec.train.steps)))] if steps else []
        client(self.spec).log_batch(run_id, metrics=metrics, tags=tags, synchronous=True)

    def logged_steps(self, run_id: str, key: str) -> set[int]:
        return {m.step for m in client(self.spec).get_metric_history(run_id, key)}


def progress(entry: dict[str, Any], steps: int) -> dict[str, Any]:
    """What `tidal status/list` show of a job: its latest step's numbers (jobs.PROGRESS_FIELDS)."""
    v = entry["values"]
    return {"step": int(entry["step"]), "steps": steps, "loss": v.get("loss"), "tokens_per_s": v.get("tokens_per_s"),
            "world_size": int(v["world_size"]) if "world_size" in v else None}


def read_progress(tracking_uri: str, run_id: str) -> dict[str, Any]:
    """The progress a job's run holds, or {} before its first step reached MLflow."""
    tag = MlflowClient(tracking_uri).get_run(run_id).data.tags.get(PROGRESS_TAG)
    return json.loads(tag) if tag else {}
