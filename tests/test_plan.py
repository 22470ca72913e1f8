"""What a step does after its optimizer step, decided without torch or Ray (tidal.worker.plan):
log, evaluate, checkpoint (in the background or not), drain for a reclaim, end the job."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tidal.worker.plan import Cadence, after_eval, due, plan_step

EVAL = Cadence(log_every=5, checkpoint_every=8, eval_every=6, last=40)
NO_EVAL = Cadence(log_every=5, checkpoint_every=8, eval_every=None, last=40)


def planned(step: int, cadence: Cadence = EVAL, data_ended: bool = False, preempted: bool = False,
            async_upload: bool = True):
    d = due(step, cadence, data_ended)
    return None if d is None else plan_step(d, cadence, preempted, async_upload)


def test_a_step_that_owes_nothing_skips_the_collective():
    assert due(1, EVAL, False) is None and due(7, EVAL, False) is None
    assert due(6, NO_EVAL, False) is None, "no eval cadence without spec.eval"


def test_each_cadence_alone():
    log = planned(5)
    assert (log.log, log.evaluate, log.checkpoint, log.end) == (True, False, False, None)
    ev = planned(6)
    assert (ev.log, ev.evaluate, ev.checkpoint) == (False, True, False)
    ck = planned(16, NO_EVAL)
    assert (ck.log, ck.evaluate, ck.checkpoint, ck.background, ck.drain) == (False, False, True, True, False)


def test_only_log_steps_may_ask_ray_about_preemption():
    assert due(5, EVAL, False).may_check_preemption
    assert not due(8, EVAL, False).may_check_preemption and not due(6, EVAL, False).may_check_preemption


def test_every_checkpoint_and_the_last_step_carry_an_eval():
    assert planned(8).evaluate and planned(8).checkpoint  # 8 is not an eval-cadence step
    last = planned(40)
    assert (last.log, last.evaluate, last.checkpoint, last.end) == (True, True, True, None)


def test_a_preemption_warning_forces_a_synchronous_checkpoint_an_eval_and_the_drain():
    p = planned(5, preempted=True)  # a log step: only there can the warning arrive
    assert (p.checkpoint, p.background, p.emergency, p.drain, p.evaluate) == (True, False, True, True, True)
    assert not planned(16, async_upload=True).emergency and planned(16).background
    assert not planned(16, async_upload=False).background, "checkpoint.async_upload off: synchronous"


def test_data_that_ends_early_logs_checkpoints_and_ends_the_job():
    p = planned(13, data_ended=True)
    assert (p.log, p.checkpoint, p.evaluate, p.end) == (True, True, True, "data")
    assert planned(40, data_ended=True).end is None, "at the last step the job ends anyway: no note"


def test_early_stopping_forces_a_checkpoint_at_that_step_and_ends_the_job():
    p = planned(6)
    assert not p.checkpoint
    stopped = after_eval(p, stop_early=True)
    assert (stopped.checkpoint, stopped.end, stopped.background) == (True, "early_stop", True)
    assert after_eval(p, stop_early=False) == p
    over_data = after_eval(planned(13, data_ended=True), stop_early=True)
    assert over_data.end == "early_stop", "early stopping says why the job ended, not the data"


@pytest.mark.parametrize("step", range(1, 41))
def test_no_step_is_planned_without_a_reason(step):
    p = planned(step)
    if p is not None:
        assert p.log or p.evaluate or p.checkpoint


def test_the_plan_imports_neither_torch_nor_ray():
    code = "import sys, tidal.worker.plan; print(sorted(m for m in ('torch', 'ray') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def resized(step: int, cadence: Cadence = NO_EVAL):
    d = due(step, cadence, False)
    return plan_step(d, cadence, False, True, resize=True)


def test_a_resize_by_admission_checkpoints_synchronously_and_ends_the_group_there():
    """The group's last step must be durable before it ends (the restart resumes from it), so
    the checkpoint cannot run behind: a resize that lost its last steps would train them twice."""
    p = resized(5)
    assert (p.checkpoint, p.background, p.end, p.drain) == (True, False, "resize", False)


def test_a_resize_at_the_last_step_just_ends_the_job():
    p = resized(40)
    assert p.end is None and p.checkpoint
