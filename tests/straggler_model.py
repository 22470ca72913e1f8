"""A model with one slow rank, for `model.builder: "tests.straggler_model:build"`.

The spec's `env` names the rank (TIDAL_TEST_SLOW_RANK) and how long each of its forward passes
sleeps (TIDAL_TEST_SLOW_S), the way a node with a throttled GPU or a noisy neighbour is slow."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from tests.custom_model import Bigram
from tidal.spec.job import ModelSpec


class SlowOnOneRank(Bigram):
    def __init__(self, vocab: int, rank: int, sleep_s: float) -> None:
        super().__init__(vocab)
        self.slow = dist.get_rank() == rank
        self.sleep_s = sleep_s

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.slow:
            time.sleep(self.sleep_s)
        return super().forward(tokens, targets)


def build(spec: ModelSpec) -> SlowOnOneRank:
    return SlowOnOneRank(spec.vocab_size, int(os.environ.get("TIDAL_TEST_SLOW_RANK", "-1")),
                         float(os.environ.get("TIDAL_TEST_SLOW_S", "0")))
