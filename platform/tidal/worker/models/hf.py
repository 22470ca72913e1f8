"""Hugging Face causal LMs, from a config (no download) or from local pretrained weights."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tidal.errors import SpecError
from tidal.spec.sections import ModelSpec


class HFCausalLM(nn.Module):
    """Adapts a transformers causal LM to Tidal's `forward(tokens, targets) -> loss`."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=tokens, use_cache=False).logits
        # targets are already the next tokens: no shift here (HF's own labels= would shift again)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_hf(spec: ModelSpec, checkpoint_fn: Callable[..., Any] | None) -> nn.Module:
    try:
        import transformers
    except ImportError as e:
        raise SpecError([("model.hf_config", "needs the transformers package: pip install 'tidal[hf]'")]) from e
    if spec.hf_pretrained:
        model = transformers.AutoModelForCausalLM.from_pretrained(spec.hf_pretrained, local_files_only=True)
    else:
        model = transformers.AutoModelForCausalLM.from_config(_config(transformers, spec.hf_config))
    if checkpoint_fn is not None:
        model.gradient_checkpointing_enable()
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=checkpoint_fn)
    return HFCausalLM(model)


def _config(transformers: Any, cfg: dict[str, Any] | str | None) -> Any:
    if isinstance(cfg, dict):
        data = dict(cfg)
        model_type = data.pop("model_type", None)
        if not model_type:
            raise SpecError([("model.hf_config", "needs a model_type, e.g. {model_type: llama, hidden_size: 64, ...}")])
        return transformers.AutoConfig.for_model(model_type, **data)
    path = Path(str(cfg))
    if path.is_file():
        return transformers.AutoConfig.for_model(**json.loads(path.read_text()))
    return transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
