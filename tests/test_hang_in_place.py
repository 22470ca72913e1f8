"""A silent hang replaced in place (issue 75 step 4), through Ray Train and real DeepSpeed engines on gloo
with the memory tier and failure.replace_in_place on: a rank stopped with SIGSTOP after a known step is
found by its heartbeat, named on the console with where its stacks are, and ended; the other rank keeps
its process (its pid unchanged: no full restart), the group re-forms with the stopped rank's replacement
and rolls back to the newest memory snapshot, and the job ends with the undisturbed run's losses, every
step logged once. The decision is tests/test_health_decide.py's table; the full-restart hang is
tests/test_hang.py's."""

from __future__ import annotations

import contextlib
import re
import signal
import threading

import psutil
import pytest

import tidal
from tests.memory_jobs import assert_undisturbed_losses, group_members, memory_spec
from tidal.testing.processes import kill, wait_for
from tidal.testing.runs import StepHolds

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]

STOPPED = 1


def test_a_stopped_rank_is_ended_and_replaced_in_place_while_the_other_keeps_its_process(tmp_path, capfd):
    holds = StepHolds(13)
    spec = holds.spec(memory_spec(tmp_path, "hang-in-place").with_overrides(
        {"failure.replace_in_place": True, "checkpoint.every_steps": 10, "failure.phase_timeout_s": 60}))
    assert spec.failure.heartbeat_timeout_s == 5, "the spec's default heartbeat finds the stopped rank"
    seen: dict[str, dict[int, int]] = {}
    frozen: list[psutil.Process] = []

    def stop_rank() -> None:
        holds.wait(13)
        before = seen["before"] = wait_for("the group's ranks", lambda: group_members(spec.name), 60)
        frozen.append(psutil.Process(before[STOPPED]))
        kill(frozen[0], signal.SIGSTOP)
        holds.release(13)
        seen["after"] = wait_for(f"rank {STOPPED} replaced", lambda: m if (m := group_members(spec.name)) and
                                 m[STOPPED] != before[STOPPED] else None, 300)

    stopper = threading.Thread(target=stop_rank, daemon=True)
    stopper.start()
    try:
        result = tidal.run(spec)
    finally:
        for p in frozen:  # whatever the hang's handling left: wake and end the process we froze
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGCONT)
                p.kill()
    stopper.join(timeout=5)
    out = capfd.readouterr().out

    assert result.error is None, result.error
    before, after = seen["before"], seen["after"]
    kept = 1 - STOPPED
    # the hang's line as without the switch: the stopped rank named, with its pid, and where its stacks are
    hangs = [line for line in out.splitlines() if "hang after step" in line]
    assert len(hangs) == 1, out[-3000:]
    assert re.search(rf"rank {STOPPED} on node [\d.]+ \(pid {before[STOPPED]}\) stopped answering", hangs[0]), hangs[0]
    assert "gave no heartbeat for 5s" in hangs[0] and "every rank's stacks are in the MLflow run's artifacts" in hangs[0]
    # then the in-place replacement's lines; the survivor kept its process
    assert after[kept] == before[kept], f"rank {kept}'s process changed: the whole group restarted\n{out[-3000:]}"
    assert re.search(rf"rank {STOPPED} lost after step \d+: replaced in place \(generation 2\)", out), out[-3000:]
    assert f"replacing rank(s) {STOPPED} alone (failure.replace_in_place)" in out, out[-3000:]
    assert "restarting the worker group" not in out, out[-3000:]
    assert_undisturbed_losses(tmp_path, spec, result)
