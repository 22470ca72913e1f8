"""The memory tier's test jobs (tests/test_memory_tier_e2e.py, tests/test_memory_tier_node_loss.py): the
stored undisturbed run's job with persistent checkpoints every 20 steps and snapshots every few, the
resume lines it prints, and its losses against the stored reference."""

from __future__ import annotations

import re

import pytest
import torch

from tests.conftest import metric_history, tiny_spec
from tests.golden import reference_losses
from tidal.worker.checkpoint import fetch, flat_state

LONG = {"train.steps": 40, "train.global_batch": 64}  # the stored undisturbed run's (tests/golden.py)
RESUMED = re.compile(r"resumed from (.+?) at step (\d+)/\d+(?: \((\d+) step\(s\) to redo\))?")


def memory_spec(tmp_path, name: str, every: int = 3, **env: str):
    return tiny_spec(tmp_path, name=name, **LONG, **{"checkpoint.every_steps": 20, "checkpoint.memory.every_steps": every},
                     worker_env={fetch.CACHE_ENV: str(tmp_path / "cache"), **env})


def resumes(out: str) -> list[tuple[str, int, int]]:
    return [(m[1], int(m[2]), int(m[3] or 0)) for m in RESUMED.finditer(out)]


def assert_undisturbed_losses(tmp_path, spec, result) -> None:
    expected = reference_losses("async-checkpoint-undisturbed",
                                tiny_spec(tmp_path, name="undisturbed", **LONG, **{"checkpoint.every_steps": 10}))
    got = metric_history(spec, result.mlflow_run_id, "loss")
    assert sorted(got) == list(range(1, 41)), "every step logged exactly once"
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-4), step


def packed(files: dict) -> tuple[dict, list]:
    """`files` (name -> state) as a peer keeper receives a shard: its record and `[its block]`."""
    planned = flat_state.plan(files)
    block = torch.zeros(planned.total, dtype=torch.uint8)
    flat_state.write(planned, block)
    return planned.record, [block.numpy()]
