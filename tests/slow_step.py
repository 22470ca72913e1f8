"""A `train.step_fn` for tests that need a job to last: the model's own loss, after sleeping
TIDAL_TEST_STEP_S seconds per micro-batch (set through the spec's worker_env). The sleep changes
no number: losses equal those of the same job without it."""

from __future__ import annotations

import os
import time
from typing import Any

import torch


def step(model: Any, batch: Any) -> torch.Tensor:
    time.sleep(float(os.environ.get("TIDAL_TEST_STEP_S", "0")))
    return model(**batch) if isinstance(batch, dict) else model(*batch)
