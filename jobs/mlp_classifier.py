"""Your own model, data and loss, for jobs/mlp-classifier.yaml: an MLP that classifies points of a
seeded Gaussian mixture (no download). Tidal imports this file on the workers as
`jobs.mlp_classifier` (from the directory `tidal run` starts in, or `tidal submit`'s working dir).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


class Blobs(Dataset):
    """`n` points in `dim` dimensions around `classes` seeded centres; the same on every worker."""

    def __init__(self, n: int, dim: int, classes: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        centres = torch.randn(classes, dim, generator=g) * 1.5
        self.y = torch.randint(0, classes, (n,), generator=g)
        self.x = centres[self.y] + torch.randn(n, dim, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def dataset(n: int = 4096, dim: int = 16, classes: int = 4, seed: int = 0) -> Dataset:
    """data.dataset: called as dataset(**data.dataset_args) on every worker."""
    return Blobs(n, dim, classes, seed)


def model(_spec: Any, dim: int = 16, hidden: int = 64, classes: int = 4) -> nn.Module:
    """model.builder: called as model(model_spec, **model.builder_args); any nn.Module."""
    return nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                         nn.Linear(hidden, classes))


def step(model: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """train.step_fn: the loss of one micro-batch (a collated batch of the dataset's samples)."""
    x, y = batch
    return F.cross_entropy(model(x), y)
