"""Test-only hooks: the faults and pauses tests and benchmarks inject into production code, named and read here alone.

Each is an environment variable with the prefix TIDAL_TEST_, set by a test (or a benchmark) in a
job's `worker_env` or its own environment; unset, production code behaves as if the hook did not
exist. None is for users: they may change or go without notice. Their values:
- HOLD_AFTER_STEP `<step>[,<step>...]@<base>`: rank 0 holds after each named step, once per job, until
  the test releases it (worker/hold.py), so a fault lands after a known step on any machine.
- CHECKPOINT_WRITE_DELAY `S`, `S@RANK`, `S:STEP`, `S@RANK:STEP`: a background checkpoint write pauses S
  seconds after a rank's data files and before its manifest (worker/checkpoint/snapshot.py), so a
  kill lands mid-write.
- MEMORY_SNAPSHOT_DELAY, the same syntax: a memory-tier snapshot pauses before it is handed to the
  keepers (worker/checkpoint/memory.py).
- MEMORY_LOAD_PAUSE `MARKER@S`: the first rank to restore from memory creates the file MARKER and
  waits S seconds before fetching (worker/checkpoint/memory.py), for a kill inside a restore.
- EVENT_WRITE_DELAY `S:STEP`: rank 0's writer of the event log pauses S seconds before each event of a step
  up to STEP (tracking/emitter.py), so the log lags behind training when a fault lands.
"""

from __future__ import annotations

import os

PREFIX = "TIDAL_TEST_"
HOLD_AFTER_STEP = "TIDAL_TEST_HOLD_AFTER_STEP"
CHECKPOINT_WRITE_DELAY = "TIDAL_TEST_CHECKPOINT_WRITE_DELAY_S"
MEMORY_SNAPSHOT_DELAY = "TIDAL_TEST_MEMORY_SNAPSHOT_DELAY_S"
MEMORY_LOAD_PAUSE = "TIDAL_TEST_MEMORY_LOAD_PAUSE"
EVENT_WRITE_DELAY = "TIDAL_TEST_EVENT_WRITE_DELAY_S"
HOOKS = (HOLD_AFTER_STEP, CHECKPOINT_WRITE_DELAY, MEMORY_SNAPSHOT_DELAY, MEMORY_LOAD_PAUSE, EVENT_WRITE_DELAY)


def read(hook: str) -> str:
    """The hook's value in this process's environment ("" when unset); KeyError for a name not a hook."""
    if hook not in HOOKS:
        raise KeyError(f"{hook} is not one of Tidal's test hooks ({', '.join(HOOKS)})")
    return os.environ.get(hook, "")
