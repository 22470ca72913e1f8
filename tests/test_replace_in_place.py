"""failure.replace_in_place end to end (issue 75 step 2), through Ray Train and real DeepSpeed engines on
gloo with the memory tier on: a rank SIGKILLed after a known step is replaced alone, the other rank keeps
its process (its pid unchanged), the group re-forms through the driver's rendezvous and rolls back to
the newest complete memory snapshot, the job finishes with the undisturbed run's losses and every step
logged once. Rank 1 lost, then rank 0 (the rendezvous must not live there)."""

from __future__ import annotations

import threading

import psutil
import pytest

import tidal
from tests.memory_jobs import assert_undisturbed_losses, group_members, memory_spec, resumes
from tidal.testing.processes import kill, wait_for
from tidal.testing.runs import StepHolds

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]


@pytest.mark.parametrize("lost", [1, 0])
def test_a_killed_rank_is_replaced_in_place_while_the_other_keeps_its_process(tmp_path, capfd, lost):
    holds = StepHolds(13)
    # a persistent checkpoint before the kill (10) and after (20, 30, 40): the re-formed group's saves are a new
    # attempt of their own; a save that hangs ends the group after 60 s (the test then fails on the pids)
    spec = holds.spec(memory_spec(tmp_path, f"in-place-{lost}").with_overrides(
        {"failure.replace_in_place": True, "checkpoint.every_steps": 10, "failure.phase_timeout_s": 60}))
    seen: dict[str, dict[int, int]] = {}

    def kill_rank() -> None:
        holds.wait(13)
        before = seen["before"] = wait_for("the group's ranks", lambda: group_members(spec.name), 60)
        kill(psutil.Process(before[lost]))
        holds.release(13)
        seen["after"] = wait_for(f"rank {lost} replaced", lambda: m if (m := group_members(spec.name)) and
                                 m[lost] != before[lost] else None, 300)

    killer = threading.Thread(target=kill_rank, daemon=True)
    killer.start()
    result = tidal.run(spec)
    killer.join(timeout=5)
    out = capfd.readouterr().out

    assert result.error is None, result.error
    before, after = seen["before"], seen["after"]
    kept = 1 - lost
    assert after[kept] == before[kept], f"rank {kept}'s process changed: the whole group restarted\n{out[-3000:]}"
    assert after[lost] != before[lost]
    assert f"rank {lost} lost after step 13: replaced in place (generation 2)" in out, out[-3000:]
    # the controller's failure line says what Ray Train does: not "restarting the worker group"
    assert f"restart 1: replacing rank(s) {lost} alone (failure.replace_in_place)" in out, out[-3000:]
    assert "restarting the worker group" not in out, out[-3000:]
    (where, step, _), = resumes(out)
    assert where.startswith("the in-memory snapshot held on node") and 12 <= step <= 13, out[-3000:]
    # the survivor rolls back from the copy it holds mapped in its own process, no keeper asked for its shard;
    # only the replacement reads the keeper's segment
    assert f"rank {kept} from its own copy" in out, out[-3000:]
    assert f"rank {lost} from this node's keeper" in out, out[-3000:]
    assert_undisturbed_losses(tmp_path, spec, result)
    # Ray Train merges every worker's files into one checkpoint with replica groups too: storage can resume it
    last = [p.name for p in tmp_path.rglob("global_step40/*")]
    assert any(n.startswith("zero_pp_rank_1_") for n in last) and any(n.startswith("zero_pp_rank_0_") for n in last), last
