"""`tidal runs`: Tidal's runs in MLflow as tables a person can read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

from tidal.errors import TidalError

COLUMNS = ("job", "status", "steps", "final loss", "tokens/s", "MFU", "world", "GPU-hours", "run id")


def _client(uri: str) -> MlflowClient:
    """Refuses a SQLite path that does not exist, which MLflow would silently create empty."""
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).exists():
        raise TidalError(f"no MLflow store at {uri}: pass --uri (e.g. sqlite:///path/to/mlflow.db or http://host:5000)")
    return MlflowClient(uri)


def list_runs(uri: str, experiment: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
    """Tidal runs, newest first, across all experiments unless one is named."""
    c = _client(uri)
    exps = [c.get_experiment_by_name(experiment)] if experiment else c.search_experiments()
    ids = [e.experiment_id for e in exps if e is not None]
    if not ids:
        return []
    runs = c.search_runs(ids, filter_string="tags.`tidal.job` != ''", order_by=["attributes.start_time DESC"], max_results=limit)
    return [_row(r) for r in runs]


def _row(run: Any) -> dict[str, Any]:
    m, p, info = run.data.metrics, run.data.params, run.info
    hours = ((info.end_time or info.start_time) - info.start_time) / 3.6e6 if info.start_time else 0.0
    gpus = float(p.get("scaling.gpus_per_worker", 0)) * m.get("world_size", 0)
    return {
        "job": run.data.tags.get("tidal.job", "?"), "status": info.status,
        "steps": f"{_last_step(run)}/{p.get('train.steps', '?')}",
        "final loss": _num(m.get("loss"), "{:.4f}"), "tokens/s": _num(m.get("tokens_per_s"), "{:,.0f}"),
        "MFU": _num(m.get("mfu"), "{:.1%}"), "world": _num(m.get("world_size"), "{:.0f}"),
        "GPU-hours": f"{hours * gpus:.2f}", "run id": info.run_id,
    }


def _last_step(run: Any) -> int:
    """Steps done, from the tokens seen (step itself is the metrics' x-axis, not a metric)."""
    tokens = run.data.metrics.get("tokens_seen")
    per_step = float(run.data.params.get("train.global_batch", 0)) * float(run.data.params.get("model.seq_len", 0))
    return int(tokens / per_step) if tokens and per_step else 0


def compare(uri: str, run_ids: list[str]) -> tuple[list[str], list[list[str]]]:
    """(header, rows): the params that differ between the runs, then their final metrics."""
    c = _client(uri)
    runs = [c.get_run(r) for r in run_ids]
    header = ["", *[r.data.tags.get("tidal.job", r.info.run_id[:8]) + f" ({r.info.run_id[:8]})" for r in runs]]
    keys = sorted({k for r in runs for k in r.data.params})
    rows = [[k, *[r.data.params.get(k, "-") for r in runs]] for k in keys
            if len({r.data.params.get(k) for r in runs}) > 1]
    for label, key in (("final loss", "loss"), ("tokens/s", "tokens_per_s"), ("MFU", "mfu"), ("world size", "world_size"),
                       ("restarts", "restarts"), ("steps lost", "steps_lost")):
        rows.append([label, *[_fmt(r.data.metrics.get(key)) for r in runs]])
    return header, rows


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.4g}"
    return str(v)


def table(header: list[str], rows: list[list[Any]]) -> str:
    cells = [[_fmt(c) for c in row] for row in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)
