"""How one fixed global batch is split for each world size (pure functions, no torch)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidal.spec.job import JobSpec


def grad_accum_steps(global_batch: int, micro_batch: int, world_size: int) -> int:
    """Micro-steps per optimizer step so that micro_batch * world_size * accum == global_batch."""
    per_step = micro_batch * world_size
    if global_batch % per_step:
        raise ValueError(
            f"global_batch {global_batch} is not divisible by micro_batch {micro_batch} x "
            f"world size {world_size}"
        )
    return global_batch // per_step


def bad_world_sizes(global_batch: int, micro_batch: int, lo: int, hi: int) -> list[int]:
    """World sizes in [lo, hi] that cannot keep `global_batch` constant."""
    return [ws for ws in range(lo, hi + 1) if global_batch % (micro_batch * ws)]


def rank_slice(global_batch: int, world_size: int, rank: int) -> slice:
    """The part of a step's global batch (indexed 0..global_batch-1) that `rank` trains on.

    A step's samples are fixed by the step number alone; ranks only split them. That is what
    makes a run at any world size see exactly the samples of an undisturbed run.
    """
    per_rank = global_batch // world_size
    return slice(rank * per_rank, (rank + 1) * per_rank)


def micro_batch_candidates(global_batch: int, lo: int, hi: int) -> list[int]:
    """Micro-batches (ascending) that keep `global_batch` fixed at every data-parallel size in
    [lo, hi]: what `train.micro_batch: auto` chooses among, so that a resize never needs another."""
    per_rank = global_batch // hi
    return [m for m in range(1, per_rank + 1) if not bad_world_sizes(global_batch, m, lo, hi)]


def largest_fitting(candidates: list[int], fits: Callable[[int], bool]) -> int | None:
    """The largest candidate for which `fits` holds, by binary search (memory grows with the
    micro-batch, so if one fits every smaller one does); None if even the smallest does not.
    The largest is tried first: on a device with room to spare one try decides."""
    if not candidates:
        return None
    if fits(candidates[-1]):
        return candidates[-1]
    lo, hi, best = 0, len(candidates) - 2, None  # candidates[hi + 1] does not fit
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(candidates[mid]):
            best, lo = candidates[mid], mid + 1
        else:
            hi = mid - 1
    return best


def halved(candidates: list[int], micro_batch: int) -> int | None:
    """After an out-of-memory error at `micro_batch`: the largest candidate at most half of it."""
    smaller = [m for m in candidates if m <= micro_batch // 2]
    return smaller[-1] if smaller else None


def micro_batch_bound(spec: JobSpec) -> int:
    """The spec's micro-batch; for `auto`, the largest it may choose (an upper bound, for the
    driver's DeepSpeed config and memory estimate; the workers choose the real one)."""
    t, s = spec.train, spec.scaling
    if t.micro_batch != "auto":
        return t.micro_batch
    stages = spec.parallelism.pipeline_stages
    found = micro_batch_candidates(t.global_batch, max(1, s.min_workers // stages), max(1, s.max_workers // stages))
    return found[-1] if found else 1
