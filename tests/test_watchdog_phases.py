"""A save, an evaluation or a drain runs under a deadline of its own, not the step timeout
(worker/health/watchdog.py): longer than a step may take is not hung, past its own deadline is, and the
message names the phase. The watchdog exits its process, so it runs in a child process here,
writing to a real event log; one end-to-end job checks a slow synchronous save is not killed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import tidal
from tests.conftest import ROOT, metric_history, tiny_spec
from tidal.storage import RunDir
from tidal.tracking.buffer import MetricsBuffer
from tidal.tracking.emitter import Emitter
from tidal.worker.health.watchdog import (
    EXIT_CODE,
    Deadline,
    Phase,
    StepWatchdog,
    hung,
    step_deadline,
)

ADAPTIVE = Deadline(fixed_s=None, multiple=10.0, floor_s=30.0)  # the spec's defaults


@pytest.mark.parametrize(("recent_s", "rule", "deadline"), [
    ([], ADAPTIVE, 300.0),  # no step time known yet: not armed, 10x the floor meanwhile
    ([0.1], ADAPTIVE, 300.0),  # one is not enough: the second step may still be warming up
    ([0.1, 0.12], ADAPTIVE, 30.0),  # the quickstart's shape: the floor
    ([0.1, 0.1, 2.5, 0.1], ADAPTIVE, 30.0),  # a slow log step under the floor changes nothing
    ([4.0, 5.0, 4.5], ADAPTIVE, 50.0),  # slow steps: a multiple of the slowest recent one
    ([4.0, 5.0], Deadline(None, 3.0, 1.0), 15.0),
    ([], Deadline(fixed_s=900.0), 900.0),  # a fixed deadline is armed by the first step, as before
    ([0.1] * 10, Deadline(fixed_s=5.0), 5.0),  # and does not adapt
    ([0.1] * 10, Deadline(fixed_s=0.0), None),  # 0 disables
])
def test_step_deadline_adapts_to_the_jobs_own_steps_above_a_floor(recent_s, rule, deadline):
    assert step_deadline(recent_s, rule) == deadline


def test_the_spec_defaults_to_the_adaptive_deadline():
    f = tiny_spec(ROOT).failure
    assert (f.step_timeout_s, f.step_timeout_multiple, f.step_timeout_floor_s) == (None, 10.0, 30.0)
    assert step_deadline([0.05] * 20, Deadline(f.step_timeout_s, f.step_timeout_multiple, f.step_timeout_floor_s)) < 60


def test_a_restarted_group_arms_its_deadline_from_its_resume_points_step_time(tmp_path):
    """A hang in a restarted group's first steps was found after 300 s (the unarmed deadline)."""
    from types import SimpleNamespace

    from tidal.tracking.emitter import Emitter
    from tidal.worker.health.hang import resumed_step_times
    from tidal.worker.health.watchdog import StepWatchdog

    found = SimpleNamespace(state={"step": 40, "world_size": 2, "step_time_s": 0.2})
    assert resumed_step_times(found, 2, 30.0) == [0.2, 0.2]
    wd = StepWatchdog(Deadline(None, 10.0, 30.0), 0, Emitter(str(tmp_path), "wd"), seed_s=resumed_step_times(found, 2, 30.0))
    assert wd.deadline() == 30.0, "the floor, from the group's second step: not 300 s"
    assert StepWatchdog(Deadline(0), 0, Emitter(str(tmp_path), "wd")).deadline() is None
    assert resumed_step_times(found, 4, 30.0) == [], "another size trains at another speed"
    assert resumed_step_times(None, 2, 30.0) == [], "a first start"
    for planted in (1e9, -1.0, "0.2", True, float("nan")):  # read from storage: only a plausible step shortens it
        assert resumed_step_times(SimpleNamespace(state={"world_size": 2, "step_time_s": planted}), 2, 30.0) == []


def test_hung_names_what_overran_its_own_deadline():
    save = Phase("save", deadline_s=60.0, started=100.0)
    assert hung(now=130.0, last_beat=100.0, timeout_s=10.0, phase=save) is None, "a save is no step"
    assert hung(now=161.0, last_beat=100.0, timeout_s=10.0, phase=save) == "save"
    assert hung(now=111.0, last_beat=100.0, timeout_s=10.0, phase=None) == "step"
    assert hung(now=109.0, last_beat=100.0, timeout_s=10.0, phase=None) is None
    assert hung(now=1e9, last_beat=None, timeout_s=10.0, phase=None) is None, "armed by the first step"
    assert hung(now=1e9, last_beat=100.0, timeout_s=10.0, phase=Phase("eval", 0.0, 100.0)) is None, "0: no limit"
    assert hung(now=1e9, last_beat=100.0, timeout_s=None, phase=None) is None, "an adaptive deadline not armed yet"


