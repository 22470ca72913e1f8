"""A pause for tests: rank 0 holds before a given step, once per job, so that a fault a test
injects lands after a known step on any machine.

Why: a test that watches MLflow for step N and then kills a worker lands its kill some steps
later, by the tracker's batching and the process scan; on a fast machine the tiny test job trains
past the next checkpoint in that time, and the test's premise (steps to replay, a snapshot newer
than the checkpoint) is gone. `TIDAL_TEST_HOLD_AFTER_STEP="<step>@<marker>"` makes rank 0 create
`<marker>` once step `<step>` is done and wait, at most `HOLD_S`, until `<marker>.release` exists
(the other ranks wait in the next step's collective). The marker is created exclusively: a later
worker group that replays the step does not hold again."""

from __future__ import annotations

import os
import time

HOLD_ENV = "TIDAL_TEST_HOLD_AFTER_STEP"
RELEASE_SUFFIX = ".release"
HOLD_S = 20.0  # well inside the step timeout's default: a test that never releases only slows the job


def before_step(rank: int, step: int) -> None:
    """Hold rank 0 before `step` when HOLD_ENV names the step before it (once per job)."""
    value = os.environ.get(HOLD_ENV)
    if rank != 0 or not value:
        return
    after, _, marker = value.partition("@")
    if step != int(after) + 1:
        return
    try:
        with open(marker, "x"):
            pass
    except FileExistsError:
        return  # held once already: a replay of this step after a restart trains on
    deadline = time.monotonic() + HOLD_S
    while not os.path.exists(marker + RELEASE_SUFFIX) and time.monotonic() < deadline:
        time.sleep(0.02)
