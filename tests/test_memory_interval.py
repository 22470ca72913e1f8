"""The memory tier's own interval (`checkpoint.memory.every_steps: auto`): Young/Daly's
sqrt(2 x cost x time between faults) in steps, as a table (tidal.worker.checkpoint.interval)."""

from __future__ import annotations

import math

import pytest

from tests.conftest import tiny_spec
from tidal.worker.checkpoint.interval import FIRST_EVERY, PRIOR_MTBF_S, every_steps, mtbf_s

H = 3600.0


@pytest.mark.parametrize(("cost_s", "step_s", "faults", "trained_s", "most", "steps"), [
    (None, 0.1, 0, 0.0, 50, FIRST_EVERY),      # nothing measured yet: snapshot, then measure it
    (0.2, None, 0, 0.0, 50, FIRST_EVERY),      # no step time yet
    (0.05, 1.0, 0, 0.0, 1000, 38),             # the prior alone: sqrt(2 x 0.05 x 4 h) = 37.9 s
    (0.05, 1.0, 3, 4 * H, 1000, 27),           # 3 faults in 4 h, with the prior's 1 in 4 h: every 2 h -> 26.8 s
    (0.05, 0.1, 0, 0.0, 50, 50),               # at most the persistent checkpoint interval
    (0.0, 0.1, 0, 0.0, 50, 1),                 # free snapshots: every step
    (5.0, 2.0, 1000, 1 * H, 50, 7),            # a costly snapshot, a fault every 18 s: 13.4 s -> 7 steps
])
def test_the_interval_is_young_daly_in_steps_between_one_and_the_checkpoint_interval(
        cost_s, step_s, faults, trained_s, most, steps):
    assert every_steps(cost_s, step_s, faults, trained_s, most) == steps


def test_the_time_between_faults_starts_at_the_prior_and_follows_the_job():
    assert mtbf_s(0, 0.0) == PRIOR_MTBF_S
    assert mtbf_s(1, PRIOR_MTBF_S) == PRIOR_MTBF_S  # one fault in as long as the prior: unchanged
    assert mtbf_s(9, H) == pytest.approx((PRIOR_MTBF_S + H) / 10)
    assert math.isclose(mtbf_s(-1, -5.0), PRIOR_MTBF_S)  # nonsense counts never shorten it below the prior


def test_an_empty_memory_section_chooses_its_interval_and_a_number_still_sets_it(tmp_path):
    assert tiny_spec(tmp_path, **{"checkpoint.memory": {}}).checkpoint.memory.every_steps == "auto"
    assert tiny_spec(tmp_path, **{"checkpoint.memory.every_steps": 7}).checkpoint.memory.every_steps == 7
    assert tiny_spec(tmp_path).checkpoint.memory is None  # tests/conftest.py turns it off (on by default)


def test_ranks_whose_clocks_differ_choose_the_same_interval():
    """Every rank must snapshot at the same steps (a snapshot is a collective). The time trained is
    rank 0's, carried in the group's gather: each rank's own clock rounded the interval differently
    across a step boundary (found in review: 48 against 49 steps at 30 s of skew), and the ranks then
    met in mismatched collectives."""
    import time
    from types import SimpleNamespace

    from tidal.worker.checkpoint.memory import Tier

    cost, step_s, most = 2.0, 5.0, 1000
    trained = next(t for t in range(1, 100_000)
                   if every_steps(cost, step_s, 1, t, most) != every_steps(cost, step_s, 1, t + 30, most))
    now = time.time()
    everyone = [(10, None, None, cost, step_s, float(trained)), (10, None, None, cost, step_s, float(trained + 30))]
    chosen = []
    for rank, skew in ((0, 0.0), (1, 30.0)):  # rank 1's clock 30 s ahead of rank 0's
        tier = object.__new__(Tier)
        tier.rank, tier.faults, tier.said = rank, 1, set()
        tier.trained_since = now - trained - skew
        tier.spec = SimpleNamespace(checkpoint=SimpleNamespace(every_steps=most))
        tier._choose_interval(everyone, 10, lambda line: None)
        chosen.append((tier.every, tier.next_due))
    assert chosen[0] == chosen[1], f"rank 0 chose {chosen[0]}, rank 1 {chosen[1]}: their snapshots' collectives would not meet"
