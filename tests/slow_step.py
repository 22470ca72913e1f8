"""A `train.step_fn` for tests that need a job to last: the model's own loss, after sleeping
TIDAL_TEST_STEP_S seconds per micro-batch (set through the spec's worker_env). With
TIDAL_TEST_HOLD=PATH too, it sleeps only while PATH exists: a test removes the file once the job
has lasted long enough for what it checks, and the job runs to its end at full speed. The sleep
changes no number: losses equal those of the same job without it."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # conftest imports `slow_env`: no torch at collection for it
    import torch


def step(model: Any, batch: Any) -> torch.Tensor:
    hold = os.environ.get("TIDAL_TEST_HOLD")
    if hold is None or os.path.exists(hold):
        time.sleep(float(os.environ.get("TIDAL_TEST_STEP_S", "0")))
    return model(**batch) if isinstance(batch, dict) else model(*batch)


def slow_env(step_s: float, hold: Path | None = None) -> dict[str, str]:
    """The worker_env of a job whose `train.step_fn` is this `step`: `step_s` per micro-batch, only
    while the file `hold` exists if one is given."""
    return {"TIDAL_TEST_STEP_S": str(step_s), **({"TIDAL_TEST_HOLD": str(hold)} if hold else {})}
