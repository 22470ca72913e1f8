"""Host-memory copies of the state dicts a checkpoint saves, reused from save to save.

Each checkpoint file's tensors are copied into views of one flat host block, laid out in the
order DeepSpeed hands them over; the next save of the same file copies into the same block when
the layout (shapes and dtypes, in order) is unchanged, as it is from step to step. So a save
after the first pays a copy, not an allocation and page faults, and host memory holds one copy
of the state however many checkpoints are taken.

On a GPU the block is page-locked (`cudaHostRegister`, as PyTorch DCP's async stager does) for
its exact size, so the device-to-host copies are asynchronous DMA. Not `pin_memory=True`: torch's
pinned allocator rounds every block up to a power of two (a 10.5 GB optimizer partition would
lock 16 GB) and allocates each tensor separately.
"""

from __future__ import annotations

import copy
import math
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

ALIGN = 64  # bytes: every view starts on a cache line, so any dtype's view is aligned


def tensors_in(state: Any) -> list[torch.Tensor]:
    """The distinct tensors in a nested state, in the order a depth-first walk meets them (a
    tensor that appears twice, as tied weights do, is listed once)."""
    found: dict[int, torch.Tensor] = {}

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            found.setdefault(id(x), x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list | tuple):
            for v in x:
                walk(v)

    walk(state)
    return list(found.values())


def rebuilt(state: Any, replace: dict[int, torch.Tensor]) -> Any:
    """`state` with each tensor swapped for `replace[id(tensor)]`; containers are rebuilt with
    their own class (OrderedDict, DeepSpeed's), other leaves kept by reference."""
    if isinstance(state, torch.Tensor):
        return replace[id(state)]
    if isinstance(state, dict):
        out = copy.copy(state)
        for k, v in state.items():
            out[k] = rebuilt(v, replace)
        return out
    if isinstance(state, list):
        return [rebuilt(v, replace) for v in state]
    if isinstance(state, tuple):
        items = [rebuilt(v, replace) for v in state]
        return type(state)(*items) if hasattr(state, "_fields") else type(state)(items)
    return state


Layout = list[tuple[tuple[int, ...], torch.dtype]]


@dataclass
class HostBlock:
    """One flat host allocation with a view per tensor of a layout."""

    layout: Layout
    pinned: bool
    views: list[torch.Tensor] = field(init=False)

    def __post_init__(self) -> None:
        spans, total = [], 0  # (offset, bytes) of each tensor in the block
        for shape, dtype in self.layout:
            nbytes = math.prod(shape) * dtype.itemsize
            spans.append((total, nbytes))
            total += -(-nbytes // ALIGN) * ALIGN
        flat = torch.empty(max(total, ALIGN), dtype=torch.uint8)
        if self.pinned:
            _page_lock(flat)
        self.views = [flat[o:o + n].view(dtype).view(shape)
                      for (o, n), (shape, dtype) in zip(spans, self.layout, strict=True)]


def _page_lock(flat: torch.Tensor) -> None:
    """Lock `flat`'s pages for DMA until its storage is freed (cudaHostRegister; torch's
    `torch.cuda._pin_memory_utils` does the same for DCP, privately)."""
    cudart, ptr, size = torch.cuda.cudart(), flat.data_ptr(), flat.numel()
    if (err := int(cudart.cudaHostRegister(ptr, size, 0))) != 0:
        raise RuntimeError(f"could not page-lock {size / 1e9:.1f} GB of host memory for a checkpoint snapshot "
                           f"(cudaHostRegister error {err}); is the node short of memory or the locked-memory limit low?")
    unlock = weakref.finalize(flat.untyped_storage(), cudart.cudaHostUnregister, ptr)
    unlock.atexit = False  # at exit the CUDA context may already be gone


class Buffers:
    """Host copies of state dicts, one block per checkpoint file name, reused from save to save."""

    def __init__(self) -> None:
        self.files: dict[str, HostBlock] = {}

    def take(self, name: str, state: Any) -> Any:
        """A copy of `state` in host memory that later training does not change: the same
        containers and leaves, every tensor in this file's block (tied tensors stay shared)."""
        tensors = tensors_in(state)
        layout = [(tuple(t.shape), t.dtype) for t in tensors]
        on_gpu = any(t.is_cuda for t in tensors)
        block = self.files.get(name)
        if block is None or block.layout != layout or block.pinned != on_gpu:
            self.files.pop(name, None)  # the old block goes before the new one is allocated
            block = HostBlock(layout, pinned=on_gpu)
        for src, dst in zip(tensors, block.views, strict=True):
            dst.copy_(src.detach(), non_blocking=src.is_cuda)
        if on_gpu:
            torch.cuda.synchronize()  # the copies must have landed before training moves on
        self.files[name] = block
        return rebuilt(state, {id(t): v for t, v in zip(tensors, block.views, strict=True)})
