"""A user's `data.dataset` with a mistake, for tests/test_user_mistakes_e2e.py: it raises in the
user's own code, before the first step, on every worker. Each call adds a line to the file
TIDAL_TEST_PROBE names, so a test counts the attempts."""

from __future__ import annotations

import os
from typing import Any


def dataset(n: int) -> Any:
    with open(os.environ["TIDAL_TEST_PROBE"], "a") as f:
        f.write("called\n")
    return read_samples(n)


def read_samples(n: int) -> Any:
    raise ValueError(f"no samples file for n={n}")
