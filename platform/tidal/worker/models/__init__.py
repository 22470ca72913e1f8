"""Models a job can train; `build_model(spec)` is the one entry point.

Every built-in model's forward is `(tokens, targets) -> mean next-token loss`; a user model
(`model.builder`) is any nn.Module, whose loss `train.step_fn` computes when its forward does not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from tidal.spec.sections import ModelSpec
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
    from tidal.worker.user_code import calling, load_ref, mistake

    ref = model.builder or ""
    build = load_ref("model.builder", ref)
    with calling("model.builder", ref, f"called with the model spec and model.builder_args {model.builder_args}"):
        built = build(model, **model.builder_args)
    if not isinstance(built, nn.Module):
        raise mistake("model.builder", f"{ref!r} returned {type(built).__name__}, not a torch nn.Module")
    return built


__all__ = ["GPT", "build_model"]
