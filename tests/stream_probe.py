"""A `train.step_fn` for tests: the default step (the model's loss), recording which windows each
rank trained on. With TIDAL_TEST_WINDOWS=PATH, every micro-batch appends one line to PATH.rankN:
a hash of each of its windows (inputs and the last target: the whole window), in order."""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def step(model: Any, batch: Any) -> torch.Tensor:
    inputs, targets = batch
    windows = torch.cat([inputs, targets[:, -1:]], dim=1).to(torch.int32).cpu().numpy()
    ids = [hashlib.blake2b(w.tobytes(), digest_size=8).hexdigest() for w in windows]
    with open(f"{os.environ['TIDAL_TEST_WINDOWS']}.rank{dist.get_rank()}", "a") as f:
        f.write(" ".join(ids) + "\n")
    return model(inputs, targets)


# The streamed test's source (tests/test_stream_resume.py; tests/golden.py's stored reference writes
# the same file): seeded documents of 40-90 characters, most spanning several windows of 17 tokens,
# not aligned with them.
_rng = random.Random(5)
DOCS = ["".join(_rng.choice("abcdefghij klmnop") for _ in range(_rng.randint(40, 90))) for _ in range(80)]
STEPS = 20  # 5,218 bytes: 306 windows, 19 whole steps of 16 in an epoch; step 20 starts the second


def write_docs(folder: Path) -> Path:
    source = folder / "docs.txt"
    source.write_text("".join(d + "\n" for d in DOCS))
    return source


def step_batches(record: Path, world: int, first: int, last: int, micro: int = 4, batch: int = 16) -> dict[int, list[str]]:
    """step -> the windows of its global batch (rank 0's, then rank 1's...), from what `step`
    recorded during one launch that trained steps first..last."""
    per_step = batch // (micro * world)
    lines = {r: (record.parent / f"{record.name}.rank{r}").read_text().split("\n")[:-1] for r in range(world)}
    assert all(len(v) == per_step * (last - first + 1) for v in lines.values()), "a launch trained other steps"
    return {first + k: [w for r in range(world) for line in lines[r][k * per_step:(k + 1) * per_step]
                        for w in line.split()] for k in range(last - first + 1)}


def streamed(source: Path) -> dict[str, object]:
    """The streamed test's job fields (also its stored reference's)."""
    return {"data.source": str(source), "data.streaming": True, "model.vocab_size": 256, "train.steps": STEPS,
            "checkpoint.every_steps": 4, "train.step_fn": "tests.stream_probe:step"}
