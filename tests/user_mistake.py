"""A user's mistakes, for tests/test_user_mistakes_e2e.py: a `data.dataset` that raises in the user's
own code before the first step, on every worker, and a `train.step_fn` that raises at the same sample
after TIDAL_TEST_BAD_AFTER micro-batches of each worker process (a bad sample met again after every
restart). Each failing call adds a line to the file TIDAL_TEST_PROBE names, so a test counts the attempts."""

from __future__ import annotations

import os
from typing import Any


def dataset(n: int) -> Any:
    with open(os.environ["TIDAL_TEST_PROBE"], "a") as f:
        f.write("called\n")
    return read_samples(n)


_calls = 0


def step(model: Any, batch: Any) -> Any:
    global _calls
    _calls += 1
    if _calls > int(os.environ["TIDAL_TEST_BAD_AFTER"]):
        with open(os.environ["TIDAL_TEST_PROBE"], "a") as f:
            f.write("bad sample\n")
        raise IndexError("sample 7 has no labels")
    return model(**batch) if isinstance(batch, dict) else model(*batch)


def read_samples(n: int) -> Any:
    raise ValueError(f"no samples file for n={n}")
