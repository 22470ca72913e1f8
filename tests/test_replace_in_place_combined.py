"""failure.replace_in_place with faults combined (issue 75: "faults combine in production"), through Ray
Train and real DeepSpeed engines on gloo with the memory tier on: a rank lost while a persistent
checkpoint is half written, while a memory snapshot is being handed over, or the replacement lost
inside its restore, or two ranks at once. Each job finishes with the undisturbed run's losses, every step logged once,
and no partial checkpoint or snapshot as its resume point; where the group re-forms in place the
survivor keeps its process, and where the path cannot hold (a loss inside the re-formed group's
restore) Ray Train's full restart takes over and the console says so."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import psutil
import pytest

import tidal
from tests.conftest import metric_history, tiny_spec
from tests.golden import THREE, reference_losses
from tests.memory_jobs import assert_undisturbed_losses, group_members, memory_spec, resumes
from tidal.storage import STATE_FILE, RunDir, check_complete, checkpoint_dir_name
from tidal.testing.processes import kill, wait_for
from tidal.testing.runs import StepHolds
from tidal.worker.checkpoint import fetch, keeper
from tidal.worker.checkpoint.memory import DELAY_ENV, LOAD_PAUSE_ENV
from tidal.worker.checkpoint.snapshot import WRITE_DELAY_ENV

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]

IN_PLACE = {"failure.replace_in_place": True, "checkpoint.every_steps": 10, "failure.phase_timeout_s": 60}
RESTART = "restarting the worker group"


def in_place_spec(tmp_path: Path, name: str, holds: StepHolds, restarts: int = 2, **env: str):
    return holds.spec(memory_spec(tmp_path, name, **env).with_overrides({**IN_PLACE, "failure.max_restarts": restarts}))


def replaced(job: str, rank: int, before: dict[int, int]) -> dict[int, int] | None:
    """The newest generation's members once `rank` is in a process other than `before`'s."""
    m = group_members(job, len(before))
    return m if m and m[rank] != before[rank] else None


def assert_exact(tmp_path: Path, spec, result, out: str) -> None:
    """What a user checks after the job: no error, the undisturbed losses, every step logged once, and
    every checkpoint left in storage complete (a partial one rewritten by the attempt that redid it)."""
    assert result.error is None, f"{result.error}\n{out[-3000:]}"
    assert_undisturbed_losses(tmp_path, spec, result)
    run = RunDir(spec.checkpoint.storage, spec.name)
    for step in (10, 20, 30, 40):
        assert check_complete(run.fs, f"{run.path}/{checkpoint_dir_name(step)}")[0] is None, step


def test_a_rank_lost_while_a_checkpoint_is_half_written_is_replaced_in_place(tmp_path, capfd):
    """Rank 1's write of checkpoint 20 pauses before its manifest; rank 1 is killed there. Checkpoint 20
    is partial: the group re-forms in place from the memory snapshot of step 18, never from 20."""
    holds = StepHolds(20)
    spec = in_place_spec(tmp_path, "in-place-mid-save", holds, **{WRITE_DELAY_ENV: "6@1:20"})
    run = RunDir(spec.checkpoint.storage, spec.name)
    seen: dict[str, object] = {}

    def kill_mid_save() -> None:
        holds.wait(20)
        half = f"{run.path}/{checkpoint_dir_name(20)}"
        wait_for("checkpoint 20's state file", (Path(half) / STATE_FILE).exists, 120, every=0.02)
        before = seen["before"] = wait_for("the group's ranks", lambda: group_members(spec.name, 2), 60)
        seen["problem"] = check_complete(run.fs, half)[0]
        kill(psutil.Process(before[1]))
        holds.release(20)
        seen["after"] = wait_for("rank 1 replaced", lambda: replaced(spec.name, 1, before), 300)

    killer = threading.Thread(target=kill_mid_save, daemon=True)
    killer.start()
    result = tidal.run(spec)
    killer.join(timeout=5)
    out = capfd.readouterr().out

    assert seen.get("problem") is not None, "checkpoint 20 was complete when rank 1 died: no fault mid-save"
    assert_exact(tmp_path, spec, result, out)
    before, after = seen["before"], seen["after"]
    assert after[0] == before[0], f"rank 0's process changed: the whole group restarted\n{out[-3000:]}"
    assert "rank 1 lost after step 20: replaced in place (generation 2)" in out, out[-3000:]
    assert RESTART not in out, out[-3000:]
    (where, step, _), = resumes(out)
    assert where.startswith("the in-memory snapshot held on node") and step == 18, out[-3000:]


def test_a_rank_lost_while_a_memory_snapshot_is_handed_over_resumes_from_the_previous_one(tmp_path, capfd):
    """Both ranks' hand-over of the memory snapshot of step 12 waits 10 s; rank 1 is killed inside it. The
    survivor's hand-over thread is still in flight when it re-forms; snapshot 12 is missing rank 1's shard,
    so the group re-forms in place from the newest complete state: checkpoint 10 (newer than snapshot 9)."""
    holds = StepHolds(12)
    spec = in_place_spec(tmp_path, "in-place-mid-snapshot", holds, **{DELAY_ENV: "10:12"})
    seen: dict[str, object] = {}

    def kill_mid_hand_over() -> None:
        import ray

        holds.wait(12)
        before = seen["before"] = wait_for("the group's ranks", lambda: group_members(spec.name, 2), 60)
        seen["held_12"] = [e["rank"] for k in keeper.named(spec.name).values()
                           for e in ray.get(k.listing.remote()) if e["step"] == 12]
        kill(psutil.Process(before[1]))
        holds.release(12)
        seen["after"] = wait_for("rank 1 replaced", lambda: replaced(spec.name, 1, before), 300)

    killer = threading.Thread(target=kill_mid_hand_over, daemon=True)
    killer.start()
    result = tidal.run(spec)
    killer.join(timeout=5)
    out = capfd.readouterr().out

    assert seen.get("held_12") == [], f"a shard of snapshot 12 was held before the kill: {seen.get('held_12')}"
    assert_exact(tmp_path, spec, result, out)
    before, after = seen["before"], seen["after"]
    assert after[0] == before[0], f"rank 0's process changed: the whole group restarted\n{out[-3000:]}"
    assert "rank 1 lost after step 12: replaced in place (generation 2)" in out, out[-3000:]
    assert RESTART not in out, out[-3000:]
    (where, step, _), = resumes(out)
    assert (where, step) == (checkpoint_dir_name(10), 10), out[-3000:]


def test_the_replacement_lost_inside_its_restore_falls_back_to_new_processes_for_every_rank(tmp_path, capfd):
    """Rank 1 is killed after step 13 and replaced in place; the replacement is killed while the re-formed
    group restores (one rank pauses inside the restore from memory). Re-forming cannot hold: the survivor
    gives up its process too (its restore meets the lost peer, or its watchdog the silent one) and Ray Train
    starts it anew beside the next replacement - every rank in a new process, as a full restart - resuming
    from the same memory snapshot and finishing exactly. Three restarts: each kill, and the survivor's end."""
    marker = tmp_path / "restoring"
    holds = StepHolds(13)
    spec = in_place_spec(tmp_path, "in-place-restore-kill", holds, restarts=3, **{LOAD_PAUSE_ENV: f"{marker}@8"})
    seen: dict[str, dict[int, int]] = {}

    def twice() -> None:
        holds.wait(13)
        before = seen["before"] = wait_for("the group's ranks", lambda: group_members(spec.name, 2), 60)
        kill(psutil.Process(before[1]))
        holds.release(13)
        wait_for("a rank inside the restore from memory", marker.exists, 300, every=0.05)
        reformed = seen["reformed"] = wait_for("rank 1 replaced", lambda: replaced(spec.name, 1, before), 60)
        kill(psutil.Process(reformed[1]))
        seen["after"] = wait_for("rank 0 in a new process", lambda: replaced(spec.name, 0, before), 300)

    killer = threading.Thread(target=twice, daemon=True)
    killer.start()
    result = tidal.run(spec)
    killer.join(timeout=5)
    out = capfd.readouterr().out

    assert "reformed" in seen, f"the replacement was not killed\n{out[-3000:]}"
    assert_exact(tmp_path, spec, result, out)
    before, reformed, after = seen["before"], seen["reformed"], seen["after"]
    assert reformed[0] == before[0], "the first loss was not replaced in place"
    assert after[0] != before[0] and after[1] not in (before[1], reformed[1]), (before, reformed, after)
    assert "restart 1: replacing rank(s) 1 alone (failure.replace_in_place)" in out, out[-3000:]
    assert re.search(r"restart \d: (replacing rank\(s\) 0 alone|restarting the worker group)", out), out[-3000:]
    # no rank kept its process: nothing was replaced in place, whatever the rendezvous's generation
    assert "replaced in place (generation" not in out, out[-3000:]
    got = resumes(out)
    assert got and all(w.startswith("the in-memory snapshot held on node") and s == 12 for w, s, _ in got), out[-3000:]


