"""Models a job can train; `build_model(spec)` is the one entry point.

Every model's forward is `(tokens, targets) -> mean next-token loss`, which is all the train
loop and DeepSpeed need to know about it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from torch import nn

from tidal.errors import SpecError
from tidal.spec.job import ModelSpec
from tidal.worker.models.gpt import GPT


def build_model(model: ModelSpec, checkpoint_fn: Callable[..., Any] | None = None) -> nn.Module:
    """`checkpoint_fn(fn, *args)`, when given, turns on activation checkpointing with that function
    (the engine passes DeepSpeed's, which knows about ZeRO-3's partitioned parameters)."""
    if model.hf_config is not None or model.hf_pretrained is not None:
        from tidal.worker.models.hf import build_hf

        return build_hf(model, checkpoint_fn)
    if model.builder:
        return _user_model(model)
    return GPT(model, checkpoint_fn=checkpoint_fn)


def _user_model(model: ModelSpec) -> nn.Module:
    module_name, _, func = (model.builder or "").partition(":")
    try:
        built = getattr(importlib.import_module(module_name), func)(model)
    except (ImportError, AttributeError) as e:
        raise SpecError([("model.builder", f"cannot load {model.builder!r}: {e}")]) from e
    if not isinstance(built, nn.Module):
        raise SpecError([("model.builder", f"{model.builder!r} returned {type(built).__name__}, not a torch nn.Module")])
    return built


__all__ = ["GPT", "build_model"]
