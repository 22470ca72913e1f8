"""`tidal runs`: Tidal's runs in MLflow as tables a person can read, or as JSON records."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidal.errors import TidalError

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

COLUMNS = ("job", "status", "steps", "final loss", "tokens/s", "MFU", "world", "GPU-hours", "cloud", "cost", "goodput",
           "run id")
TEAM_COLUMNS = ("team", "runs", "wall hours", "worker-hours", "goodput")
# `tidal runs --output json`: one object per run, numbers unformatted; times in ms since the epoch.
RECORD_FIELDS = ("run_id", "job", "experiment_id", "status", "step", "steps", "loss", "tokens_per_s", "mfu",
                 "world_size", "gpu_hours", "gpu_hours_cloud", "cost", "scaling_efficiency", "start_time", "end_time",
                 "team", "goodput", "goodput_wall_s", "goodput_worker_hours")


def _client(uri: str) -> MlflowClient:
    """Refuses a SQLite path that does not exist, which MLflow would silently create empty."""
    from mlflow.tracking import (
        MlflowClient,  # here: `tidal --help` reads RECORD_FIELDS without loading mlflow
    )

    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).exists():
        raise TidalError(f"no MLflow store at {uri}: pass --uri (e.g. sqlite:///path/to/mlflow.db or http://host:5000)")
    return MlflowClient(uri)


def list_runs(uri: str, experiment: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
    """Tidal runs, newest first, across all experiments unless one is named: table cells."""
    return [_row(r) for r in _search(uri, experiment, limit)]


def run_records(uri: str, experiment: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
    """The runs `list_runs` finds, with the RECORD_FIELDS as numbers (None where a run has no value)."""
    return [_record(r) for r in _search(uri, experiment, limit)]


def _search(uri: str, experiment: str | None, limit: int) -> list[Any]:
    c = _client(uri)
    exps = [c.get_experiment_by_name(experiment)] if experiment else c.search_experiments()
    ids = [e.experiment_id for e in exps if e is not None]
    if not ids:
        return []
    return c.search_runs(ids, filter_string="tags.`tidal.job` != ''", order_by=["attributes.start_time DESC"], max_results=limit)


def _row(run: Any) -> dict[str, Any]:
    m, p, info = run.data.metrics, run.data.params, run.info
    return {
        "job": run.data.tags.get("tidal.job", "?"), "status": info.status,
        "steps": f"{_last_step(run)}/{p.get('train.steps', '?')}",
        "final loss": _num(m.get("loss"), "{:.4f}"), "tokens/s": _num(m.get("tokens_per_s"), "{:,.0f}"),
        "MFU": _num(m.get("mfu"), "{:.1%}"), "world": _num(m.get("world_size"), "{:.0f}"),
        "GPU-hours": f"{_gpu_hours(run):.2f}", "cloud": _num(m.get("gpu_hours_cloud"), "{:.2f}"),
        "cost": _num(m.get("cost"), "{:,.2f}"), "goodput": _num(m.get("goodput", m.get("goodput_so_far")), "{:.1%}"),
        "run id": info.run_id,
    }


def _record(run: Any) -> dict[str, Any]:
    m, p, info = run.data.metrics, run.data.params, run.info
    steps, world = p.get("train.steps"), m.get("world_size")
    return {
        "run_id": info.run_id, "job": run.data.tags.get("tidal.job"), "experiment_id": info.experiment_id,
        "status": info.status, "step": _last_step(run), "steps": int(steps) if steps else None,
        "loss": m.get("loss"), "tokens_per_s": m.get("tokens_per_s"), "mfu": m.get("mfu"),
        "world_size": None if world is None else int(world), "gpu_hours": _gpu_hours(run),
        "gpu_hours_cloud": m.get("gpu_hours_cloud"), "cost": m.get("cost"), "scaling_efficiency": m.get("scaling_efficiency"),
        "start_time": info.start_time, "end_time": info.end_time,
        "team": run.data.tags.get("tidal.team"), "goodput": m.get("goodput"), "goodput_wall_s": m.get("goodput_wall_s"),
        "goodput_worker_hours": sum(v for k, v in m.items() if k.startswith("goodput_") and k.endswith("_worker_hours"))
        if "goodput" in m else None,
    }


def team_rows(records: list[dict[str, Any]]) -> list[list[str]]:
    """`tidal runs --by-team`: per team (the admission's `tidal.team` tag; "-" without one), its runs
    with a goodput account, their wall hours and worker-hours, and their goodput weighted by wall time."""
    teams: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if r.get("goodput") is not None and r.get("goodput_wall_s"):
            teams.setdefault(r.get("team") or "-", []).append(r)
    out = []
    for team, runs in sorted(teams.items()):
        wall = sum(r["goodput_wall_s"] for r in runs)
        good = sum(r["goodput"] * r["goodput_wall_s"] for r in runs)
        out.append([team, str(len(runs)), f"{wall / 3600:.2f}", f"{sum(r['goodput_worker_hours'] or 0 for r in runs):.2f}",
                    f"{good / wall:.1%}"])
    return out


def _gpu_hours(run: Any) -> float:
    """From the world-size timeline, as the job logged it at its end (tracking/usage.py); for a run
    from before that, or one still running, the final world size times the wall time."""
    if "gpu_hours" in run.data.metrics:
        return run.data.metrics["gpu_hours"]
    info = run.info
    hours = ((info.end_time or info.start_time) - info.start_time) / 3.6e6 if info.start_time else 0.0
    return hours * float(run.data.params.get("scaling.gpus_per_worker", 0)) * run.data.metrics.get("world_size", 0)


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
    rows = [[k, *[r.data.params.get(k, "-") for r in runs]] for k in _differing(runs)]
    for label, key in (("final loss", "loss"), ("tokens/s", "tokens_per_s"), ("MFU", "mfu"), ("world size", "world_size"),
                       ("restarts", "restarts"), ("steps lost", "steps_lost"), ("GPU-hours", "gpu_hours"),
                       ("cost", "cost"), ("scaling efficiency", "scaling_efficiency"), ("straggler ratio", "straggler_ratio"),
                       ("comm share", "comm_frac")):
        rows.append([label, *[_fmt(r.data.metrics.get(key)) for r in runs]])
    return header, rows


def compare_record(uri: str, run_ids: list[str]) -> dict[str, Any]:
    """`tidal runs compare --output json`: `differing_params` (keys), and `runs`, one object per run
    with run_id, job, status, params (all, as MLflow stores them: strings) and metrics (final values)."""
    c = _client(uri)
    runs = [c.get_run(r) for r in run_ids]
    return {
        "differing_params": _differing(runs),
        "runs": [{"run_id": r.info.run_id, "job": r.data.tags.get("tidal.job"), "status": r.info.status,
                  "params": dict(r.data.params), "metrics": dict(r.data.metrics)} for r in runs],
    }


def _differing(runs: list[Any]) -> list[str]:
    keys = sorted({k for r in runs for k in r.data.params})
    return [k for k in keys if len({r.data.params.get(k) for r in runs}) > 1]


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
