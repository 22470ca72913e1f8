"""A `train.step_fn` for the hang tests: tests/slow_step.py's step (TIDAL_TEST_STEP_S per
micro-batch), and, once, a rank that stops taking part: when the file TIDAL_TEST_HANG_FILE exists,
rank TIDAL_TEST_HANG_RANK removes it and sleeps in its step for TIDAL_TEST_HANG_S (600 s). Its
process lives and answers; its peers wait for it inside the step's collectives. One-shot, so the
group Ray restarts after the hang trains on."""

from __future__ import annotations

import os
import time
from typing import Any

from tests import slow_step

HANG_FILE, HANG_RANK = "TIDAL_TEST_HANG_FILE", "TIDAL_TEST_HANG_RANK"


def step(model: Any, batch: Any) -> Any:
    import torch.distributed as dist

    hang = os.environ.get(HANG_FILE)
    if hang and dist.get_rank() == int(os.environ.get(HANG_RANK, "1")) and os.path.exists(hang):
        os.remove(hang)
        time.sleep(float(os.environ.get("TIDAL_TEST_HANG_S", "600")))  # the peers wait in a collective meanwhile
    return slow_step.step(model, batch)