def run_watchdog(tmp_path, body: str, deadline: str = "1.0") -> tuple[int, list[str]]:
    """Run `body` in a child with `wd` (step deadline `deadline`, 1 s) beaten at step 7; its exit
    code and notes."""
    script = textwrap.dedent("""
        import time
        from tidal.tracking.emitter import Emitter
        from tidal.worker.health.watchdog import Deadline, StepWatchdog
        events = Emitter(STORAGE, "wd")
        wd = StepWatchdog(DEADLINE, 0, events, phase_timeout_s=60.0)
        wd.beat(7)
    """).replace("STORAGE", repr(str(tmp_path))).replace("DEADLINE", deadline) + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, timeout=120, capture_output=True, text=True)
    run = RunDir(str(tmp_path), "wd")
    notes = [e["text"] for e in MetricsBuffer(run.fs, run.path).load() if e.get("kind") == "note"]
    return proc.returncode, notes


@pytest.mark.slow
def test_a_save_longer_than_the_step_timeout_within_its_deadline_is_not_killed(tmp_path):
    rc, notes = run_watchdog(tmp_path, """
        with wd.phase("save", 5.0):
            time.sleep(3.0)  # three step timeouts
        time.sleep(0.5)  # the step clock restarted when the save ended
    """)
    assert (rc, notes) == (0, [])


@pytest.mark.slow
def test_a_phase_past_its_own_deadline_is_hung_and_named(tmp_path):
    rc, notes = run_watchdog(tmp_path, """
        with wd.phase("save", 2.0):
            time.sleep(30.0)
    """)
    assert rc == EXIT_CODE
    assert len(notes) == 1 and "in save after step 7" in notes[0] and "phase_timeout_s" in notes[0], notes


@pytest.mark.slow
def test_a_step_after_a_phase_still_has_the_step_timeout(tmp_path):
    rc, notes = run_watchdog(tmp_path, """
        with wd.phase("eval", 5.0):
            pass
        time.sleep(30.0)
    """)
    assert rc == EXIT_CODE and "finished no step for 1s after step 7" in notes[0], notes


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): the watchdog's phase deadlines are unit-tested here
@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_a_slow_synchronous_save_is_not_taken_for_a_hung_step(tmp_path):
    """Each checkpoint write takes 4 s (TIDAL_TEST_CHECKPOINT_WRITE_DELAY_S) and is synchronous, with a
    step timeout of 2 s: before saves had their own deadline the watchdog killed the first one."""
    spec = tiny_spec(tmp_path, name="slowsave", **{
        "train.steps": 16, "checkpoint.every_steps": 8, "checkpoint.async_upload": False,
        "failure.step_timeout_s": 2.0, "failure.max_restarts": 0,
        "worker_env": {"TIDAL_TEST_CHECKPOINT_WRITE_DELAY_S": "4"},
    })
    result = tidal.run(spec)
    assert sorted(metric_history(spec, result.mlflow_run_id, "loss")) == list(range(1, 17))
    assert metric_history(spec, result.mlflow_run_id, "restarts")[16] == 0
    assert sorted(metric_history(spec, result.mlflow_run_id, "checkpoint_bytes")) == [8, 16]


