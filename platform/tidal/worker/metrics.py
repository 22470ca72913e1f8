"""Throughput and MFU. FLOPs per token for a decoder: 6N + 12*L*d*T (Kaplan et al. / PaLM appendix B).

6N covers the forward and backward matmuls over all N parameters; 12*L*d*T adds the attention
score and value products, which scale with context length T and have no parameters.
"""

from __future__ import annotations

import time

from tidal.spec.job import ModelSpec

# Dense peak FLOP/s per device by precision. GPU figures are vendor specs without sparsity;
# the CPU figure was measured with torch matmuls on 2 cores (see docs/benchmarks.md).
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12},
    "CPU": {"bf16": 856e9, "fp16": 856e9, "fp32": 191e9},
}


def flops_per_token(n_params: int, model: ModelSpec) -> float:
    return 6.0 * n_params + 12.0 * model.n_layer * model.d_model * model.seq_len


def device_peak_flops(device_name: str, precision: str) -> float:
    for key, table in PEAK_FLOPS.items():
        if key in device_name.upper():
            return table[precision]
    return PEAK_FLOPS["CPU"][precision]


class StepTimer:
    """Wall time per optimizer step, averaged over the steps since the last `take()`."""

    def __init__(self) -> None:
        self.total = 0.0
        self.steps = 0
        self._t0 = 0.0

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        self.total += time.perf_counter() - self._t0
        self.steps += 1

    def take(self) -> float:
        mean = self.total / max(self.steps, 1)
        self.total, self.steps = 0.0, 0
        return mean
