"""Stragglers: the decision alone, then a real job with one rank slowed on purpose."""

from __future__ import annotations

import random
import statistics

import pytest

import tidal
from tests.conftest import metric_history, tiny_spec
from tidal.testing.processes import wait_for
from tidal.worker.health.stragglers import PersistentWait, Spread, StragglerWatch, spread


def test_spread_compares_the_slowest_rank_with_the_median():
    assert spread([0.1, 0.1, 0.1, 0.1]) == Spread(1.0, 0)
    s = spread([0.1, 0.1, 0.3, 0.1])
    assert s.slowest_rank == 2 and s.ratio == pytest.approx(3.0)
    # two ranks: the lower median, so the slow one is compared with the other, not with their mean
    assert spread([0.02, 0.12]).ratio == pytest.approx(6.0)
    assert spread([0.0, 0.0]) == Spread(1.0, 0)


def test_watch_warns_once_per_streak_of_the_same_rank():
    w = StragglerWatch(threshold=1.5, intervals=3)
    slow1, slow2, fine = Spread(2.0, 1), Spread(2.0, 2), Spread(1.1, 0)
    assert [w.update(x) for x in (slow1, slow1)] == [None, None]
    assert w.update(slow1) == 1, "third interval in a row above the threshold"
    assert w.update(slow1) is None, "said once for this streak"
    assert [w.update(x) for x in (slow2, slow2, fine, slow2, slow2)] == [None] * 5, "another rank, then a break"
    assert w.update(slow2) == 2
    off = StragglerWatch(threshold=0, intervals=1)
    assert off.update(Spread(9.0, 1)) is None


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): straggler ratios are unit-tested
@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_a_slowed_rank_is_named_and_the_others_wait_in_collectives(tmp_path, capfd):
    spec = tiny_spec(tmp_path, name="straggler", **{
        "model.builder": "tests.straggler_model:build", "train.steps": 16, "train.log_every": 2,
        "checkpoint.every_steps": 16, "failure.straggler_ratio": 1.5, "failure.straggler_intervals": 3,
        "worker_env": {"TIDAL_TEST_SLOW_RANK": "1", "TIDAL_TEST_SLOW_S": "0.05"},
    })
    run_id = tidal.run(spec).mlflow_run_id

    ratio = metric_history(spec, run_id, "straggler_ratio")
    rank = metric_history(spec, run_id, "straggler_rank")
    assert sorted(ratio) == list(range(2, 17, 2))
    assert all(ratio[s] > 1.5 and rank[s] == 1 for s in ratio), (ratio, rank)
    # Rank 0 (whose metrics MLflow holds) spends most of its step waiting for rank 1 in collectives.
    comm_frac = metric_history(spec, run_id, "comm_frac")
    assert min(comm_frac.values()) > 0.5, comm_frac
    out = _wait_for_output(capfd, "straggler: rank 1 on node")
    line = next(ln for ln in out.splitlines() if "straggler: rank 1 on node" in ln)
    assert "[tidal] WARNING" in line and "for 3 log intervals" in line, line
    assert out.count("straggler: rank") == 1, "one warning for one streak"


def _wait_for_output(capfd, text: str, timeout: float = 20) -> str:
    """Actor output reaches the driver through Ray's log monitor, a moment after it is printed."""
    out: list[str] = []

    def printed() -> bool:
        out.append(capfd.readouterr().out)
        return text in "".join(out)

    wait_for(f"{text!r} printed", printed, timeout, context=lambda: "".join(out)[-3000:])
    return "".join(out)


def test_the_wait_for_a_straggler_counts_a_persistently_slow_rank_not_jitter():
    """Two balanced ranks taking turns at being slower wait for no straggler (each sample alone said 0.05 s a
    step: 7% of a quickstart's wall on 2 cores); a rank slower at every sample costs its mean excess."""
    jitter = PersistentWait()
    waits = [jitter.update([0.10, 0.15] if i % 2 else [0.15, 0.10]) for i in range(8)]
    assert waits[-1] == pytest.approx(0.0, abs=1e-9)
    slow = PersistentWait()
    waits = [slow.update([0.10 + 0.01 * (i % 2), 0.20]) for i in range(8)]
    assert waits[-1] == pytest.approx(0.20 - 0.105)
    grown = PersistentWait()
    for _ in range(3):
        grown.update([0.1, 0.3])
    assert grown.update([0.1, 0.1, 0.1]) == pytest.approx(0.0)  # another group size starts over


def test_random_jitter_is_not_charged_as_a_straggler_and_a_noisy_slow_rank_still_is():
    """Two balanced ranks on shared cores, each step's busy time 10% noisy at random (not neatly taking turns):
    the means of 8 samples still differ by chance, and the slower mean less the other's charged 3.6% of a
    2,000-step quickstart's wall to stragglers while rank 0 was the slowest at 46% of the samples. A rank 2x
    slow under the same noise is still charged about its excess."""
    rng = random.Random(7)
    balanced, slowed = PersistentWait(), PersistentWait()
    charged, excess = [], []
    for _ in range(400):
        busy = [0.1 * (1 + 0.1 * rng.gauss(0, 1)) for _ in range(2)]
        charged.append(balanced.update(busy))
        slow = [busy[0], 0.2 * (1 + 0.1 * rng.gauss(0, 1))]
        excess.append(slowed.update(slow))
    assert statistics.fmean(charged) < 0.001  # under 1% of a 0.1 s step (the plain difference of 8 means: 4.8%)
    assert statistics.fmean(excess[16:]) == pytest.approx(0.1, rel=0.05)


    late = PersistentWait()  # balanced for a while, then one rank slows down: charged from the 5th sample
    for i in range(16):
        late.update([0.10, 0.10 + 0.005 * (-1) ** i])
    waits = [late.update([0.10, 0.30]) for _ in range(16)]
    assert [w > 0 for w in waits[:5]] == [False] * 4 + [True]
    assert waits[-1] == pytest.approx(0.2)  # all of it once the window holds only the slow samples
