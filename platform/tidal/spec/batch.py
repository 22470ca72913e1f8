"""How one fixed global batch is split for each world size (pure functions, no torch)."""

from __future__ import annotations


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
