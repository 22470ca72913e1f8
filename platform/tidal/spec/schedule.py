"""The learning-rate schedules DeepSpeed lacks, as a pure multiplier of train.lr per optimizer step.

cosine and constant are DeepSpeed's own (WarmupCosineLR, WarmupLR: spec/deepspeed.py). DeepSpeed's
linear one (WarmupDecayLR) warms up from and decays to the same floor, and it has no WSD, so the
engine runs these two as a torch LambdaLR over `lr_factor`; DeepSpeed saves and restores its
state (the step count) with every checkpoint, so resume stays exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidal.spec.sections import TrainSpec

DEEPSPEED_SCHEDULES = ("cosine", "constant")


def lr_factor(train: TrainSpec, done: int) -> float:
    """Multiplier of train.lr for the optimizer step after `done` steps (0 for the first step).

    Warmup rises linearly to 1 at its last step; linear decays from there to train.min_lr_ratio
    at the job's last step; wsd stays at 1 until its last train.decay_fraction of steps, then
    decays linearly to the same floor.
    """
    warmup, last = train.warmup_plan()[0], train.steps - 1
    if done < warmup:
        return (done + 1) / warmup
    if train.schedule == "linear":
        start = warmup
    elif train.schedule == "wsd":
        start = max(warmup, train.steps - round(train.decay_fraction * train.steps))
    else:
        raise ValueError(f"train.schedule {train.schedule!r} is DeepSpeed's own; see spec/deepspeed.py")
    if done < start:
        return 1.0
    progress = min(1.0, (done - start) / max(1, last - start))
    return 1.0 - (1.0 - train.min_lr_ratio) * progress
