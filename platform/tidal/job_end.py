"""When a job is done: its last step, and whether (and why) the state a checkpoint holds ends it.

One answer for the driver (a finished job run again says so without starting Ray), the workers
(which steps an attempt trains) and the sweep (how far a trial goes); no torch, no Ray.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from tidal.eval_best import stopped_early
from tidal.spec.job import JobSpec
from tidal.spec.sections import TrainSpec

EndReason = Literal["data", "early_stop", "stop_at", "steps"]


def last_step(train: TrainSpec) -> int:
    """The step a job trains to: `train.steps`, or `train.stop_at` where that comes first."""
    return min(train.steps, train.stop_at or train.steps)


def end_reason(spec: JobSpec, state: Mapping[str, Any]) -> EndReason | None:
    """None while `state` (a checkpoint's TrainState, as a dict) leaves steps to train; else why not:
    its data stream ran out, early stopping ended it (under the spec's patience), it reached
    `train.stop_at` before `train.steps`, or it reached `train.steps`."""
    if state.get("data_ended"):
        return "data"
    if stopped_early(spec, dict(state)):
        return "early_stop"
    step, t = int(state.get("step", 0)), spec.train
    if t.stop_at and t.stop_at <= step < t.steps:
        return "stop_at"
    return "steps" if step >= t.steps else None


def is_done(spec: JobSpec, state: Mapping[str, Any]) -> bool:
    return end_reason(spec, state) is not None
