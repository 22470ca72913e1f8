"""Streaming a dataset larger than a worker's memory through Ray Data, resumable without repeats or gaps.

Ray Data reads the source, packs its text into windows of `seq_len + 1` tokens and splits the
stream over the workers (`ray.train.get_dataset_shard`). Which worker gets which window is decided
at run time, so the data position cannot be a count: it is the set of windows already trained on.
Every window carries an id (a hash of its tokens: identical windows count as one sample) and its
epoch; each checkpoint stores the ids trained on so far in the epochs still in progress
(`SEEN_FILE`, rank 0). Ray Train calls `StreamSource` again at every start of the worker group
(restart, resize, new driver), and it rebuilds the stream without those ids: a resumed job sees
exactly the windows an undisturbed one would still have to see.

The stream is one pass over as many epochs as the remaining steps need (each epoch in its own
seeded block order), so workers never wait on one another at an epoch boundary. Ray Data keeps
the stream's order (`preserve_order`), so once every worker has reached epoch e+1, epoch e is
done and its ids are dropped from the checkpoint; what a checkpoint holds is bounded by about two
epochs of ids (8 bytes per window).
"""

from __future__ import annotations

import hashlib
import io
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import ray.data
import ray.train
import torch
import torch.distributed as dist

from tidal.errors import TidalError
from tidal.spec.job import JobSpec
from tidal.storage import Found, find_resume_point
from tidal.worker.data import source_fs
from tidal.worker.tokens import encode

SEEN_FILE = "tidal-data-seen.npz"


def pack(batch: dict[str, np.ndarray], text_field: str, seq_len: int, epoch: int,
         tokenizer: str | None) -> dict[str, np.ndarray]:
    """Documents -> tokens (each document ending in a separator) cut into windows of seq_len+1.

    The tail of a batch shorter than one window is dropped (under seq_len+1 tokens per batch).
    """
    flat = encode([str(t) for t in batch[text_field]], tokenizer)
    n = len(flat) // (seq_len + 1)
    tokens = flat[: n * (seq_len + 1)].reshape(n, seq_len + 1)
    return {"tokens": tokens, "id": window_ids(tokens), "epoch": np.full(n, epoch, dtype=np.int64)}