@pytest.mark.slow
def test_an_adaptive_deadline_arms_after_the_first_steps_and_exits_naming_itself(tmp_path):
    """Not armed while only one step time is known (2 s without a step passes: 10x the floor
    then), then armed at its 1 s floor once the slow step leaves the window: a wait exits."""
    rc, notes = run_watchdog(tmp_path, """
        time.sleep(0.05)
        wd.beat(8)  # one step time known: not armed yet (10 s meanwhile: 10x the floor)
        time.sleep(2.0)
        wd.beat(9)  # two: armed at max(1 s floor, 10 x 2 s): the slow step raises it to 20 s
        for step in range(10, 10 + 60):  # fast steps push the slow one out of nothing: max over the last 50
            wd.beat(step)
        time.sleep(30.0)
    """, deadline="Deadline(None, 10.0, 1.0)")
    assert rc == EXIT_CODE and len(notes) == 1, (rc, notes)
    assert "finished no step for 1s after step 69" in notes[0] and "adaptive deadline 1s" in notes[0], notes


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_a_final_background_upload_longer_than_the_step_deadline_is_not_taken_for_a_hang(tmp_path):
    """The last checkpoint's write runs in Ray's upload thread after the train function returned
    (checkpoint.async_upload, the default); it takes 8 s here against a 3 s step deadline. The
    watchdog, never disarmed when training ended, declared it a hang and killed the worker
    mid-write: "job failed", its newest checkpoint never finished (issue 77)."""
    spec = tiny_spec(tmp_path, name="slowlast", **{
        "train.steps": 16, "checkpoint.every_steps": 8, "checkpoint.async_upload": True,
        "failure.step_timeout_floor_s": 3.0, "failure.max_restarts": 0,
        "worker_env": {"TIDAL_TEST_CHECKPOINT_WRITE_DELAY_S": "8:16"},  # only the final write is slow
    })
    result = tidal.run(spec)
    assert sorted(metric_history(spec, result.mlflow_run_id, "loss")) == list(range(1, 17))
    assert metric_history(spec, result.mlflow_run_id, "restarts")[16] == 0
    assert RunDir(spec.checkpoint.storage, spec.name).latest_complete().step == 16, "the final checkpoint is whole"


@pytest.mark.slow
def test_after_the_last_step_the_process_waits_under_the_phase_deadline_not_the_steps(tmp_path):
    rc, notes = run_watchdog(tmp_path, """
        wd.end()
        time.sleep(3.0)  # the final background upload: three step deadlines
    """)
    assert (rc, notes) == (0, [])


def start_watchdog(tmp_path, body: str, deadline: str = "Deadline(None, 2.0, 0.5)",
                   phase_s: float = 60.0) -> tuple[int, list[str]]:
    """Run `body` in a child with `wd` just created (a group's start), never beaten; its exit code and notes."""
    script = textwrap.dedent("""
        import time
        from tidal.tracking.emitter import Emitter
        from tidal.worker.health.watchdog import Deadline, StepWatchdog
        events = Emitter(STORAGE, "wd")
        wd = StepWatchdog(DEADLINE, 0, events, phase_timeout_s=PHASE)
    """).replace("STORAGE", repr(str(tmp_path))).replace("DEADLINE", deadline).replace("PHASE", repr(phase_s))
    proc = subprocess.run([sys.executable, "-c", script + textwrap.dedent(body)], cwd=ROOT, timeout=120,
                          capture_output=True, text=True)
    run = RunDir(str(tmp_path), "wd")
    return proc.returncode, [e["text"] for e in MetricsBuffer(run.fs, run.path).load() if e.get("kind") == "note"]


@pytest.mark.slow
def test_a_hang_in_a_groups_start_is_found_under_the_phase_deadline(tmp_path):
    """Restore and engine build hung before the first step: found only by torch's 30-minute
    process-group timeout before, with no word of who stopped (issue 77)."""
    rc, notes = start_watchdog(tmp_path, "time.sleep(30.0)", phase_s=2.0)
    assert rc == EXIT_CODE and len(notes) == 1 and "spent over 2s in start after step 0" in notes[0], (rc, notes)


@pytest.mark.slow
def test_the_first_step_of_a_group_is_under_the_unarmed_step_deadline(tmp_path):
    rc, notes = start_watchdog(tmp_path, """
        wd.opened([0.01, 0.01])  # seeded: the second step's deadline is the 1 s floor; the first is 10x it
        time.sleep(2.0)  # the first step, warming up: within its 10 s
        wd.beat(1)
        time.sleep(30.0)
    """, deadline="Deadline(None, 10.0, 1.0)")
    assert rc == EXIT_CODE and len(notes) == 1, (rc, notes)
    assert "finished no step for 1s after step 1" in notes[0], notes


@pytest.mark.parametrize(("phase_timeout_s", "start_s"), [
    (3600.0, 1500.0),  # the default: below torch's 30-minute process-group timeout
    (600.0, 600.0),
    (0.0, 0.0),  # failure.phase_timeout_s: 0, no limit, holds for the start too (was 1500 s: a long restore cut off)
])
def test_a_groups_start_is_under_the_phase_deadline_capped_below_torchs_timeout(tmp_path, phase_timeout_s, start_s):
    wd = StepWatchdog(Deadline(0), 0, Emitter(str(tmp_path), "wd"), phase_timeout_s=phase_timeout_s)
    assert wd.current is not None and (wd.current.name, wd.current.deadline_s) == ("start", start_s)
