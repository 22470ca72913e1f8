"""A streamed source's windows, read by global index from the shards the driver made
(`tidal.launch.stream_prep`), so what a step trains on never depends on the world size.

Step `s` trains on global samples `[(s-1)*B, s*B)`, each a window of a seeded per-epoch order
(`tidal.worker.window_order`); rank r reads only its slice of them, fetching only the shards those
windows lie in, through a small cache (data larger than memory works, and the two-level shuffle
keeps a step's windows within a few shards). As for sources read whole, the data position is the
step number: a restarted, resized or re-launched job trains each window once per epoch, in the same
global batches as an undisturbed run. With `data.epochs` the job ends at the last whole step of
its epochs.
"""

from __future__ import annotations

import io
import json
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from tidal import fs
from tidal.errors import TidalError
from tidal.spec.batch import rank_slice
from tidal.spec.job import JobSpec
from tidal.worker.window_order import SHUFFLE_SHARDS, WindowOrder, last_whole_step

INDEX_FILE = "index.json"  # as tidal.launch.stream_prep writes it (the worker side does not import the driver's)


class ShardReader:
    """Windows by global index from a published shard index, holding at most `cache` shards.

    `prefetch` loads the next step's shards in a background thread, so that a step waits on
    object storage only when a shard is still on its way."""

    def __init__(self, uri: str, cache: int = 2 * SHUFFLE_SHARDS) -> None:
        self.fs, self.path = fs.resolve(uri)
        index = fs.read_json(self.fs, f"{self.path}/{INDEX_FILE}")
        if not isinstance(index, dict):
            raise TidalError(f"the streamed data's shard index {uri}/{INDEX_FILE} is missing or unreadable; "
                             "run the job again to rebuild it")
        try:  # names from storage: never joined unchecked (tidal.fs.check_name)
            self.names: list[str] = [fs.check_name(name) for name in index["shards"]]
        except fs.UnsafeName as e:
            raise TidalError(f"the streamed data's shard index {uri}/{INDEX_FILE} names a shard outside its folder "
                             f"({e}); run the job again to rebuild it") from None
        self.counts: list[int] = index["counts"]
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        self.cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self.limit = cache
        self.loading: dict[int, Future[np.ndarray]] = {}  # only the training thread touches both dicts
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tidal-shards")

    def windows(self, indices: list[int]) -> np.ndarray:
        shard_of = self._shards_of(indices)
        return np.stack([self._shard(int(s))[i - self.starts[s]] for i, s in zip(indices, shard_of, strict=True)])

    def prefetch(self, indices: list[int]) -> None:
        for s in map(int, np.unique(self._shards_of(indices))):
            if s not in self.cache and s not in self.loading:
                self.loading[s] = self.pool.submit(self._load, s)

    def _shards_of(self, indices: list[int]) -> np.ndarray:
        return np.searchsorted(self.starts, indices, side="right") - 1

    def _shard(self, s: int) -> np.ndarray:
        if s in self.cache:
            self.cache.move_to_end(s)
            return self.cache[s]
        pending = self.loading.pop(s, None)
        self.cache[s] = pending.result() if pending is not None else self._load(s)
        if len(self.cache) > self.limit:
            self.cache.popitem(last=False)
        return self.cache[s]

    def _load(self, s: int) -> np.ndarray:
        with self.fs.open_input_file(f"{self.path}/{self.names[s]}") as f:
            return np.load(io.BytesIO(f.read()))


class StreamBatches:
    """This rank's micro-batches for a step, from the job's shard index."""

    def __init__(self, spec: JobSpec, index_uri: str, rank: int, world_size: int, device: torch.device) -> None:
        t = spec.train
        self.reader = ShardReader(index_uri)
        self.order = WindowOrder(self.reader.counts, t.seed)
        self.global_batch, self.micro_batch = t.global_batch, t.micro_batch
        self.part = rank_slice(t.global_batch, world_size, rank)
        self.device = device
        self.epochs = spec.data.epochs
        self.last = last_whole_step(self.order.windows, self.epochs, t.global_batch)
        if self.last == 0:
            raise TidalError(f"data.source {spec.data.source} holds {self.order.windows} windows of "
                             f"{spec.model.seq_len + 1} tokens: {spec.data.epochs} epoch(s) make no whole step of "
                             f"train.global_batch {t.global_batch}; raise data.epochs or lower train.global_batch")
        self.ended = False  # no whole step is left after the current one (data.epochs ran out)

    def for_step(self, step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.last is not None and step > self.last:  # data.epochs lowered below where the job is
            raise TidalError(f"data.epochs {self.epochs} ends the stream at step {self.last}, before step {step} of "
                             f"this job; set data.epochs to {self.epochs + 1} or more to train on")
        self.ended = self.last is not None and step >= self.last
        first = (step - 1) * self.global_batch
        mine = self.order.windows_of(first, self.global_batch)[self.part]
        tokens = torch.from_numpy(self.reader.windows(mine).astype(np.int64))
        if not self.ended:
            self.reader.prefetch(self.order.windows_of(first + self.global_batch, self.global_batch)[self.part])
        for chunk in tokens.split(self.micro_batch):
            chunk = chunk.to(self.device, non_blocking=True)
            yield chunk[:, :-1], chunk[:, 1:]

    def save_position(self, folder: Path) -> None:
        """Nothing to save: a step's windows follow from the step number."""


def read_index(uri: str) -> dict[str, object]:
    """The shard index as written (for tools and tests)."""
    sfs, path = fs.resolve(uri)
    with sfs.open_input_stream(f"{path}/{INDEX_FILE}") as f:
        return dict(json.loads(f.read()))
