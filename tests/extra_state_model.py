"""A user model whose own state holds a numpy value (`get_extra_state`), for
`model.builder: "tests.extra_state_model:build"`: weights-only loading refuses numpy's types
unless the job allows them (`checkpoint.safe_globals`)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tidal.spec.sections import ModelSpec

# What torch names when it refuses this state; the spec's checkpoint.safe_globals lists them.
NUMPY_SCALAR = ["numpy._core.multiarray.scalar", "numpy.dtype", "numpy.dtypes.Float64DType"]


class Scaled(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.table = nn.Embedding(vocab, vocab)
        self.temperature = np.float64(1.0)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.table(tokens) / float(self.temperature)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def get_extra_state(self) -> dict:
        return {"temperature": self.temperature}

    def set_extra_state(self, state: dict) -> None:
        self.temperature = state["temperature"]


def build(spec: ModelSpec) -> nn.Module:
    return Scaled(spec.vocab_size)
