"""After a preemption warning, the loop asks Ray again once the warning's deadline (plus Ray's
margin to tear the group down) has passed without the group being torn down: a cancelled drain
must not leave a later, real reclaim without its emergency checkpoint. No Ray instance: the
decision is a pure function (worker/loop.py `rearm_after_warning`)."""

from __future__ import annotations

import math

from tidal.worker.loop import RECLAIM_MARGIN_S, rearm_after_warning


def test_not_asked_again_while_the_drain_may_still_happen():
    deadline_ms = 1_000_000
    again = rearm_after_warning(deadline_ms)
    assert again == deadline_ms / 1000 + RECLAIM_MARGIN_S
    assert not again <= 1_000.0  # at the deadline itself Ray may still be tearing the group down
    assert again <= 1_000.0 + RECLAIM_MARGIN_S + 0.1


def test_a_cancelled_drain_then_a_real_one_each_get_an_emergency_checkpoint():
    """Replays the loop's use of the decision over time: warnings at t=100 (deadline t=110, then
    cancelled) and at t=300 (deadline t=310). Each gets its own emergency save."""
    warnings = {100: 110_000, 300: 310_000}  # time of the warning -> its deadline (ms)
    armed_at, saves = 0.0, []
    for now in range(0, 400, 5):  # a log step every 5 s
        if now < armed_at:
            continue
        deadline = next((d for t, d in warnings.items() if t <= now < d / 1000), None)
        if deadline is not None:
            saves.append(now)
            armed_at = rearm_after_warning(deadline)
    assert saves == [100, 300]


def test_a_warning_without_deadline_is_never_asked_again():
    assert rearm_after_warning(None) == math.inf
    assert rearm_after_warning(0) == math.inf
