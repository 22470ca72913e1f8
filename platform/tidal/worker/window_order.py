"""Which window of a sharded token stream each global sample index is (pure functions, numpy only).

The order depends on the shard layout, the seed and the epoch, never on the world size: step `s`
trains on global samples `[(s-1)*B, s*B)`, sample `p` is window `order(p // n)[p % n]`, and ranks
only split a step's samples (`tidal.spec.batch.rank_slice`). So a run resized or restarted at any
step trains every window once per epoch, in the same global batches as an undisturbed run.

The shuffle has two levels, like MosaicML Streaming's `py1b`: the shards in a seeded order per
epoch, then the windows of each run of `SHUFFLE_SHARDS` consecutive shards (of that order)
permuted together. A step then reads from a few shards only, and a bounded shard cache holds them.
"""

from __future__ import annotations

import numpy as np

SHUFFLE_SHARDS = 4  # shards whose windows are mixed together: more mixing, more memory per reader


def epoch_order(counts: list[int], seed: int, epoch: int, block: int = SHUFFLE_SHARDS) -> np.ndarray:
    """The global window indices of one epoch in training order; `counts[i]`: windows of shard i."""
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    rng = np.random.default_rng([seed, epoch])
    shards = rng.permutation(len(counts))
    parts = []
    for b in range(0, len(shards), block):
        ids = np.concatenate([np.arange(starts[i], starts[i] + counts[i]) for i in shards[b:b + block]])
        parts.append(rng.permutation(ids))
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


def last_whole_step(windows: int, epochs: int | None, global_batch: int) -> int | None:
    """The last step whose global batch lies within `epochs` passes (None: no end, epochs repeat)."""
    return None if epochs is None else epochs * windows // global_batch


class WindowOrder:
    """Global sample index -> global window index, keeping one epoch's order at a time."""

    def __init__(self, counts: list[int], seed: int) -> None:
        self.counts, self.seed = counts, seed
        self.windows = int(sum(counts))
        self._orders: dict[int, np.ndarray] = {}  # two epochs at most: a step (and the next) spans two

    def window(self, sample: int) -> int:
        epoch, j = divmod(sample, self.windows)
        if epoch not in self._orders:
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}
            self._orders[epoch] = epoch_order(self.counts, self.seed, epoch)
        return int(self._orders[epoch][j])

    def windows_of(self, first: int, count: int) -> list[int]:
        return [self.window(p) for p in range(first, first + count)]
