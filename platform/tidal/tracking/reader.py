"""Reading a job's MLflow run: its progress, its metrics as a table, how a person opens it.

Everything Tidal writes to MLflow goes through tracking/writer.py; this module only reads.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from mlflow.tracking import MlflowClient

from tidal.spec.job import JobSpec

# MLflow's HTTP client retries a dead server for minutes by default (7 tries, doubling waits).
# Tidal buffers and retries on its own schedule instead, so fail fast (user settings win).
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
PROGRESS_TAG = "tidal.progress"
log = logging.getLogger("tidal")


def client(spec: JobSpec) -> MlflowClient:
    return MlflowClient(tracking_uri=spec.tracking.uri)


def run_url(spec: JobSpec, run_id: str) -> str:
    """How a person opens this run."""
    uri = spec.tracking.uri
    if uri.startswith(("http://", "https://")):
        exp = client(spec).get_run(run_id).info.experiment_id
        return f"{uri.rstrip('/')}/#/experiments/{exp}/runs/{run_id}"
    return f"mlflow ui --backend-store-uri {uri}   (then open http://127.0.0.1:5000, run {run_id})"


def safe_run_url(spec: JobSpec, run_id: str) -> str:
    """`run_url`, or the store's address when MLflow cannot say which experiment holds the run (the
    job is done: a server that went away costs the link, not the job)."""
    try:
        return run_url(spec, run_id)
    except Exception as e:  # noqa: BLE001 - any failure to reach the store: its address is still a way in
        log.debug("no MLflow link for run %s: %s: %s", run_id, type(e).__name__, e)
        return spec.tracking.uri


def read_progress(tracking_uri: str, run_id: str) -> dict[str, Any]:
    """The progress a job's run holds (writer.progress), or {} before its first step reached MLflow."""
    tag = MlflowClient(tracking_uri).get_run(run_id).data.tags.get(PROGRESS_TAG)
    return json.loads(tag) if tag else {}


def metrics_frame(tracking_uri: str, run_id: str) -> Any:
    """Every training metric of a run as a pandas DataFrame: one row per step, one column per metric."""
    import pandas as pd

    c = MlflowClient(tracking_uri)
    rows: dict[int, dict[str, float]] = {}
    for key in c.get_run(run_id).data.metrics:
        if key.startswith("system/"):  # MLflow's system metrics count their own steps, not training steps
            continue
        for m in c.get_metric_history(run_id, key):
            rows.setdefault(m.step, {})[key] = m.value
    frame = pd.DataFrame.from_dict(rows, orient="index").sort_index()
    frame.index.name = "step"
    return frame.reset_index()
