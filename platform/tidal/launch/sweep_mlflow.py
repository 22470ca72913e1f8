"""What a sweep's MLflow parent run says: the sweep's settings when it opens, and at the end the
trial counts, the best trial's spec and metrics and a table of every trial. tracking/writer.py
(`SweepWriter`) writes it."""

from __future__ import annotations

import json
from typing import Any

from mlflow.entities import RunStatus

from tidal.spec.job import JobSpec
from tidal.spec.sweep import SweepSpec
from tidal.tracking.writer import SweepWriter


def open_parent(base: JobSpec, cfg: SweepSpec, run_id: str | None) -> str:
    """Reopen the sweep's parent run when resuming, else create it with the sweep settings as params."""
    settings = {f"sweep.{k}": v for k, v in cfg.model_dump(exclude={"params"}).items()}
    settings |= {f"sweep.params.{k}": v for k, v in cfg.params.items()}
    return SweepWriter(base).open(settings, run_id)


def close_parent(base: JobSpec, cfg: SweepSpec, parent: str, trials: Any, children: dict[str, Any],
                 best_spec: JobSpec | None, best_metrics: dict[str, float]) -> None:
    writer = SweepWriter(base)
    writer.close_trials(trials, children)
    counts = trials["status"].value_counts()
    values = {"trials": float(len(trials))}
    values |= {f"trials_{s}": float(counts.get(s, 0)) for s in ("completed", "stopped_early", "failed")}
    if best_spec is not None:
        values |= {f"best_{k}": float(v) for k, v in best_metrics.items() if k in (cfg.metric, "loss")}
    summary = {"metric": cfg.metric, "mode": cfg.mode, "best_trial": best_spec.name if best_spec else None,
               "best_metrics": best_metrics, "trials": json.loads(trials.to_json(orient="records"))}
    writer.close(parent, trials, values, best_spec, summary)


def end_parent(base: JobSpec, run_id: str) -> None:
    """The sweep was interrupted: its parent run ends as KILLED (resuming reopens it)."""
    SweepWriter(base).end(run_id, RunStatus.KILLED)
