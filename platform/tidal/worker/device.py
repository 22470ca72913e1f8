"""Where a worker's tensors live. The one place that chooses CUDA or CPU.

Ray reports `cuda:N` on nodes that only *declare* GPUs (fake GPUs in tests, or a broken driver),
so trust torch's own view of the hardware instead of `ray.train.torch.get_device()`.
"""

from __future__ import annotations

import logging
import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def torch_device() -> torch.device:
    import torch  # here, not at the top: the driver imports this module for dist_backend

    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def skip_cpu_shm_allreduce() -> None:
    """Keep DeepSpeed from JIT-building its shared-memory all-reduce op in a CPU worker.

    DeepSpeed builds it (`deepspeed.comm.torch.build_shm_op`) whenever its communication backend
    comes up on CPU, under torch's build lock (`torch.utils.file_baton.FileBaton`: a file with no
    owner and no staleness check). A worker killed during that build, which elastic training
    does, leaves the lock, and every later worker on the node waits for it forever. The op
    serves only DeepSpeed's inference all-reduce: training's collectives go through gloo, so a
    training worker loses nothing without it (and skips seconds of build per start). On GPU
    DeepSpeed does not build it.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # what build_shm_op checks first


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


ARCH_LIST_ENV = "TORCH_CUDA_ARCH_LIST"


def plain_arch_list(value: str) -> str:
    """`value` without architecture-variant suffixes: "9.0a;10.0f+PTX" -> "9.0;10.0+PTX"."""
    entries = value.replace(" ", ";").split(";")
    plain = [re.sub(r"^(\d+\.\d+)[a-z]+", r"\1", e.strip()) for e in entries if e.strip()]
    return ";".join(dict.fromkeys(plain))  # "9.0;9.0a" would otherwise build 9.0 twice


def arch_list_for_deepspeed() -> None:
    """Let DeepSpeed JIT-build its CUDA ops (FusedAdam at the first engine) where
    TORCH_CUDA_ARCH_LIST names architecture variants ("9.0a" for Hopper), as some CUDA images
    set it: DeepSpeed 0.19 parses each entry as numbers and fails with "invalid literal for
    int() with base 10: '0a'" (deepspeedai/DeepSpeed#7589, fix pending in #8619). Its ops use
    no variant-specific instructions, so this worker builds for the plain architecture."""
    value = os.environ.get(ARCH_LIST_ENV, "")
    if not re.search(r"\d+\.\d+[a-z]", value):  # no variant: DeepSpeed parses it as it is
        return
    plain = plain_arch_list(value)
    log.warning("%s=%r: DeepSpeed cannot parse architecture variants; this worker uses %r "
                "(deepspeedai/DeepSpeed#8619)", ARCH_LIST_ENV, value, plain)
    os.environ[ARCH_LIST_ENV] = plain
