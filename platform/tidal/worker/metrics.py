"""Throughput and MFU. FLOPs per token for a decoder: 6N + 12*L*d*T (Kaplan et al. / PaLM appendix B).

6N covers the forward and backward matmuls over all N parameters; 12*L*d*T adds the attention
score and value products, which scale with context length T and have no parameters.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress

import psutil
import torch

from tidal.spec.job import JobSpec
from tidal.spec.sections import ModelSpec
from tidal.worker.comms import CommClock

# Dense peak FLOP/s per device by precision: vendor specs without sparsity (fp32 without TF32,
# which torch leaves off by default). Looked up by the first key contained in the device's name
# as torch reports it (e.g. "NVIDIA H100 80GB HBM3" is the SXM part), so more specific keys come
# first. The CPU figures are per core, measured with torch matmuls on a 2-core machine
# (191 GFLOP/s fp32 and 856 GFLOP/s bf16 for both cores; see docs/benchmarks.md).
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "H100 PCIE": {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12},
    "H100 NVL": {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},  # SXM
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12},
}
CPU_PEAK_PER_CORE = {"bf16": 428e9, "fp16": 428e9, "fp32": 95.5e9}


def flops_per_token(n_params: int, model: ModelSpec) -> float:
    layers, width = model.n_layer, model.d_model
    if isinstance(model.hf_config, dict):  # a Hugging Face model's shape lives in its config
        layers = int(model.hf_config.get("num_hidden_layers", layers))
        width = int(model.hf_config.get("hidden_size", width))
    return 6.0 * n_params + 12.0 * layers * width * model.seq_len


def speed(spec: JobSpec, step_s: float, world: int, flops_per_tok: float, peak: float) -> dict[str, float]:
    """How fast one step went. Tokens and MFU only for language models: a user's dataset
    (data.dataset) holds samples of no known token count or FLOPs, and a made-up figure misleads."""
    t = spec.train
    out = {"samples_per_s": t.global_batch / step_s}
    if spec.data.dataset:
        return out
    tokens = t.global_batch * spec.model.seq_len
    return out | {"tokens_per_s": tokens / step_s, "tokens_per_s_per_worker": tokens / step_s / world,
                  "mfu": flops_per_tok * tokens / step_s / peak, "model_flops_per_token": flops_per_tok}


def worker_peak_flops(device: torch.device, precision: str, cpus: float, override_tflops: float | None) -> float:
    """Peak FLOP/s of one worker: the spec's override, else the GPU's table entry, else its CPU cores.

    A GPU missing from the table gives NaN (MFU then reads NaN) and a warning, never a CPU figure.
    """
    if override_tflops:
        return override_tflops * 1e12
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device), precision)
    return CPU_PEAK_PER_CORE[precision] * cpus


def gpu_peak_flops(name: str, precision: str) -> float:
    """Dense peak FLOP/s of the GPU torch calls `name` at `precision`; NaN, with a warning, if unknown."""
    upper = name.upper()
    for key, table in PEAK_FLOPS.items():
        if key in upper:
            return table[precision]
    warnings.warn(
        f"MFU: no peak FLOP/s known for GPU {name!r} (known: {', '.join(PEAK_FLOPS)}); MFU is reported as NaN. "
        f"Set scaling.peak_tflops_per_worker to its dense {precision} TFLOP/s.",
        RuntimeWarning, stacklevel=2,
    )
    return math.nan


class PhaseClock:
    """Wall time per optimizer step, split into phases, averaged since the last `take()`.

    On a GPU, kernels run asynchronously: phase times are only true if the device is synced at
    each boundary, which costs a little, so `sync` is set only on steps that will be logged.
    Those sampled steps also time the collectives (`comms`, see worker/comms.py): `comm_s` is
    the sampled step's time inside them, `comm_frac` its share of that step, and `busy_s` the
    rest (what a straggler has more of: the others wait inside collectives).

    The first `warmup_steps` steps of the clock's life (one attempt: a compiled model compiles
    there) count in no figure. A log interval made of warm-up steps only reports NaN times, so
    that no throughput is made of compile time; an interval that held some reports how many and
    their seconds (`warmup_steps`, `warmup_s`: the goodput account's start-up). The first timed step's own time is reported once
    as `first_step_s`: it carries the attempt's one-time costs (the first collectives' set-up,
    allocations), which the goodput account charges to start-up rather than to the step.
    """

    PHASES = ("data_wait_s", "forward_backward_s", "optimizer_s")

    def __init__(self, device: torch.device, comms: CommClock | None = None, warmup_steps: int = 0) -> None:
        self.cuda = device.type == "cuda"
        self.warmup_left = warmup_steps
        self._totals_at_start: dict[str, float] = {}
        self.sync = self.sample = False
        self.comms = comms if comms is not None else _comm_clock()
        self.totals = dict.fromkeys(self.PHASES, 0.0)
        self.step_total, self.steps = 0.0, 0
        self.warm_total, self.warm_steps = 0.0, 0  # the warm-up steps left out (the goodput account's start-up)
        self._step_t0 = 0.0
        self.sampled: tuple[float, float] | None = None  # (step seconds, comm seconds) of the last sample
        self.first: float | None = None  # the first timed step's seconds, until taken
        self._timed_any = False

    def start_step(self, sync: bool) -> None:
        self.sync, self.sample = sync and self.cuda, sync
        if sync and self.comms is not None:
            self.comms.start()
        self._totals_at_start = dict(self.totals)
        self._step_t0 = time.perf_counter()

    def end_step(self) -> None:
        self._barrier()
        took = time.perf_counter() - self._step_t0
        if self.warmup_left > 0:  # forget the step: its phases too
            self.warmup_left -= 1
            self.warm_total += took
            self.warm_steps += 1
            self.totals = self._totals_at_start
            if self.sample and self.comms is not None:
                self.comms.stop()
            return
        self.step_total += took
        self.steps += 1
        if not self._timed_any:
            self._timed_any, self.first = True, took
        if self.sample and self.comms is not None:
            self.sampled = (took, self.comms.stop())

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self._barrier()
        self.totals[name] += time.perf_counter() - t0

    def take(self) -> dict[str, float]:
        n = self.steps or math.nan  # nothing but warm-up since the last take: no figure, not 0 s
        out = {k: v / n for k, v in self.totals.items()} | {"step_time_s": self.step_total / n}
        if self.sampled is not None:
            step_s, comm_s = self.sampled
            out |= {"comm_s": comm_s, "comm_frac": comm_s / step_s if step_s > 0 else 0.0,
                    "busy_s": max(0.0, step_s - comm_s)}
        if self.first is not None:
            out["first_step_s"] = self.first
        if self.warm_steps:
            out |= {"warmup_steps": self.warm_steps, "warmup_s": self.warm_total}
        self.totals = dict.fromkeys(self.PHASES, 0.0)
        self.step_total, self.steps, self.sampled, self.first = 0.0, 0, None, None
        self.warm_total, self.warm_steps = 0.0, 0
        return out

    def _barrier(self) -> None:
        if self.sync:
            torch.cuda.synchronize()


def _comm_clock() -> CommClock | None:
    """DeepSpeed's comms timing once its process group is up (None before, e.g. in unit tests)."""
    with suppress(Exception):
        import deepspeed.comm

        if deepspeed.comm.is_initialized():
            return CommClock()
    return None


