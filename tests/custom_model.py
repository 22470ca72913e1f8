"""A user model for `model.builder: "tests.custom_model:build"` (the documented signature)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tidal.spec.sections import ModelSpec


class Bigram(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.table = nn.Embedding(vocab, vocab)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.table(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build(spec: ModelSpec) -> nn.Module:
    return Bigram(spec.vocab_size)


class FlakyLoad(Bigram):
    """Fails its first checkpoint load after TIDAL_TEST_LOAD_FAULT's file appears, the way an
    out-of-memory or a dropped connection would: nothing is wrong with the checkpoint."""

    def load_state_dict(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201 - torch's signature
        import os
        from pathlib import Path

        flag = Path(os.environ.get("TIDAL_TEST_LOAD_FAULT", "/nonexistent"))
        if flag.exists():
            flag.unlink(missing_ok=True)
            raise RuntimeError("injected: out of memory while loading")
        return super().load_state_dict(*args, **kwargs)


def build_flaky_load(spec: ModelSpec) -> nn.Module:
    return FlakyLoad(spec.vocab_size)


class Broken(Bigram):
    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("tests.custom_model.Broken: this model always fails")


def build_failing(spec: ModelSpec) -> nn.Module:
    """A model that fails at its first step, for jobs that must fail for good."""
    return Broken(spec.vocab_size)
