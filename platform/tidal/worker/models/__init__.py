"""Models a job can train; `build_model(spec)` is the one entry point."""

from __future__ import annotations

from torch import nn

from tidal.spec.job import ModelSpec
from tidal.worker.models.gpt import GPT


def build_model(model: ModelSpec, activation_checkpointing: bool = False) -> nn.Module:
    return GPT(model, activation_checkpointing=activation_checkpointing)


__all__ = ["GPT", "build_model"]
