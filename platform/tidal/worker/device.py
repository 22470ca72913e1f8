"""Where a worker's tensors live. The one place that chooses CUDA or CPU.

Ray reports `cuda:N` on nodes that only *declare* GPUs (fake GPUs in tests, or a broken driver),
so trust torch's own view of the hardware instead of `ray.train.torch.get_device()`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def torch_device() -> torch.device:
    import torch  # here, not at the top: the driver imports this module for dist_backend

    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def dist_backend(gpus_per_worker: int) -> str:
    """torch.distributed backend for Ray's TorchConfig (driver side, chosen from the spec).

    With GPUs, gloo still carries any CPU tensors, and NCCL is only brought up for CUDA ones,
    so a node that declares GPUs it does not have still trains (on CPU, over gloo).
    """
    import torch.distributed as dist  # the driver's torch; a CPU-only build has no NCCL to offer

    return "cpu:gloo,cuda:nccl" if gpus_per_worker > 0 and dist.is_nccl_available() else "gloo"


def seed_step(device: torch.device, seed: int) -> None:
    """Seed the generators this worker's step draws from (dropout). `torch.manual_seed` does the
    same for every device type torch knows, through a TorchDynamo wrapper: about 80 us a call
    on CPU, 1% of a small model's step when it runs every step."""
    import torch

    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)  # the current device: the one this worker uses
