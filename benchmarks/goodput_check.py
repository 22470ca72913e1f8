"""The platform's goodput account (tidal/goodput, read from the job's MLflow run) beside a benchmark's
own external accounting: the chaos benchmarks report both, for every job they run, and whether they
agree (the account's buckets sum to the benchmark's wall time within 1% of it; its effective time,
the step time of first executions over its wall time, within 1 point of the benchmark's).

Both read the job's own `step_time_s` and the buckets sum to the wall by construction, so this checks
the account's arithmetic and its ends, not where each second went: that is held against the harness's
own clock, bucket by bucket, by tidal/testing/timeline.py (`markdown_rows`, beside these rows)."""

from __future__ import annotations

import math
import statistics
from typing import Any

from tidal.goodput.account import BUCKETS

AGREE_FRAC = 0.01  # of the wall time, and 1 point of effective time


def ledger(uri: str, run_id: str) -> dict[str, float]:
    """The run's final `goodput*` metrics: its account, as the job's tracker logged it at the end."""
    from mlflow.tracking import MlflowClient

    metrics = MlflowClient(uri).get_run(run_id).data.metrics
    return {k: v for k, v in metrics.items() if k.startswith("goodput")}


def agreement(g: dict[str, float], useful_s: float, wall_s: float) -> dict[str, Any]:
    """How the account compares with the benchmark's `useful_s` (its sum of MLflow's step times) over
    `wall_s` (its own clock, from the first launch to the job's end)."""
    if not g or not wall_s:
        return {"ok": False, "why": "no goodput account in the run"}
    total = math.fsum(g.get(f"goodput_{b}_s", 0.0) for b in BUCKETS)
    ours, theirs = g["goodput_step_s"] / g["goodput_wall_s"], useful_s / wall_s
    out = {"sum_s": total, "wall_s": g["goodput_wall_s"], "bench_wall_s": wall_s,
           "sum_off_frac": abs(total - wall_s) / wall_s, "effective": ours, "bench_effective": theirs,
           "effective_off_points": 100 * (ours - theirs), "goodput": g["goodput"]}
    out["sum_ok"], out["effective_ok"] = out["sum_off_frac"] <= AGREE_FRAC, abs(ours - theirs) <= AGREE_FRAC
    out["ok"] = out["sum_ok"] and out["effective_ok"]
    return out


def rows(name: str, g: dict[str, float], a: dict[str, Any]) -> str:
    """Markdown table rows (measure | value) for one job."""
    if "sum_s" not in a:
        return f"| {name}: the platform's goodput account | {a['why']} |\n"
    wall = a["wall_s"] or 1.0
    lost = sorted(((g.get(f"goodput_{b}_s", 0.0), b) for b in BUCKETS if b != "productive"), reverse=True)
    parts = ", ".join(f"{b} {s:.1f} s ({s / wall:.1%})" for s, b in lost if s / wall >= 0.001)
    return (f"| {name}: the platform's account, buckets summed / the benchmark's wall time | {a['sum_s']:.1f} s / "
            f"{a['bench_wall_s']:.1f} s: off by **{a['sum_off_frac']:.2%}** of it "
            f"({'within' if a['sum_ok'] else 'beyond'} 1%) |\n"
            f"| {name}: effective time, the account's (first executions' step time / its wall) / the benchmark's "
            f"| {a['effective']:.1%} / {a['bench_effective']:.1%}: **{a['effective_off_points']:+.2f} points** "
            f"({'within' if a['effective_ok'] else 'beyond'} 1 point) |\n"
            f"| {name}: goodput (productive / wall), and where the rest went | {a['goodput']:.1%}; "
            f"{g.get('goodput_restarts', 0):.0f} restart(s), {g.get('goodput_replayed_steps', 0):.0f} step(s) replayed; "
            f"{parts} |\n")


def said(a: dict[str, Any]) -> str:
    """One job's agreement in a table cell: the buckets' sum off the wall, and the effective time's gap."""
    if "sum_s" not in a:
        return a["why"]
    return f"{a['sum_off_frac']:.2%}; {a['effective_off_points']:+.2f} pt"


def fault_costs(uri: str, run_id: str) -> list[float]:
    """Per fault, the seconds the platform's account lost to it: its running figures (`goodput_so_far`,
    productive over wall, and `goodput_so_far_wall_s`, logged with each step's first execution) give the
    seconds not productive at each step; a fault's cost is their growth from the last step before it to
    the first past it (the `restarts` metric counts up there: detection, start-up, restore, the steps
    trained again), less an ordinary step's growth (the median: its logging). Two faults before any
    progress share their interval's cost equally."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)

    def hist(key: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(run_id, key)}

    so_far, wall, restarts = hist("goodput_so_far"), hist("goodput_so_far_wall_s"), hist("restarts")
    steps = sorted(set(so_far) & set(wall) & set(restarts))
    lost = {s: wall[s] * (1 - so_far[s]) for s in steps}
    grown = [(lost[b] - lost[a], int(restarts[b] - restarts[a])) for a, b in zip(steps, steps[1:], strict=False)]
    ordinary = statistics.median([d for d, n in grown if n == 0] or [0.0])
    return [round((d - ordinary) / n, 1) for d, n in grown if n > 0 for _ in range(n)]
