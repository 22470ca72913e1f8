"""Builds a worker's DeepSpeed engine: spec -> ds_config -> deepspeed.initialize()."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import deepspeed
import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

from tidal.errors import CheckpointError
from tidal.spec.deepspeed import ds_config
from tidal.spec.job import JobSpec
from tidal.spec.schedule import DEEPSPEED_SCHEDULES, lr_factor
from tidal.spec.user_refs import resize_refusal
from tidal.worker.checkpoint.route import Route
from tidal.worker.device import arch_list_for_deepspeed, skip_cpu_shm_allreduce
from tidal.worker.models import build_model, gpt

# DeepSpeed logs every config key at INFO on every rank; keep its warnings only.
logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


def build_engine(spec: JobSpec, world_size: int, device: torch.device, route: Route | None = None) -> Any:
    """A DeepSpeed engine over the spec's model, on the process group Ray Train set up, ready for
    the way `route` loads the checkpoint it resumes from (tidal.worker.checkpoint.route; None: none)."""
    if device.type == "cpu":
        skip_cpu_shm_allreduce()  # before the communication backend comes up
    deepspeed.init_distributed()  # adopts the process group Ray Train created
    torch.manual_seed(spec.train.seed)  # identical initial weights on every rank and restart
    ckpt = _checkpoint_fn() if spec.parallelism.activation_checkpointing else None
    model = _pipeline(spec) if spec.parallelism.pipeline_stages > 1 else build_model(spec.model, ckpt)
    if route is not None and route.resized and (why := resize_refusal(spec, world_size)):
        raise CheckpointError(why)
    params = [p for p in model.parameters() if p.requires_grad]
    config = ds_config(spec, world_size, on_gpu=device.type == "cuda", load_universal=bool(route and route.universal),
                       trainable_params=sum(p.numel() for p in params))
    if device.type == "cuda":
        arch_list_for_deepspeed()  # before FusedAdam's JIT build
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=config,
                                      lr_scheduler=_torch_schedule(spec))
    if (c := spec.parallelism.compile) is not None:
        # In place (nn.Module.compile): the state dict keeps its keys, so checkpoints load into an
        # eager engine and back. Nothing compiles until the first forward (the first step).
        engine.compile(backend=c.backend, compile_kwargs=c.kwargs())
    return engine


def _torch_schedule(spec: JobSpec) -> Any:
    """For schedules DeepSpeed lacks: a callable DeepSpeed gives its optimizer to; it then steps the
    scheduler with the optimizer and keeps its state in every checkpoint (exact resume)."""
    t = spec.train
    if t.schedule in DEEPSPEED_SCHEDULES:
        return None
    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: lr_factor(t, done))


def _pipeline(spec: JobSpec) -> PipelineModule:
    """The built-in GPT as DeepSpeed pipeline stages; every stage builds only its own layers.

    Layer seeds match `gpt.GPT`'s, so the pipeline starts from the same weights as the whole
    model; the output head is the token embedding again (tied across the first and last stage).
    """
    p, cfg = spec.parallelism, spec.model
    # DeepSpeed broadcasts the tied embedding in place at start-up, which torch flags in every
    # backward; the gradients are right (the pipeline's losses equal the whole model's, tested).
    warnings.filterwarnings("ignore", message="c10d::broadcast_: an autograd kernel was not registered")
    specs: list[LayerSpec] = [
        TiedLayerSpec("tok", cls, *args) if cls is gpt.TokenEmbedding else LayerSpec(cls, *args)
        for cls, args in gpt.layers(cfg)
    ]
    specs.append(TiedLayerSpec("tok", gpt.TokenEmbedding, cfg, forward_fn=gpt.lm_head))
    return PipelineModule(specs, num_stages=p.pipeline_stages, loss_fn=gpt.lm_loss, seed_layers=True,
                          seed_fn=_seed_layer, base_seed=spec.train.seed, partition_method=p.pipeline_partition,
                          activation_checkpoint_interval=int(p.activation_checkpointing),
                          # Recompute blocks only: the embedding's input is token ids, which carry
                          # no gradient, so a recomputed embedding would cut the backward pass.
                          checkpointable_layers=["Block"])


def _seed_layer(seed: Any) -> None:
    # DeepSpeed's default seeds Python's `random` too, which refuses the numpy integer that
    # partition_method="parameters" produces for the layer index.
    torch.manual_seed(int(seed))


def is_pipeline(engine: Any) -> bool:
    return hasattr(engine, "train_batch")


def data_parallel_rank(engine: Any, rank: int, world_size: int) -> tuple[int, int]:
    """(replica index, replicas): the slice of each global batch this worker feeds. The stages
    of one pipeline replica read the same slice (the first its inputs, the last its targets)."""
    if not is_pipeline(engine):
        return rank, world_size
    return engine.grid.get_data_parallel_id(), engine.grid.get_data_parallel_world_size()


def _checkpoint_fn() -> Any:
    """DeepSpeed's activation checkpointing, the form DeepSpeed documents for ZeRO-3 (whose
    parameters are gathered and released around each block, recomputation included)."""
    deepspeed.checkpointing.configure(None, partition_activations=False, checkpoint_in_cpu=False)
    return deepspeed.checkpointing.checkpoint


def param_count(engine: Any, spec: JobSpec) -> int:
    """Parameters of the whole model (ZeRO-3 shards them; ds_numel is the full size)."""
    if is_pipeline(engine):  # a stage holds only its layers: count the whole model, without memory
        with torch.device("meta"):
            return sum(p.numel() for p in gpt.GPT(spec.model, seed=0).parameters())
    seen: set[int] = set()
    total = 0
    for p in engine.module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += getattr(p, "ds_numel", p.numel())
    return total
