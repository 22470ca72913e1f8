"""The goodput account as people read it: the end summary's line, MLflow metrics, a table."""

from __future__ import annotations

from typing import Any

from tidal.goodput.account import BUCKETS, State

# How the end summary names each lost bucket ("lost 3.2% to start-up (3 restarts)").
LABELS = {"replayed": "replays", "queue": "queue wait", "startup": "start-up", "restore": "restores",
          "checkpoint_stall": "checkpoint stalls", "post_save_slowdown": "slower steps after saves",
          "data_wait": "data wait", "eval": "evaluation", "straggler_wait": "stragglers", "hang": "hangs",
          "resize_preemption": "resizes and preemptions", "other": "other (logging, teardown, between launches)"}
SHOWN_FROM = 0.001  # a lost bucket under 0.1% of the wall time is left out of the line


def live_metrics(state: State) -> dict[str, float]:
    """What each logged step carries to MLflow while the job runs: the goodput so far and its wall
    time (named apart from the final figures, which are logged at the last step once more);
    nothing for a log with no launch in it (written before launches were recorded)."""
    g = state.goodput
    return {} if g is None or not state.launches else {"goodput_so_far": g, "goodput_so_far_wall_s": state.wall}


def final_metrics(state: State) -> dict[str, float]:
    """Every bucket in seconds and worker-hours (and cost, where a price was known), at the job's end."""
    if state.goodput is None:
        return {}
    out = {"goodput": state.goodput, "goodput_wall_s": state.wall, "goodput_restarts": float(state.restarts),
           "goodput_replayed_steps": float(state.replayed_steps), "goodput_step_s": state.step_s}
    for b in BUCKETS:
        out[f"goodput_{b}_s"] = state.seconds[b]
        out[f"goodput_{b}_worker_hours"] = state.worker_s[b] / 3600
        if state.priced:
            out[f"goodput_{b}_cost"] = state.cost[b]
    return out


def rows(state: State) -> list[dict[str, Any]]:
    """The table artifact: one row per bucket, then the total."""
    wall = state.wall or 1.0
    out = [{"bucket": b, "seconds": round(state.seconds[b], 3), "share": round(state.seconds[b] / wall, 5),
            "worker_hours": round(state.worker_s[b] / 3600, 6),
            "cost": round(state.cost[b], 6) if state.priced else None} for b in BUCKETS]
    out.append({"bucket": "total", "seconds": round(state.wall, 3), "share": 1.0,
                "worker_hours": round(sum(state.worker_s.values()) / 3600, 6),
                "cost": round(sum(state.cost.values()), 6) if state.priced else None})
    return out


def line(state: State) -> str | None:
    """'goodput 93.1% of 1h02m: lost 3.2% to start-up (3 restarts), 1.5% to replays (40 steps), ...'."""
    g = state.goodput
    if g is None:
        return None
    wall = state.wall
    cost = f", cost {sum(state.cost.values()):.4g}" if state.priced else ""
    head = (f"goodput {100 * g:.1f}% of {_hms(wall)} ({sum(state.worker_s.values()) / 3600:.3g} worker-hours{cost})")
    lost = sorted(((state.seconds[b], b) for b in BUCKETS if b != "productive"), reverse=True)
    parts = []
    for secs, b in lost:
        if secs / wall < SHOWN_FROM:
            continue
        what = LABELS[b]
        if b == "startup" and state.restarts:
            what += f" ({state.restarts} restart{'s' if state.restarts != 1 else ''})"
        if b == "replayed" and state.replayed_steps:
            what += f" ({state.replayed_steps} steps)"
        parts.append(f"{100 * secs / wall:.1f}% to {what}")
    return head + (": lost " + ", ".join(parts) if parts else "")


def brief(metrics: dict[str, float], most: int = 3) -> str | None:
    """The SDK summary's line from a run's final metrics: '42.9% of 1m10s; lost most to start-up
    34.3%, replays 17.1%, restores 4.3%'; None for a run with no account."""
    g, wall = metrics.get("goodput"), metrics.get("goodput_wall_s")
    if g is None or not wall:
        return None
    lost = sorted(((metrics.get(f"goodput_{b}_s", 0.0), b) for b in BUCKETS if b != "productive"), reverse=True)
    top = [f"{LABELS[b].split(' (')[0]} {100 * s / wall:.1f}%" for s, b in lost[:most] if s / wall >= SHOWN_FROM]
    return f"{100 * g:.1f}% of {_hms(wall)}" + ("; lost most to " + ", ".join(top) if top else "")


def _hms(seconds: float) -> str:
    s = int(round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s % 60:02d}s" if m else f"{seconds:.1f}s"