def window_ids(tokens: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each window's int32 tokens: its identity in the data position."""
    return np.array([int.from_bytes(hashlib.blake2b(w.astype(np.int32).tobytes(), digest_size=8).digest(),
                                    "little", signed=True) for w in tokens], dtype=np.int64)


def drop_seen(batch: dict[str, np.ndarray], seen: np.ndarray) -> dict[str, np.ndarray]:
    keep = ~np.isin(batch["id"], seen)
    return {k: v[keep] for k, v in batch.items()}


class StreamSource:
    """The `datasets={"train": ...}` callable: Ray Train calls it at every worker-group start."""

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec

    def __call__(self) -> ray.data.Dataset:
        found = find_resume_point(self.spec)
        seen = read_seen(found)
        first = min(seen, default=0)
        step = found.step if found else 0
        epochs = [self._epoch(e, seen.get(e)) for e in range(first, first + self._epochs_needed(first, step))]
        return epochs[0].union(*epochs[1:]) if len(epochs) > 1 else epochs[0]

    def _epoch(self, epoch: int, seen: np.ndarray | None) -> ray.data.Dataset:
        spec = self.spec
        ds = _read(spec.data.source).randomize_block_order(seed=spec.train.seed + epoch)
        ds = ds.map_batches(pack, batch_format="numpy", fn_kwargs={
            "text_field": spec.data.text_field, "seq_len": spec.model.seq_len, "epoch": epoch,
            "tokenizer": spec.data.tokenizer})
        if seen is not None and len(seen):
            ds = ds.map_batches(drop_seen, batch_format="numpy", fn_kwargs={"seen": seen})
        return ds

    def _epochs_needed(self, first: int, step: int) -> int:
        """`data.epochs` less those done; by default enough for the remaining steps, from the
        source's size (an estimate; the union is lazy, so an epoch too many costs nothing)."""
        if self.spec.data.epochs:
            return max(1, self.spec.data.epochs - first)
        t, m = self.spec.train, self.spec.model
        needed = (t.steps - step) * t.global_batch
        fs, path = source_fs(self.spec.data.source)
        # Low on purpose (markup, compression, several bytes per token with a tokenizer): an
        # epoch too many costs nothing, one too few ends the job early.
        per_epoch = max(1, fs.get_file_info(path).size // (m.seq_len + 1) // 8)
        return min(1000, math.ceil(needed / per_epoch) + 1)


def _read(source: str) -> ray.data.Dataset:
    if source.endswith(".parquet"):
        return ray.data.read_parquet(source)
    if source.endswith(".jsonl"):
        return ray.data.read_json(source, lines=True)
    return ray.data.read_text(source)  # one row per line, in column "text"


def read_seen(found: Found | None) -> dict[int, np.ndarray]:
    """epoch -> ids of the windows trained on in that epoch, from a checkpoint (empty: none)."""
    if found is None:
        return {}
    try:
        with found.fs.open_input_file(f"{found.path}/{SEEN_FILE}") as f:
            saved = np.load(io.BytesIO(f.read()))
    except FileNotFoundError:
        return {}
    return {int(k.removeprefix("epoch")): saved[k] for k in saved.files}


class StreamBatches:
    """This worker's micro-batches from its shard of the stream, and the windows it trained on."""

    def __init__(self, spec: JobSpec, world_size: int, device: torch.device, found: Found | None) -> None:
        t = spec.train
        self.micro_per_step = t.global_batch // (t.micro_batch * world_size)
        self.device = device
        shard = ray.train.get_dataset_shard("train")
        self.batches = iter(shard.iter_torch_batches(batch_size=t.micro_batch, drop_last=True,
                                                     dtypes={"tokens": torch.long, "id": torch.long, "epoch": torch.long}))
        self.seen = read_seen(found) if dist.get_rank() == 0 else {}  # rank 0 keeps every rank's
        self.new: list[torch.Tensor] = []  # (epoch, id) rows trained on since the last checkpoint
        self.epoch = 0
        self.ahead: list[dict[str, torch.Tensor]] | None = None
        self.ended = False  # no whole step is left after the current one

    def for_step(self, step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The step's micro-batches. It also reads the next step's, to know whether this is the last:
        every worker holds the same number of windows (an equal split), so all learn it together."""
        current = self.ahead if self.ahead is not None else self._take()
        if current is None:
            raise TidalError(f"the data stream is empty at step {step}: the source yields no whole step")
        self.ahead = self._take()
        self.ended = self.ahead is None
        for batch in current:
            self.new.append(torch.stack([batch["epoch"], batch["id"]]))
            self.epoch = int(batch["epoch"][-1])
            chunk = batch["tokens"].to(self.device, non_blocking=True)
            yield chunk[:, :-1], chunk[:, 1:]

    def _take(self) -> list[dict[str, torch.Tensor]] | None:
        """One step's micro-batches, or None if the stream ends first (a partial step is not trained)."""
        step = [b for _, b in zip(range(self.micro_per_step), self.batches, strict=False)]
        return step if len(step) == self.micro_per_step else None

    def save_position(self, folder: Path) -> None:
        """Collective: rank 0 writes every rank's trained-on windows into the checkpoint `folder`."""
        mine = torch.cat(self.new, dim=1) if self.new else torch.empty(2, 0, dtype=torch.long)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (self.epoch, mine.numpy()))
        self.new = []
        if dist.get_rank() != 0:
            return
        for _, rows in gathered:
            for e in np.unique(rows[0]):
                ids = rows[1][rows[0] == e]
                self.seen[int(e)] = np.concatenate([self.seen.get(int(e), np.empty(0, np.int64)), ids])
        # The stream is in order: an epoch every rank has moved past holds no window still to come.
        done_below = min(epoch for epoch, _ in gathered)
        self.seen = {e: ids for e, ids in self.seen.items() if e >= done_below}
        np.savez(folder / SEEN_FILE, **{f"epoch{e}": ids for e, ids in self.seen.items()})
