"""The only training module that imports deepspeed: spec -> ds_config -> deepspeed.initialize()."""

from __future__ import annotations

import logging
from typing import Any

import deepspeed
import torch

from tidal.spec.deepspeed import ds_config
from tidal.spec.job import JobSpec
from tidal.worker.models import build_model

# DeepSpeed logs every config key at INFO on every rank; keep its warnings only.
logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


def build_engine(spec: JobSpec, world_size: int, device: torch.device, load_universal: bool = False) -> Any:
    """A DeepSpeed engine over the spec's model, on the process group Ray Train set up."""
    deepspeed.init_distributed()  # adopts the process group Ray Train created
    torch.manual_seed(spec.train.seed)  # identical initial weights on every rank and restart
    model = build_model(spec.model, _checkpoint_fn() if spec.parallelism.activation_checkpointing else None)
    config = ds_config(spec, world_size, on_gpu=device.type == "cuda", load_universal=load_universal)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _checkpoint_fn() -> Any:
    """DeepSpeed's activation checkpointing, the form DeepSpeed documents for ZeRO-3 (whose
    parameters are gathered and released around each block, recomputation included)."""
    deepspeed.checkpointing.configure(None, partition_activations=False, checkpoint_in_cpu=False)
    return deepspeed.checkpointing.checkpoint


def param_count(engine: Any) -> int:
    """Parameters of the whole model (ZeRO-3 shards them; ds_numel is the full size)."""
    seen: set[int] = set()
    total = 0
    for p in engine.module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += getattr(p, "ds_numel", p.numel())
    return total
