"""A `data.dataset` for tests of input-bound jobs: next-token pairs of a fixed random sequence,
each read sleeping `sleep_s`, the way a dataset on slow storage or with a costly decode is slow.
The sleep changes no number."""

from __future__ import annotations

import time

import torch
from torch.utils.data import Dataset


class SlowTokens(Dataset):
    def __init__(self, n: int, vocab: int, seq_len: int, sleep_s: float) -> None:
        self.tokens = torch.randint(0, vocab, (n, seq_len + 1), generator=torch.Generator().manual_seed(0))
        self.sleep_s = sleep_s

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.sleep_s)
        row = self.tokens[i]
        return row[:-1], row[1:]


def dataset(n: int = 256, vocab: int = 64, seq_len: int = 16, sleep_s: float = 0.0) -> SlowTokens:
    return SlowTokens(n, vocab, seq_len, sleep_s)