def test_two_ranks_lost_at_once_are_replaced_in_place_together(tmp_path, capfd):
    """Three workers of half a CPU each; ranks 1 and 2 are killed together after step 13. Rank 0 keeps its
    process, the group re-forms once with both replacements, from the memory snapshot of step 12."""
    holds = StepHolds(13)
    spec = holds.spec(tiny_spec(tmp_path, name="in-place-two", **{
        **THREE, **IN_PLACE, "checkpoint.memory.every_steps": 3}, worker_env={fetch.CACHE_ENV: str(tmp_path / "cache")}))
    seen: dict[str, dict[int, int]] = {}

    def kill_two() -> None:
        holds.wait(13)
        before = seen["before"] = wait_for("the group's ranks", lambda: group_members(spec.name, 3), 60)
        for rank in (1, 2):
            kill(psutil.Process(before[rank]))
        holds.release(13)
        seen["after"] = wait_for("ranks 1 and 2 replaced", lambda: m if (m := replaced(spec.name, 1, before)) and
                                 m[2] != before[2] else None, 300)

    killer = threading.Thread(target=kill_two, daemon=True)
    killer.start()
    result = tidal.run(spec)
    killer.join(timeout=5)
    out = capfd.readouterr().out

    assert result.error is None, f"{result.error}\n{out[-3000:]}"
    expected = reference_losses("in-place-three", tiny_spec(tmp_path, name="three", **THREE))
    got = metric_history(spec, result.mlflow_run_id, "loss")
    assert sorted(got) == list(range(1, 25)), "every step logged exactly once"
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-4), step
    before, after = seen["before"], seen["after"]
    assert after[0] == before[0], f"rank 0's process changed: the whole group restarted\n{out[-3000:]}"
    assert "ranks 1, 2 lost after step 13: replaced in place (generation 2)" in out, out[-3000:]
    assert RESTART not in out, out[-3000:]
    (where, step, _), = resumes(out)
    assert where.startswith("the in-memory snapshot held on node") and step == 12, out[-3000:]
