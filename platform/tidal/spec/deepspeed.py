"""The DeepSpeed config, derived from the JobSpec (pure: no deepspeed import, so `validate` can print it)."""

from __future__ import annotations

from typing import Any

from tidal.spec.batch import grad_accum_steps, micro_batch_bound
from tidal.spec.job import JobSpec
from tidal.spec.passthrough import merged
from tidal.spec.schedule import DEEPSPEED_SCHEDULES

# DeepSpeed's default gradient bucket, in elements (deepspeed.runtime.zero.config).
DEEPSPEED_REDUCE_BUCKET = 500_000_000
# DeepSpeed's default ZeRO-3 sub-group, in elements (deepspeed.runtime.zero.config).
DEEPSPEED_SUB_GROUP = 1_000_000_000


def ds_config(spec: JobSpec, world_size: int, on_gpu: bool, load_universal: bool = False,
              trainable_params: int | None = None) -> dict[str, Any]:
    """`trainable_params`: the built model's (its pipeline stage's) trainable parameter count,
    where the caller has the model; it sizes ZeRO's gradient bucket (`_reduce_bucket`)."""
    t, p = spec.train, spec.parallelism
    zero: dict[str, Any] = {"stage": p.zero_stage, **_reduce_bucket(p.zero_stage, trainable_params)}
    if p.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(p.offload_optimizer, p.nvme_path, on_gpu)
    if p.offload_params != "none":
        zero["offload_param"] = _offload(p.offload_params, p.nvme_path, on_gpu)
    # Without a GPU there is nothing to offload from, and DeepSpeed's CPU Adam is a JIT build
    # (about a minute); torch's AdamW does the same work there.
    cpu_torch_adam = not on_gpu
    derived = {
        "train_batch_size": t.global_batch,
        # auto: the workers build their engine with the size they chose; elsewhere (the run's
        # deepspeed_config.json, tidal validate) the largest it may be.
        "train_micro_batch_size_per_gpu": micro_batch_bound(spec),
        "gradient_accumulation_steps": grad_accum_steps(t.global_batch, micro_batch_bound(spec),
                                                        p.data_parallel_size(world_size)),
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": p.precision == "bf16"},
        "fp16": {"enabled": p.precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        "optimizer": _optimizer(spec, cpu_torch_adam),
        # DeepSpeed has no linear-to-a-floor or WSD schedule: the engine passes a torch one for those.
        **({"scheduler": _scheduler(spec)} if t.schedule in DEEPSPEED_SCHEDULES else {}),
        # ZeRO checks the optimizer's class; torch's SGD is not on its list, and works.
        **({"zero_allow_untested_optimizer": True} if t.optimizer.name == "SGD" and p.zero_stage else {}),
        "checkpoint": {"load_universal": load_universal},
        **({"zero_force_ds_cpu_optimizer": False} if cpu_torch_adam and p.offload_optimizer != "none" else {}),
        **({"pipeline": _pipeline(spec)} if p.pipeline_stages > 1 else {}),
        "steps_per_print": 10**9,  # Tidal prints its own progress lines
        "wall_clock_breakdown": False,
    }
    return merged(derived, p.deepspeed)  # keys Tidal derives were refused at load (tidal.spec.passthrough)


def sub_group_size(spec: JobSpec) -> int | None:
    """The elements a ZeRO-3 optimizer sub-group closes at (`parallelism.deepspeed`'s
    `zero_optimization.sub_group_size`, else DeepSpeed's default): it cuts a ZeRO-3 checkpoint's
    partitions, so a checkpoint cut at another loads only through a conversion
    (tidal.worker.checkpoint.route). None for other stages."""
    if spec.parallelism.zero_stage != 3:
        return None
    zero = (spec.parallelism.deepspeed or {}).get("zero_optimization") or {}
    return int(zero.get("sub_group_size", DEEPSPEED_SUB_GROUP))


def _reduce_bucket(zero_stage: int, trainable_params: int | None) -> dict[str, int]:
    """ZeRO-1 and -2 allocate a new gradient bucket of `reduce_bucket_size` elements at every
    micro-step (`setup_buckets`; two with overlap_comm). DeepSpeed's default, 5e8, suits models
    larger than that; for a smaller one the bucket is a 2 GB fp32 allocation per step that holds
    a few MB: on CPU a fresh mapping and its page faults every step, on a GPU up to 2 GB of memory
    the caching allocator keeps reserved. A bucket the size of the model holds every gradient, as
    the default does, so the reductions are the same ones. `parallelism.deepspeed` may still set
    it. ZeRO-3 allocates its bucket once: left as DeepSpeed sets it."""
    if zero_stage not in (1, 2) or not trainable_params or trainable_params >= DEEPSPEED_REDUCE_BUCKET:
        return {}
    return {"reduce_bucket_size": trainable_params}


def _optimizer(spec: JobSpec, cpu_torch_adam: bool) -> dict[str, Any]:
    t = spec.train
    name, params = t.optimizer.name, {"lr": t.lr, "weight_decay": t.weight_decay}
    if name in ("AdamW", "Adam"):
        params |= {"betas": [0.9, 0.95], "eps": 1e-8, **({"torch_adam": True} if cpu_torch_adam else {})}
        if name == "Adam":
            params["adam_w_mode"] = False  # DeepSpeed's "Adam" is AdamW unless told otherwise
    elif name == "Lion":
        params["betas"] = [0.9, 0.99]
    return {"type": name, "params": {**params, **t.optimizer.args}}


def _scheduler(spec: JobSpec) -> dict[str, Any]:
    t = spec.train
    warmup = max(t.warmup_plan()[0], 1)  # DeepSpeed refuses 0 warmup steps
    if t.schedule == "constant":
        return {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": t.lr, "warmup_num_steps": warmup, "warmup_type": "linear"},
        }
    return {
        "type": "WarmupCosineLR",
        "params": {
            "total_num_steps": t.steps,
            "warmup_num_steps": warmup,
            "warmup_min_ratio": 0.0,
            "cos_min_ratio": t.min_lr_ratio,
            "warmup_type": "linear",
        },
    }


def _pipeline(spec: JobSpec) -> dict[str, Any]:
    """Shown by `tidal validate --deepspeed`; the engine reads the same fields from the spec."""
    p = spec.parallelism
    return {"stages": p.pipeline_stages, "partition": p.pipeline_partition,
            "activation_checkpoint_interval": int(p.activation_checkpointing)}


def _offload(device: str, nvme_path: str | None, on_gpu: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"device": device, "pin_memory": on_gpu}
    if device == "nvme":
        out["nvme_path"] = nvme_path
    return out
