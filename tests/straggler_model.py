"""A model with one slow rank, for `model.builder: "tests.straggler_model:build"`.

The spec's `env` says who is slow and how long each of its forward passes sleeps
(TIDAL_TEST_SLOW_S), the way a node with a throttled GPU or a noisy neighbour is slow:
- TIDAL_TEST_SLOW_RANK: that rank, wherever it runs;
- TIDAL_TEST_SLOW_RESOURCE: any rank on a node with that custom resource (a slow node), while the
  file TIDAL_TEST_SLOW_FLAG names exists (a test deletes it once the node was taken out: the
  neighbour left), or always without TIDAL_TEST_SLOW_FLAG."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tests.custom_model import Bigram
from tidal.spec.sections import ModelSpec


class SlowOnOneRank(Bigram):
    def __init__(self, vocab: int, rank: int, sleep_s: float, on_slow_node: bool = False, flag: str = "") -> None:
        super().__init__(vocab)
        self.slow = dist.get_rank() == rank or on_slow_node
        self.sleep_s, self.flag = sleep_s, flag

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.slow and (not self.flag or Path(self.flag).exists()):
            time.sleep(self.sleep_s)
        return super().forward(tokens, targets)


def _on_node_with(resource: str) -> bool:
    if not resource:
        return False
    import ray

    here = ray.get_runtime_context().get_node_id()
    return any(n["NodeID"] == here and resource in (n.get("Resources") or {}) for n in ray.nodes())


def build(spec: ModelSpec) -> SlowOnOneRank:
    env = os.environ
    return SlowOnOneRank(spec.vocab_size, int(env.get("TIDAL_TEST_SLOW_RANK", "-1")), float(env.get("TIDAL_TEST_SLOW_S", "0")),
                         _on_node_with(env.get("TIDAL_TEST_SLOW_RESOURCE", "")), env.get("TIDAL_TEST_SLOW_FLAG", ""))
