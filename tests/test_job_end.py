"""When a job is done (tidal/job_end.py): the one answer the driver (a finished job run again),
the workers (which steps an attempt trains) and the sweep (how far a trial goes) share."""

from __future__ import annotations

import pytest

from tests.conftest import tiny_spec
from tidal.job_end import end_reason, is_done, last_step

EARLY = {"stopped_early": True, "since_best": 3}


@pytest.mark.parametrize("train, state, reason", [
    ({}, {"step": 23}, None),
    ({}, {"step": 24}, "steps"),
    ({"train.stop_at": 10}, {"step": 9}, None),
    ({"train.stop_at": 10}, {"step": 10}, "stop_at"),
    ({"train.stop_at": 10}, {"step": 24}, "steps"),
    ({"train.stop_at": 40}, {"step": 24}, "steps"),  # a stop_at past train.steps never ends a job
    ({}, {"step": 5, "data_ended": True}, "data"),
    ({"eval": {"every_steps": 4, "patience": 3}}, {"step": 12, "evaluation": EARLY}, "early_stop"),
    ({"eval": {"every_steps": 4, "patience": 5}}, {"step": 12, "evaluation": EARLY}, None),  # patience raised
])
def test_a_checkpoints_state_ends_the_job_for_one_reason(tmp_path, train, state, reason):
    spec = tiny_spec(tmp_path, **train)
    assert end_reason(spec, state) == reason and is_done(spec, state) == (reason is not None)


def test_the_last_step_is_stop_at_when_it_comes_first(tmp_path):
    assert last_step(tiny_spec(tmp_path).train) == 24
    assert last_step(tiny_spec(tmp_path, **{"train.stop_at": 10}).train) == 10
    assert last_step(tiny_spec(tmp_path, **{"train.stop_at": 40}).train) == 24
