"""Batches defined by global sample index, so what a step sees never depends on the world size.

Step `s` (1-based) trains on samples `[(s-1)*B, s*B)` of a seeded order (B = global batch).
Rank r takes its contiguous slice of those and splits it into gradient-accumulation
micro-batches. A resumed or resized run therefore sees exactly the samples an undisturbed
run would, and the data position is just the step number.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

from tidal.errors import TidalError
from tidal.spec.batch import rank_slice
from tidal.spec.job import JobSpec
from tidal.worker.tokens import encode
from tidal.worker.user_code import UserDataset

MAX_STRIDE = 8
HOLDOUT_SEED = 7_919  # the held-out draw differs from the epoch orders drawn with the same train.seed


class SyntheticTask:
    """Sequences x[t+1] = (x[t] + k) mod V with a random start and a random stride k per sequence.

    Learnable (a model must infer k from the context) and needs no download.
    """

    def __init__(self, vocab: int, seq_len: int, seed: int) -> None:
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed

    def samples(self, first: int, count: int) -> torch.Tensor:
        """`count` sequences starting at global sample index `first` (always a step's start)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + first)
        start = torch.randint(0, self.vocab, (count, 1), generator=g)
        stride = torch.randint(1, MAX_STRIDE + 1, (count, 1), generator=g)
        t = torch.arange(self.seq_len + 1).unsqueeze(0)
        return (start + stride * t) % self.vocab


def source_fs(source: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem and path of a local path or a URI (s3://, gs://, ...)."""
    return pafs.FileSystem.from_uri(source) if "://" in source else (pafs.LocalFileSystem(), source)


def read_docs(source: str, text_field: str) -> list[str]:
    """The documents of a .txt (one: the whole file), .jsonl or .parquet file (a local path or any
    pyarrow filesystem URI)."""
    fs, path = source_fs(source)
    if source.endswith(".parquet"):
        return pq.read_table(path, columns=[text_field], filesystem=fs).column(text_field).to_pylist()
    with fs.open_input_stream(path) as f:
        raw = f.read().decode()
    if source.endswith(".jsonl"):
        return [json.loads(line)[text_field] for line in raw.splitlines() if line.strip()]
    return [raw]


class TextWindows:
    """Tokens of a text, jsonl or parquet source, cut into windows, in a seeded order per epoch.
    Every rank reads the whole source and indexes it by global sample index, which is what makes
    resume and resize exact (no sample repeated or skipped); the price is that the tokenized
    source must fit in each worker's memory (`data.streaming` lifts that)."""

    def __init__(self, path: str, text_field: str, seq_len: int, seed: int, tokenizer: str | None = None) -> None:
        tokens = torch.from_numpy(encode(read_docs(path, text_field), tokenizer)).long()
        n = (len(tokens) - 1) // seq_len
        if n < 1:
            raise ValueError(f"{path} holds {len(tokens)} tokens, fewer than one sequence of {seq_len + 1}")
        self.windows = tokens[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len)
        self.seed = seed

    def hold_out(self, holdout: int | float, seed: int) -> torch.Tensor:
        """Take `holdout` windows out of this source for evaluation and return them: from now on no
        training sample can be one of them. Call before the first `samples`."""
        train, held = split_holdout(len(self.windows), holdout, seed)
        out, self.windows = self.windows[held], self.windows[train]
        return out

    def samples(self, first: int, count: int) -> torch.Tensor:
        n = len(self.windows)
        idx = torch.empty(count, dtype=torch.long)
        for i in range(count):  # a sample's window depends only on its global index
            epoch, j = divmod(first + i, n)
            idx[i] = self._order(epoch)[j]
        return self.windows[idx]

    def _order(self, epoch: int) -> torch.Tensor:
        if getattr(self, "_epoch", None) != epoch:
            self._epoch, self._perm = epoch, torch.randperm(len(self.windows), generator=torch.Generator().manual_seed(self.seed + epoch))
        return self._perm


def split_holdout(n: int, holdout: int | float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training indices, held-out indices) of `n` samples: a seeded draw of `holdout` of them (a
    count, or a fraction of `n`), the same on every rank and at every world size."""
    k = holdout if isinstance(holdout, int) else max(1, round(holdout * n))
    if not 0 < k < n:
        raise TidalError(f"eval.holdout {holdout} sets aside {k} of the {n} samples of data.source: leave at least "
                         "one for training and one for evaluation")
    held = torch.randperm(n, generator=torch.Generator().manual_seed(seed + HOLDOUT_SEED))[:k].sort().values
    keep = torch.ones(n, dtype=torch.bool)
    keep[held] = False
    return keep.nonzero().squeeze(1), held


class Batches:
    """This rank's micro-batches for a given step."""

    ended = False  # an indexed source repeats in epochs: it never runs out

    def __init__(self, spec: JobSpec, rank: int, world_size: int, device: torch.device) -> None:
        m, t = spec.model, spec.train
        self.source: SyntheticTask | TextWindows | UserDataset
        if spec.data.dataset:
            self.source = UserDataset(spec)
        elif spec.data.source == "synthetic":
            self.source = SyntheticTask(m.vocab_size, m.seq_len, t.seed)
        else:
            self.source = TextWindows(spec.data.source, spec.data.text_field, m.seq_len, t.seed, spec.data.tokenizer)
        holdout = spec.eval.holdout if spec.eval else None
        # Set aside before any step reads the source: training indexes only what is left.
        self.held_out = self.source.hold_out(holdout, t.seed) if holdout is not None else None
        self.global_batch, self.micro_batch = t.global_batch, t.micro_batch
        self.part = rank_slice(t.global_batch, world_size, rank)
        self.device = device

    def save_position(self, folder: Path) -> None:
        """Nothing to save: a step's samples follow from the step number."""

    def for_step(self, step: int) -> Iterator[Any]:
        """Token sources give (inputs, targets) pairs; a user dataset gives its own collated batches."""
        first = (step - 1) * self.global_batch
        if isinstance(self.source, UserDataset):
            yield from self.source.micro_batches(first, self.part, self.micro_batch, self.device)
            return
        # Every rank draws the step's whole batch and keeps its slice: the synthetic task draws
        # a step's samples from one seeded stream, so slices must come from the same draw.
        mine = self.source.samples(first, self.global_batch)[self.part]
        for chunk in mine.split(self.micro_batch):
            chunk = chunk.to(self.device, non_blocking=True)
            yield chunk[:, :-1], chunk[:, 1:]
