"""The console of `tidal run` is Tidal's on the paths past the quickstart (tests/test_tracking_console.py
covers a plain run): a resume that resizes (2 workers -> 1, a universal-checkpoint conversion) and a
worker killed mid-run. What a person reads is Tidal's `[tidal]` lines, which say what happened; no
Ray process prefix, no colour codes in a log that is not a terminal, and no DeepSpeed or Ray chatter
(TIDAL_DEBUG=1 shows it). One short job, run twice, on a local instance `tidal run` starts itself."""

from __future__ import annotations

import re
import threading

import pytest
import yaml

from tests.conftest import tiny_spec
from tests.helpers import tidal_cli
from tidal.testing.processes import kill, our_processes
from tidal.testing.runs import wait_for_step

# extended: two runs and a worker kill, minutes beyond CI's budget; the quickstart's console
# (tests/test_tracking_console.py) stays in CI
pytestmark = [pytest.mark.slow, pytest.mark.extended]

# As a user's terminal would get them: Ray's log deduplication on (its default; conftest turns it
# off for the other tests), the run's own local Ray instance.
USER_ENV = {"RAY_ADDRESS": "local", "RAY_DEDUP_LOGS": "1"}
ANSI = re.compile(r"\x1b\[[0-9;]*m")
RAY_PREFIX = re.compile(r"^\((?:\w+ )?pid=\d+|^\(raylet\)|^\(autoscaler")
# DeepSpeed's logger: "[2026-11-27 10:00:00,000] [WARNING] [file.py:123:func] ..."
DEEPSPEED_LINE = re.compile(r"\[(?:INFO|WARNING|DEBUG)\] \[[\w.]+:\d+:\w+\]")
CHATTER = ("MPU is not provided", "Extracting ZeRO fragments", "Merging slices", "*** Done!", "Resharding",
           "A worker died or was killed", "Convert DeepSpeed Checkpoint", "Graceful shutdown of backend failed",
           "Restore: ", "Traceback")
# Ray Train's coordinator answering late on a busy machine: Ray calls it harmless unless it persists,
# so Tidal keeps it as one line (no traceback); whether it shows depends on the machine's load.
LOAD_DEPENDENT = "Failed to send resource request"


def chatter_in(out: str) -> list[str]:
    """The lines of `out` a person should not have to read on a run that went as Tidal says."""
    return [line for line in out.splitlines()
            if ANSI.search(line) or DEEPSPEED_LINE.search(line) or any(c in line for c in CHATTER)
            or (RAY_PREFIX.search(line) and LOAD_DEPENDENT not in line)]


def test_a_resume_that_resizes_and_a_killed_worker_print_only_tidals_lines(tmp_path):
    spec = tiny_spec(tmp_path, name="console", **{"train.steps": 4, "checkpoint.every_steps": 4})
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    first = tidal_cli("run", str(job), cwd=tmp_path, timeout=540, env=USER_ENV)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]

    # The same job goes on at one worker (a resize: its checkpoint was written by two), and loses
    # that worker at step 8 (a restart from the checkpoint at 8, or at 4 if 8's was not registered).
    longer = {"train.steps": 14, "scaling.min_workers": 1, "scaling.max_workers": 1}
    resumed = spec.with_overrides(longer)

    def kill_at_step_8() -> None:
        wait_for_step(resumed, 8, timeout=400)
        workers = our_processes("RayTrainWorker")
        if workers:
            kill(workers[0])

    killer = threading.Thread(target=kill_at_step_8, daemon=True)
    killer.start()
    sets = [arg for k, v in longer.items() for arg in ("--set", f"{k}={v}")]
    second = tidal_cli("run", str(job), *sets, cwd=tmp_path, timeout=540, env=USER_ENV)
    killer.join(timeout=5)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-5000:]

    # Tidal says what happened, in its own lines...
    assert "checkpoint written at world size 2 resharded for 1" in second.stdout, second.stdout
    assert "[tidal] worker rank 0 failed" in second.stdout and "restart 1: restarting" in second.stdout, second.stdout
    assert "[tidal] job 'console' finished" in second.stdout
    # ...and nothing else is printed on these paths.
    noise = chatter_in(first.stdout + first.stderr) + chatter_in(out)
    assert not noise, "\n".join(noise)
