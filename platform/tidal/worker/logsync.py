"""The one collective of a log step: what every rank must agree on before rank 0 logs.

A log step needs four things from the other ranks: the loss summed over them, each rank's
busy time (for the straggler watch), each rank's seconds blocked by checkpoints since the last
log step (the stall is the slowest rank's, not rank 0's: issue #35), and Ray's word on preemption. Each used to be its own
round trip: a gloo all-reduce, a gloo all-gather, and `ray.train.get_preemption_info()`, which
is a barrier through a Ray actor (about 3 ms on 2 cores). A job that logs every step spent
about 6% of its wall time in them (py-spy, docs/benchmarks.md). Now one all-gather of a small
vector carries the first three, and rank 0's clock decides when Ray is asked again (at most once
a second): the decision travels in the same vector, so every rank calls Ray's barrier on the
same step, as it requires. A reclaim deadline is tens of seconds away, so a second's delay in
seeing the warning costs nothing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

PREEMPTION_CHECK_S = 1.0
NO_SAMPLE = -1.0  # busy time of an interval without a sampled step (never a real duration)


@dataclass(frozen=True)
class Agreed:
    loss: float  # mean over ranks and micro-batches since the last log step
    busy_s: list[float] | None  # every rank's, if this interval had a sampled step
    check_preemption: bool  # the same on every rank: call ray.train.get_preemption_info() now
    blocked_max_s: float = 0.0  # the most seconds any rank was blocked by checkpoints since the last log step
    # The world size rank 0 wants the group restarted at; -1: none. Admission's size for the job where the cluster
    # runs admission (worker/health/directive.py), else the straggler rules' (worker/telemetry.py: without a slow
    # node, or back at max_workers once its avoidance ends).
    target: float = -1.0
    superseded: bool = False  # rank 0 found a newer start of the job holding its lease (tidal/lease.py): stop now


class LogSync:
    def __init__(self, check_every_s: float = PREEMPTION_CHECK_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.check_every_s, self.clock = check_every_s, clock
        self.last_check = -math.inf

    def exchange(self, loss_sum: float, loss_n: int, busy_s: float | None, may_check: bool,
                 blocked_s: float = 0.0, target: float = -1.0, superseded: bool = False) -> Agreed:
        """A collective: every rank calls it at the same steps with the same `may_check`.
        `blocked_s`: this rank's seconds blocked by checkpoints since its previous call; `target`: the
        size rank 0 wants (admission's, or the straggler rules'; `Agreed.target`), `superseded`: whether a
        newer start owns the job (rank 0's count)."""
        due = may_check and self.clock() - self.last_check >= self.check_every_s
        mine = torch.tensor([loss_sum, loss_n, NO_SAMPLE if busy_s is None else busy_s, float(due), blocked_s,
                             target, float(superseded)], dtype=torch.float64)
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, mine)  # CPU tensors: gloo, also beside NCCL ("cpu:gloo,cuda:nccl")
        return self.agree(torch.stack(rows).tolist())

    def agree(self, table: list[list[float]]) -> Agreed:
        """What the gathered rows say, the same on every rank (rank 0's row decides the check)."""
        check = table[0][3] > 0
        if check:
            self.last_check = self.clock()
        busy = [row[2] for row in table]
        return Agreed(loss=sum(r[0] for r in table) / max(sum(r[1] for r in table), 1.0),
                      busy_s=None if busy[0] == NO_SAMPLE else busy, check_preemption=check,
                      blocked_max_s=max(row[4] for row in table),
                      target=table[0][5], superseded=len(table[0]) > 6 and table[0][6] > 0)
