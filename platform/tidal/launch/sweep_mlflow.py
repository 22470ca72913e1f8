"""The MLflow parent run of a sweep: opened (or reopened on resume) with the sweep's settings, and
closed with the trial counts, the best trial's spec and a table of every trial."""

from __future__ import annotations

import io
import json
import time
from typing import Any

import mlflow
import yaml
from mlflow.entities import Metric, Param, RunStatus
from mlflow.tracking import MlflowClient

from tidal import __version__
from tidal.spec.job import JobSpec
from tidal.spec.sweep import SweepSpec


def open_parent(base: JobSpec, cfg: SweepSpec, run_id: str | None) -> str:
    """Reopen the sweep's parent run when resuming, else create it with the sweep settings as params."""
    client = MlflowClient(base.tracking.uri)
    if run_id:
        try:
            client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
            return run_id
        except mlflow.exceptions.MlflowException:
            print(f"[tidal] WARNING: the sweep's MLflow parent run {run_id} is gone; starting a new one", flush=True)
    exp = client.get_experiment_by_name(base.tracking.experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(base.tracking.experiment)
    tags = {"tidal.sweep": base.name, "tidal.sweep_role": "parent", "tidal.version": __version__}
    run_id = client.create_run(exp_id, run_name=f"{base.name}-sweep", tags=tags).info.run_id
    settings = {f"sweep.{k}": v for k, v in cfg.model_dump(exclude={"params"}).items()}
    settings |= {f"sweep.params.{k}": v for k, v in cfg.params.items()}
    client.log_batch(run_id, params=[Param(k, str(v)) for k, v in settings.items()])
    client.log_text(run_id, yaml.safe_dump(base.redacted(), sort_keys=False), "base_spec.yaml")
    return run_id


def close_parent(client: MlflowClient, base: JobSpec, cfg: SweepSpec, parent: str, trials: Any,
                  best_spec: JobSpec | None, best_metrics: dict[str, float]) -> None:
    counts = trials["status"].value_counts()
    values = {"trials": float(len(trials))}
    values |= {f"trials_{s}": float(counts.get(s, 0)) for s in ("completed", "stopped_early", "failed")}
    if best_spec is not None:
        values |= {f"best_{k}": float(v) for k, v in best_metrics.items() if k in (cfg.metric, "loss")}
        client.set_tag(parent, "tidal.best_trial", best_spec.name)
        client.log_text(parent, yaml.safe_dump(best_spec.redacted(), sort_keys=False), "best_spec.yaml")
    now = int(time.time() * 1000)
    client.log_batch(parent, metrics=[Metric(k, v, now, 0) for k, v in values.items()])
    buf = io.StringIO()
    trials.to_csv(buf, index=False)
    client.log_text(parent, buf.getvalue(), "trials.csv")
    summary = {"metric": cfg.metric, "mode": cfg.mode, "best_trial": best_spec.name if best_spec else None,
               "best_metrics": best_metrics, "trials": json.loads(trials.to_json(orient="records"))}
    client.log_dict(parent, summary, "summary.json")
    end_parent(base, parent, RunStatus.FINISHED)


def end_parent(base: JobSpec, run_id: str, status: int) -> None:
    try:
        MlflowClient(base.tracking.uri).set_terminated(run_id, RunStatus.to_string(status))
    except mlflow.exceptions.MlflowException as e:  # tracking must never turn a finished sweep into a crash
        print(f"[tidal] WARNING: could not close the sweep's MLflow run {run_id}: {e}", flush=True)
