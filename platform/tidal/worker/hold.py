"""A pause for tests: rank 0 holds before the step after each of some named steps, once per job,
so that a fault a test injects lands after a known step on any machine.

Why: a test that watches MLflow for step N and then kills a worker lands its kill some steps
later, by the tracker's batching and the process scan; on a fast machine the tiny test job trains
past the next checkpoint in that time, and the test's premise (steps to replay, a snapshot newer
than the checkpoint) is gone. `TIDAL_TEST_HOLD_AFTER_STEP="<step>[,<step>...]@<base>"` makes rank 0
create `marked(<base>, step)` (holding its pid) once that step is done and wait, at most `HOLD_S`, until
`released(<base>, step)` exists (the other ranks wait in the next step's collective). The marker is
created exclusively: a later worker group that replays the step does not hold again.
tidal.testing.runs.StepHolds is the tests' side."""

from __future__ import annotations

import os
import time

from tidal import test_hooks

HOLD_ENV = test_hooks.HOLD_AFTER_STEP
HOLD_S = 20.0  # inside the step timeout's floor (30 s): a test that never releases only slows the job


def marked(base: str, step: int) -> str:
    """The file rank 0 creates when it holds after `step`."""
    return f"{base}-{step}"


def released(base: str, step: int) -> str:
    """The file that lets rank 0 go on after `step`."""
    return f"{base}-{step}.release"


def before_step(rank: int, step: int) -> None:
    """Hold rank 0 before `step` when HOLD_ENV names the step before it (once per job)."""
    value = test_hooks.read(HOLD_ENV)
    if rank != 0 or not value:
        return
    after, _, base = value.partition("@")
    if str(step - 1) not in after.split(","):
        return
    try:
        with open(marked(base, step - 1), "x") as f:
            f.write(str(os.getpid()))  # the held rank 0's process: a test may kill it
    except FileExistsError:
        return  # held once already: a replay of this step after a restart trains on
    deadline = time.monotonic() + HOLD_S
    while not os.path.exists(released(base, step - 1)) and time.monotonic() < deadline:
        time.sleep(0.02)
