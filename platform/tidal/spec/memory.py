"""Memory per worker (GPU) and per node (host) before a run, for `tidal validate --deepspeed`.

Pure arithmetic on the spec: no torch, no deepspeed (the CLI must start without them; importing
DeepSpeed's estimators imports torch). Two parts:

- Model states (16-bit weights, gradients, fp32 master weights, Adam moments): DeepSpeed's own
  estimators for ZeRO-2 and ZeRO-3, `estimate_zero2_model_states_mem_needs`
  (deepspeed/runtime/zero/stage_1_and_2.py) and `estimate_zero3_model_states_mem_needs`
  (stage3.py), copied formula for formula (DeepSpeed 0.19.8; tests/test_memory.py compares them
  with DeepSpeed's for several shapes). DeepSpeed has none for ZeRO-0/1 or for fp32 training;
  those use the same byte accounting, written out in `_other_states`.
- Activations of the built-in GPT for one micro-batch (below).

An estimate, not a promise: it leaves out the allocator's fragmentation, communication buckets,
temporary buffers and the CUDA context (about 0.5-1 GB).
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.spec.batch import micro_batch_bound
from tidal.spec.job import JobSpec
from tidal.spec.sections import ModelSpec, ParallelismSpec

BUFFER_FACTOR = 1.5  # DeepSpeed's additional_buffer_factor for host memory
WORKERS_PER_NODE = 8  # host memory per node assumes up to this many workers (GPUs) on one node
GIB = 2**30


def gpt_params(model: ModelSpec) -> tuple[int, int]:
    """(parameters, parameters of the largest module) of the built-in GPT (tidal.worker.models.gpt).

    Tied embedding V*d, positions T*d, per block two LayerNorms (4d), qkv (3d^2 + 3d), proj
    (d^2 + d) and the MLP (8d^2 + 5d), then the final LayerNorm (2d). The largest module, the
    one ZeRO-3 gathers whole, is counted as DeepSpeed's `model_to_params` counts it: the
    parameters a module holds itself.
    """
    v, t, d, n = model.vocab_size, model.seq_len, model.d_model, model.n_layer
    total = v * d + t * d + n * (12 * d * d + 13 * d) + 2 * d
    return total, max(v * d, t * d, 4 * d * d + 4 * d)


def zero2_states(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1, cpu_offload: bool = True,
                 additional_buffer_factor: float = BUFFER_FACTOR) -> tuple[int, int]:
    """(host bytes per node, GPU bytes per GPU): DeepSpeed's estimate_zero2_model_states_mem_needs."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        # 2: 16-bit params; 18: 16-bit grads 2 + fp32 grads 4 + fp32 params 4 + Adam moments 8, partitioned
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def zero3_states(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                 cpu_offload: bool = True, cpu_offload_params: bool = True, zero_init: bool = True,
                 additional_buffer_factor: float = BUFFER_FACTOR) -> tuple[int, int, int]:
    """(host bytes per node, GPU bytes per GPU, largest layer's bytes): DeepSpeed's
    estimate_zero3_model_states_mem_needs."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
            if zero_init:
                cpu_mem = total_params * 18 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 18 * gpus_factor) * additional_buffer_factor
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
            if zero_init:
                cpu_mem = total_params * 16 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 16 * gpus_factor) * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest_layer_memory


def model_states(params: int, largest: int, par: ParallelismSpec, per_node: int, nodes: int) -> tuple[int, int]:
    """(host bytes per node, device bytes per worker) of weights, gradients and optimizer state
    (AdamW: two fp32 moments per parameter). Tidal builds the whole model on every worker before
    DeepSpeed partitions it (no zero.Init), which DeepSpeed's ZeRO-3 estimate calls zero_init=False."""
    offload_opt, offload_params = par.offload_optimizer != "none", par.offload_params != "none"
    if par.precision == "fp32" or par.zero_stage < 2:
        return _other_states(params, largest, par, per_node, nodes)
    if par.zero_stage == 2:
        return zero2_states(params, per_node, nodes, cpu_offload=offload_opt)
    host, device, _ = zero3_states(params, largest, per_node, nodes, cpu_offload=offload_opt,
                                   cpu_offload_params=offload_params, zero_init=False)
    return host, device


