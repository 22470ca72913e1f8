"""Write a consolidated state dict as a model folder that loads without DeepSpeed or Ray.

- `torch`: the model the job trained (built-in GPT, Hugging Face model or `model.builder`) as
  `model.safetensors` + `tidal-model.json` (its model spec); `load_torch` rebuilds it with torch.
- `hf`: a Hugging Face `save_pretrained` folder (safetensors) with the job's tokenizer; the
  built-in GPT goes out as GPT-2, onto which it maps exactly (see `tidal.exporter.gpt2`).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

from tidal.errors import CheckpointError
from tidal.spec.job import JobSpec
from tidal.spec.sections import ModelSpec

TORCH_WEIGHTS = "model.safetensors"
TORCH_CONFIG = "tidal-model.json"


def is_hf(model: ModelSpec) -> bool:
    return model.hf_config is not None or model.hf_pretrained is not None


def save(spec: JobSpec, state_dict: dict[str, torch.Tensor], format: str, out: str) -> nn.Module:
    """Write the model to `out`; returns the model written (what MLflow logs)."""
    model = rebuild(spec.model, state_dict)
    if format == "torch":
        save_torch(model, spec.model, out)
        return model
    os.makedirs(out, exist_ok=True)
    if is_hf(spec.model):
        hf = model.model  # the transformers model inside Tidal's HFCausalLM adapter
    else:
        from tidal.exporter.gpt2 import to_gpt2

        hf = to_gpt2(model)
    hf.save_pretrained(out)
    if spec.data.tokenizer:
        from tidal.worker.tokens import load_tokenizer

        load_tokenizer(spec.data.tokenizer).save_pretrained(out)
    return hf


def rebuild(model_spec: ModelSpec, state_dict: dict[str, torch.Tensor]) -> nn.Module:
    """The job's model, built as the workers build it, holding the consolidated weights."""
    from tidal.worker.models import build_model

    model = build_model(model_spec)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    # A weight tied to another one (an output head sharing the embedding) may be absent.
    missing = [k for k in missing if not _tied(model, k)]
    if missing or unexpected:
        raise CheckpointError(f"the checkpoint's weights do not fit the spec's model: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
    return model.eval()


def _tied(model: nn.Module, key: str) -> bool:
    params = dict(model.named_parameters())  # lists a shared parameter once, under its first name
    return key not in params and key in dict(model.named_parameters(remove_duplicate=False))


def save_torch(model: nn.Module, model_spec: ModelSpec, out: str) -> None:
    from safetensors.torch import save_model

    os.makedirs(out, exist_ok=True)
    spec = model_spec.model_dump(mode="json")
    if is_hf(model_spec):
        # Rebuilt from the config saved here, so the folder loads where hf_pretrained's path is absent.
        model.model.config.save_pretrained(out)
        spec.update(hf_config=None, hf_pretrained=None)
    save_model(model, os.path.join(out, TORCH_WEIGHTS))  # writes a tied weight once
    with open(os.path.join(out, TORCH_CONFIG), "w") as f:
        json.dump({"format": "tidal-torch", "hf": is_hf(model_spec), "model": spec}, f, indent=2)


def load_torch(path: str) -> nn.Module:
    """The model in a `--format torch` folder, in eval mode."""
    from safetensors.torch import load_model

    from tidal.worker.models import build_model

    config_file = os.path.join(path, TORCH_CONFIG)
    if not os.path.isfile(config_file):
        raise CheckpointError(f"{path} holds no {TORCH_CONFIG}: not a folder written by `tidal export --format torch`")
    with open(config_file) as f:
        cfg: dict[str, Any] = json.load(f)
    spec = ModelSpec.model_validate({**cfg["model"], **({"hf_config": path} if cfg.get("hf") else {})})
    model = build_model(spec)
    load_model(model, os.path.join(path, TORCH_WEIGHTS))
    return model.eval()
