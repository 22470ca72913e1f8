"""A log step's one collective: the loss every rank agrees on, the busy times the straggler
watch needs, and one decision, rank 0's, of when all ranks ask Ray about preemption."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tidal.worker.logsync import NO_SAMPLE, LogSync


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def row(loss_sum: float, n: int, busy: float = NO_SAMPLE, due: bool = False, blocked: float = 0.0,
        target: float = -1.0) -> list[float]:
    return [loss_sum, float(n), busy, float(due), blocked, target]


def test_rank_0s_word_from_admission_is_every_ranks():
    """Only rank 0 polls admission (worker/health/directive.py): its target must reach every rank, so
    all of them end the group at the same step."""
    assert LogSync().agree([row(1.0, 1, target=2.0), row(1.0, 1, target=-1.0)]).target == 2.0
    assert LogSync().agree([row(1.0, 1, target=-1.0), row(1.0, 1, target=4.0)]).target == -1.0


def test_the_loss_is_the_mean_over_ranks_and_micro_batches():
    agreed = LogSync().agree([row(3.0, 2), row(5.0, 2)])  # rank 0: 1.5 per micro-batch, rank 1: 2.5
    assert agreed.loss == pytest.approx(2.0)
    assert agreed.busy_s is None  # no sampled step in the interval


def test_every_rank_gets_every_ranks_busy_time_in_rank_order():
    agreed = LogSync().agree([row(1.0, 1, 0.25), row(1.0, 1, 0.75), row(1.0, 1, 0.5)])
    assert agreed.busy_s == [0.25, 0.75, 0.5]


def test_rank_0_alone_decides_when_every_rank_checks_for_preemption():
    sync = LogSync()
    # Rank 1's own clock said "due"; rank 0's did not: nobody calls Ray's barrier.
    assert not sync.agree([row(1.0, 1, due=False), row(1.0, 1, due=True)]).check_preemption
    assert sync.agree([row(1.0, 1, due=True), row(1.0, 1, due=False)]).check_preemption


def test_the_checkpoint_stall_is_the_slowest_ranks_not_rank_0s():
    # Rank 0's save took 0.1 s; rank 2 waited 0.9 s (its own write, or its optimizer's gate).
    agreed = LogSync().agree([row(1.0, 1, blocked=0.1), row(1.0, 1, blocked=0.3), row(1.0, 1, blocked=0.9)])
    assert agreed.blocked_max_s == pytest.approx(0.9)
    assert LogSync().agree([row(1.0, 1), row(1.0, 1)]).blocked_max_s == 0.0, "no checkpoint, no stall"


@pytest.fixture
def gloo():
    """A real one-rank gloo process group in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_exchange_over_a_real_gloo_group(gloo):
    agreed = LogSync().exchange(6.0, 3, 0.2, may_check=True, blocked_s=0.4)
    assert agreed.loss == pytest.approx(2.0)
    assert agreed.blocked_max_s == pytest.approx(0.4)
    assert agreed.busy_s == pytest.approx([0.2])
    assert agreed.check_preemption


def test_ray_is_asked_at_most_once_a_second_and_only_where_the_loop_allows(gloo):
    clock = Clock()
    sync = LogSync(check_every_s=1.0, clock=clock)
    asked = []
    for step in range(1, 14):  # log steps 0.25 s apart; the loop forbids the check at step 5
        if sync.exchange(1.0, 1, None, may_check=step != 5).check_preemption:
            asked.append(step)
        clock.now += 0.25
    assert asked == [1, 6, 10]