def _other_states(params: int, largest: int, par: ParallelismSpec, per_node: int, nodes: int) -> tuple[int, int]:
    """What DeepSpeed has no estimator for: ZeRO-0/1, and fp32 training (no 16-bit copies).

    Bytes per parameter, as DeepSpeed's ZeRO-2 estimate counts them: weights w (2 in 16-bit, 4
    in fp32), gradients g (16-bit 2 + fp32 4, or fp32 4), optimizer o (fp32 master 4 + moments 8,
    or moments 8). ZeRO-1 partitions o, ZeRO-2 o and g, ZeRO-3 all three (plus its gather of
    the largest layer, 4 bytes a parameter, as DeepSpeed's estimate has it). An offloaded
    optimizer leaves only the weights (and, for ZeRO-3, their partition) on the device. Host
    memory: DeepSpeed's figures for the same stage (fp32 either way), or, for ZeRO-0/1, each
    worker's fp32 copy of the model at build time.
    """
    n = per_node * nodes
    w, g, o = (4, 4, 8) if par.precision == "fp32" else (2, 6, 12)
    stage, offload_opt, offload_params = par.zero_stage, par.offload_optimizer != "none", par.offload_params != "none"
    if stage == 3:
        device = 4 * largest + ((0 if offload_params else w) + (0 if offload_opt else g + o)) * params // n
    elif offload_opt:  # ZeRO-1/2 offload the gradients' fp32 partition and the optimizer
        device = w * params
    else:
        device = w * params + g * params // (n if stage == 2 else 1) + o * params // (n if stage else 1)
    if stage == 3:
        host = zero3_states(params, largest, per_node, nodes, cpu_offload=offload_opt,
                            cpu_offload_params=offload_params, zero_init=False)[0]
    elif stage == 2 or offload_opt:
        host = zero2_states(params, per_node, nodes, cpu_offload=offload_opt)[0]
    else:
        host = int(params * 4 * per_node * BUFFER_FACTOR)
    return host, device


def activation_bytes(model: ModelSpec, micro_batch: int, precision: str, checkpointing: bool,
                     fused_attention: bool) -> int:
    """Activations one worker keeps for the backward pass of one micro-batch of the built-in GPT.

    Per transformer layer, in 16-bit: s*b*h*(34 + 5*a*s/h) bytes (Korthikanti et al. 2022,
    "Reducing Activation Recomputation in Large Transformer Models", section 4.1, without
    tensor or sequence parallelism). The 5*a*s/h term is the attention scores, softmax and its
    dropout mask; fused attention (torch's SDPA flash / memory-efficient kernels on a GPU)
    stores none of it. With activation checkpointing a layer keeps only its input, 2*s*b*h,
    and one layer's activations live at a time while it is recomputed. fp32 doubles it all.
    Not in the paper's per-layer figure: the logits, s*b*V at the training precision plus the
    fp32 copy the loss takes of them (tidal.worker.models.gpt.lm_loss).
    """
    s, b, h, a, n = model.seq_len, micro_batch, model.d_model, model.n_head, model.n_layer
    per_layer = s * b * h * (34 + (0 if fused_attention else 5 * a * s / h))
    layers = n * 2 * s * b * h + per_layer if checkpointing else n * per_layer
    width = 4 if precision == "fp32" else 2
    return int(layers * width / 2 + s * b * model.vocab_size * (width + 4))


@dataclass(frozen=True)
class MemoryEstimate:
    world: int
    per_node: int  # workers per node assumed for the host figure
    states: int  # bytes per worker (device)
    activations: int  # bytes per worker (device)
    host_per_node: int

    @property
    def device_total(self) -> int:
        return self.states + self.activations

    def record(self) -> dict[str, float]:
        """In GB (10^9 bytes), as the GPU benchmark reports its measured peak."""
        return {"world": self.world, "model_states_gb": self.states / 1e9, "activations_gb": self.activations / 1e9,
                "device_total_gb": self.device_total / 1e9, "host_per_node_gb": self.host_per_node / 1e9,
                "workers_per_node": self.per_node}


def estimate(spec: JobSpec, world: int, per_node: int | None = None) -> MemoryEstimate:
    """The estimate for the built-in GPT at `world` workers (see `why_not_estimated` first)."""
    par = spec.parallelism
    per_node = per_node or min(world, WORKERS_PER_NODE)
    nodes = -(-world // per_node)
    params, largest = gpt_params(spec.model)
    host, states = model_states(params, largest, par, per_node, nodes)
    acts = activation_bytes(spec.model, micro_batch_bound(spec), par.precision, par.activation_checkpointing,
                            fused_attention=spec.scaling.gpus_per_worker > 0)
    return MemoryEstimate(world, per_node, states, acts, host)


def why_not_estimated(spec: JobSpec) -> str | None:
    m = spec.model
    if m.hf_config is not None or m.hf_pretrained is not None or m.builder:
        return "a Hugging Face or custom model's shape is known only once it is built"
    if spec.parallelism.pipeline_stages > 1:
        return "a pipeline stage holds only its own layers (not estimated per stage)"
    return None


def memory_table(spec: JobSpec, worlds: list[int]) -> list[str]:
    """The lines `tidal validate --deepspeed` prints."""
    why = why_not_estimated(spec)
    if why:
        return [f"# Memory estimate: none ({why})"]
    where = "GPU" if spec.scaling.gpus_per_worker else "worker (CPU)"
    rows = [estimate(spec, w) for w in worlds]
    lines = [f"# Memory estimate per {where}: model states (DeepSpeed's ZeRO estimators, AdamW) + activations "
             f"(Korthikanti et al. 2022) of one micro-batch of {micro_batch_bound(spec)}",
             f"# {'world':>5} {'states':>10} {'activations':>12} {'total':>10} {'host/node':>10}  workers/node"]
    for r in rows:
        lines.append(f"# {r.world:>5} {_size(r.states):>10} {_size(r.activations):>12} {_size(r.device_total):>10} "
                     f"{_size(r.host_per_node):>10}  {r.per_node}")
    return lines


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB // 10 else f"{n / 2**20:.1f} MiB"
