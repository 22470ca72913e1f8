"""A `train.step_fn` for tests: jobs/mlp_classifier.py's step, plus two test hooks driven by `env:`.

- TIDAL_TEST_PROBE=PATH: first writes what the DeepSpeed engine it is given holds in its config
  (PATH.rankN), so a test reads back what reached the engine.
- TIDAL_TEST_DIE_AT=N: the rank-1 worker SIGKILLs itself at its N-th micro-batch, once per job
  (a marker beside the probe file), the way a lost worker dies: no clean-up, no exception.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from jobs.mlp_classifier import step as classifier_step

calls = 0


def step(model: Any, batch: Any) -> torch.Tensor:
    global calls
    calls += 1
    base, rank = os.environ["TIDAL_TEST_PROBE"], dist.get_rank()
    probe = Path(f"{base}.rank{rank}")
    if not probe.exists():
        probe.write_text(json.dumps({
            "reduce_bucket_size": model.zero_reduce_bucket_size(),
            "steps_per_print": model.steps_per_print(),
            "zero_stage": model.zero_optimization_stage(),
            "optimizer": type(model.basic_optimizer).__name__,
            "lr_scheduler": type(model.lr_scheduler).__name__,
        }))
    die_at, died = os.environ.get("TIDAL_TEST_DIE_AT"), Path(f"{base}.died")
    if die_at and rank == 1 and calls == int(die_at) and not died.exists():
        died.write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    return classifier_step(model, batch)
