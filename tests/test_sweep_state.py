"""A sweep's state is data (launch/sweep_state.py), checked before a resume uses it (fast)."""

from __future__ import annotations

import pytest

from tidal.errors import TidalError
from tidal.launch.sweep_state import (
    SWEEP_FILE,
    SweepState,
    check_values,
    new_trials,
    outcome,
    plan_trials,
    read_state,
)
from tidal.spec.sweep import parse_dist
from tidal.storage import RunDir

PARAMS = {"train.lr": parse_dist("train.lr", "loguniform:1e-4:1e-2"),
          "train.micro_batch": parse_dist("train.micro_batch", "grid:4,8"),
          "train.seed": parse_dist("train.seed", "randint:0:9")}


def test_the_plan_is_drawn_up_front_the_same_for_a_seed():
    plan = plan_trials(PARAMS, samples=2, seed=3)
    assert len(plan) == 4 and sorted(v["train.micro_batch"] for v in plan) == [4, 4, 8, 8]  # 2 passes over the grid
    assert plan == plan_trials(PARAMS, samples=2, seed=3)
    assert all(check_values(v, PARAMS) is None for v in plan)
    assert all(type(v["train.seed"]) is int and type(v["train.lr"]) is float for v in plan)  # JSON's own types


@pytest.mark.parametrize("change, why", [
    ({"model.builder": "evil:build"}, "not the swept ones"),
    ({"train.seed": 9}, "train.seed=9 is not a value of randint:0:9"),
    ({"train.lr": 0.5}, "train.lr=0.5 is not a value of loguniform"),
    ({"train.micro_batch": 6}, "train.micro_batch=6 is not a value of grid:4,8"),
    ({"train.micro_batch": "4"}, "is not a value of grid:4,8"),
])
def test_values_no_distribution_could_give_are_refused(change, why):
    values = {**plan_trials(PARAMS, 1, 0)[0], **change}
    assert why in (check_values(values, PARAMS) or "")


def test_a_changed_or_old_state_file_is_refused_with_what_to_do(tmp_path):
    folder = RunDir(str(tmp_path), "sw-sweep")
    assert read_state(folder, PARAMS) is None  # no sweep yet
    trials = new_trials(plan_trials(PARAMS, 1, 0))
    folder.write_json(SWEEP_FILE, SweepState("run1", "fp", trials).as_json())
    state = read_state(folder, PARAMS)
    assert state is not None and state.todo() == [0, 1] and state.parent_run_id == "run1"

    trials[1]["values"]["model.builder"] = "evil:build"
    folder.write_json(SWEEP_FILE, SweepState("run1", "fp", trials).as_json())
    with pytest.raises(TidalError, match="trial 1 cannot be resumed: .* --restart"):
        read_state(folder, PARAMS)

    folder.write_json(SWEEP_FILE, {"parent_run_id": "run1", "fingerprint": "fp"})  # an earlier Tidal's state
    with pytest.raises(TidalError, match="earlier Tidal.*--restart"):
        read_state(folder, PARAMS)


@pytest.mark.parametrize("last, expected", [
    ({"step": 16}, "completed"), ({"step": 8}, "stopped_early"), ({"step": 8, "early_stopped": True}, "completed"),
    ({}, "completed"),  # a trial whose job was already complete reports nothing
])
def test_outcome_of_a_trial_tune_ended(last, expected):
    assert outcome(last, 16) == expected
