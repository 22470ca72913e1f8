"""Decisions about evaluation results: improvement, the best checkpoint, early stopping. No torch, no Ray.

Each checkpoint's `tidal-state.json` (TrainState) holds an `evaluation` record written by the
evaluation at that checkpoint's step (one runs at every checkpoint of a job with an eval section):

    {"step": 40, "metrics": {"eval_loss": 2.1, "eval_perplexity": 8.2},
     "best": 2.05, "best_step": 30, "since_best": 1, "stopped_early": false}

So which checkpoint is best is read from the checkpoints themselves (`best_checkpoint`), whether
or not Ray's controller registered them, and survives any driver.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from tidal.spec.job import JobSpec
from tidal.storage import Found, RunDir, check_complete

T = TypeVar("T")


def improved(value: float, best: float | None, min_delta: float = 0.0) -> bool:
    """Whether an eval_loss beats the best so far by more than `min_delta` (lower is better)."""
    return best is None or value < best - min_delta


def score(state: dict[str, Any], metric: str) -> float | None:
    """The checkpoint's own value of `metric`: from the evaluation at its step, else None."""
    ev = state.get("evaluation") or {}
    if ev.get("step") != state.get("step"):
        return None
    value = (ev.get("metrics") or {}).get(metric)
    return None if value is None or value != value else float(value)  # NaN ranks nowhere


def best_checkpoint(run_dir: RunDir, metric: str = "eval_loss", mode: str = "min") -> Found | None:
    """The complete checkpoint of the run with the best `metric` (the newest on a tie), or None
    when no checkpoint carries it. What `--checkpoint best` means."""
    found = []
    for path in run_dir.checkpoints():
        problem, state = check_complete(run_dir.fs, path)
        if problem is None:
            found.append(Found(path, run_dir.fs, state))
    return pick_best(found, lambda f: f.state, metric, mode)


def pick_best(items: list[T], state_of: Callable[[T], dict[str, Any]], metric: str, mode: str) -> T | None:
    """The item whose checkpoint state scores best by `metric` (`mode` min or max; the newest step
    on a tie), or None when none carries it."""
    scored = [(v, int(state_of(i)["step"]), i) for i in items if (v := score(state_of(i), metric)) is not None]
    if not scored:
        return None
    return min(scored, key=lambda s: (s[0] if mode == "min" else -s[0], -s[1]))[2]


def spared(spec: JobSpec, run_dir: RunDir) -> list[str]:
    """Checkpoint folders Tidal's own retention must never delete: the best one under keep_best."""
    kb = spec.checkpoint.keep_best
    if kb is None:
        return []
    found = best_checkpoint(run_dir, kb.metric, kb.mode)
    return [found.path] if found else []


def stopped_early(spec: JobSpec, state: dict[str, Any]) -> bool:
    """Whether the checkpoint `state` ended its job by early stopping under the spec's patience
    (a spec whose patience is raised or removed trains on)."""
    ev, rec = spec.eval, state.get("evaluation") or {}
    return bool(rec.get("stopped_early")) and ev is not None and ev.patience is not None \
        and int(rec.get("since_best", 0)) >= ev.patience


def stop_reason(spec: JobSpec, state: dict[str, Any]) -> str:
    """One line: why early stopping ended the job."""
    rec, ev = state.get("evaluation") or {}, spec.eval
    assert ev is not None
    delta = f" by more than {ev.min_delta:g}" if ev.min_delta else ""
    return (f"early stopping: eval_loss has not improved{delta} for {rec.get('since_best')} evaluation(s) "
            f"(eval.patience {ev.patience}); best {rec.get('best', float('nan')):.4f} at step {rec.get('best_step')}")
