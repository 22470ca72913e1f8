"""Every warning, one path: whatever gave it (a cloud's notice, a pod's preStop, Ray's drain),
the workers read one Ray drain with a deadline at a log step and save once at the step reached
(worker/plan.py, worker/loop.py). Here the decisions, as pure functions: a warning read at a
periodic checkpoint's step is that one save; one too short for a save says so
(worker/warning.py). The path on real Ray: tests/test_notice_e2e.py, tests/test_elastic.py."""

from __future__ import annotations

import pytest

from tidal.worker.plan import Cadence, due, plan_step
from tidal.worker.warning import after_save, before_save

CADENCE = Cadence(log_every=1, checkpoint_every=10, eval_every=None, last=100)


def test_a_warning_at_a_periodic_checkpoint_is_that_one_save_made_synchronous():
    """A warning read at a step that saves anyway: one save, which counts as the emergency one and
    is written before the drain's wait (not behind training)."""
    p = plan_step(due(10, CADENCE, False), CADENCE, preempted=True, async_upload=True)
    assert (p.checkpoint, p.emergency, p.background, p.drain) == (True, True, False, True)
    assert plan_step(due(10, CADENCE, False), CADENCE, preempted=False, async_upload=True).background


def test_a_warning_between_checkpoints_saves_at_the_step_reached():
    p = plan_step(due(7, CADENCE, False), CADENCE, preempted=True, async_upload=True)
    assert (p.step, p.checkpoint, p.emergency) == (7, True, True)
    assert not plan_step(due(7, CADENCE, False), CADENCE, preempted=False, async_upload=True).checkpoint


@pytest.mark.parametrize("left_s, last_save_s, says", [
    (None, 5.0, None),  # a drain without a deadline: nothing to compare
    (30.0, None, None),  # no synchronous save yet in this group: nothing known
    (30.0, 5.0, None),
    (5.5, 5.0, "less than a save takes here (5.0 s)"),
    (2.0, 5.0, "leaves 2.0 s"),
    (-3.0, None, "came 3 s after its deadline"),
    (0.0, 1.0, "after its deadline"),
])
def test_a_warning_shorter_than_a_save_says_so_before_saving(left_s, last_save_s, says):
    note = before_save(left_s, last_save_s)
    if says is None:
        assert note is None
    else:
        assert says in note and "last complete checkpoint" in note


@pytest.mark.parametrize("left_s, took_s, says", [(30.0, 4.0, False), (3.0, 4.0, True), (None, 4.0, False),
                                                  (-1.0, 0.5, True)])
def test_a_save_that_outlasted_its_warning_says_so_after(left_s, took_s, says):
    note = after_save(left_s, took_s)
    assert (note is not None) == says
    if says:
        assert "would have resumed from its last complete checkpoint" in note