SAMPLING_INTERVAL_VAR = "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL"  # MLflow's own, for its system metrics
SAMPLING_INTERVAL_S = 10.0  # MLflow's default for the same


def sampling_interval_s(environ: Mapping[str, str] = os.environ) -> float:
    """How often host and device stats are read: MLflow's variable for its system metrics, which
    Tidal logs beside these (tracking/writer.py), so both follow one setting; read as MLflow
    reads it (unset or 0: the default)."""
    raw = environ.get(SAMPLING_INTERVAL_VAR, "")
    try:
        value = float(raw) if raw else 0.0
        return value if value > 0 else SAMPLING_INTERVAL_S
    except ValueError:
        warnings.warn(f"{SAMPLING_INTERVAL_VAR}={raw!r} is not a number of seconds; using "
                      f"{SAMPLING_INTERVAL_S:g}", stacklevel=2)
        return SAMPLING_INTERVAL_S


class Every:
    """Due at most once per `every_s` seconds (the first call is due; `force` is due and restarts
    the interval): for per-step work whose result changes over seconds, not steps."""

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s, self.clock = every_s, clock
        self.last = -math.inf

    def due(self, force: bool = False) -> bool:
        now = self.clock()
        if not force and now - self.last < self.every_s:
            return False
        self.last = now
        return True


class ResourceSampler:
    """Rank 0's host and device stats, read at most once per interval and logged at the log step
    that read them. Reading /proc (and NVML on a GPU) takes about 0.45 ms: a job logging every
    50 ms step spent 0.9% of rank 0's time there while the other ranks waited at the next
    collective (py-spy, docs/benchmarks.md). Memory and utilization move over seconds, not steps."""

    def __init__(self, device: torch.device, every_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.device = device
        self.every = Every(sampling_interval_s() if every_s is None else every_s, clock)

    def __call__(self) -> dict[str, float]:
        return resource_stats(self.device) if self.every.due() else {}


def resource_stats(device: torch.device) -> dict[str, float]:
    """Memory and utilization of this worker's host and device (rank 0 reports its own)."""
    vm = psutil.virtual_memory()
    stats = {
        "host_memory_used_frac": vm.percent / 100,
        "process_rss_gb": psutil.Process().memory_info().rss / 1e9,
        "cpu_util_frac": psutil.cpu_percent(interval=None) / 100,
    }
    if device.type == "cuda":
        stats["gpu_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    return stats | gpu_stats(device)


def gpu_stats(device: torch.device) -> dict[str, float]:
    """The device's own view (NVML through torch): utilization, power, memory in use by anyone.

    NVML comes with the `nvidia-ml-py` package; where it is missing, or on a CPU worker, the
    values it gives are left out and the rest is still reported."""
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    stats = {"gpu_memory_used_gb": (total - free) / 1e9, "gpu_memory_used_frac": (total - free) / total}
    with suppress(Exception):  # no pynvml: no utilization or power
        stats["gpu_util_frac"] = torch.cuda.utilization(device) / 100
        stats["gpu_power_w"] = torch.cuda.power_draw(device) / 1000  # NVML reports milliwatts
    return stats


LOSS_TRACE_ENV = "TIDAL_LOSS_TRACE"


def trace_loss(step: int, loss: float, world: int) -> None:
    """For chaos benchmarks and tests: append every log step's loss, in every life of the job, to
    the file TIDAL_LOSS_TRACE names (rank 0 calls it). MLflow keeps a step's first value only, so
    without this a replayed step that trained differently after a restart would go unseen."""
    path = os.environ.get(LOSS_TRACE_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f'{{"step": {step}, "loss": {loss!r}, "world": {world}, "ts": {time.time():.3f}}}\n')
