"""A model that runs out of memory above a micro-batch size, for `model.builder:
"tests.oom_model:build"`: how `train.micro_batch: auto` is tested on CPU, where no out-of-memory
error exists (as Composer's tests inject CUDA's). The spec's worker_env gives the limit:

- TIDAL_TEST_MEM_LIMIT: the largest micro-batch whose forward fits;
- TIDAL_TEST_MEM_LIMIT_LATER and TIDAL_TEST_MEM_LATER_FROM: from this model's forward number
  FROM on (0-based, failed ones counted), the limit is LATER instead (memory that fragments
  mid-run). Each engine builds its own model, so a search's tries do not count here.
"""

from __future__ import annotations

import os

import torch

from tests.custom_model import Bigram
from tidal.spec.sections import ModelSpec


class OutOfMemoryAbove(Bigram):
    def __init__(self, vocab: int, limit: int, later: int, later_from: int) -> None:
        super().__init__(vocab)
        self.limit, self.later, self.later_from = limit, later, later_from
        self.forwards = 0

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        limit = self.later if self.forwards >= self.later_from else self.limit
        self.forwards += 1
        if tokens.shape[0] > limit:
            raise torch.OutOfMemoryError(f"injected: a micro-batch of {tokens.shape[0]} is above {limit}")
        return super().forward(tokens, targets)


def build(spec: ModelSpec) -> OutOfMemoryAbove:
    env = os.environ
    limit = int(env.get("TIDAL_TEST_MEM_LIMIT", "1000000"))
    return OutOfMemoryAbove(spec.vocab_size, limit, int(env.get("TIDAL_TEST_MEM_LIMIT_LATER", str(limit))),
                            int(env.get("TIDAL_TEST_MEM_LATER_FROM", "1000000000")))
