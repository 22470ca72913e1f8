"""The memory tier's test jobs (tests/test_memory_tier_e2e.py, tests/test_memory_tier_node_loss.py): the
stored undisturbed run's job with persistent checkpoints every 20 steps and snapshots every few, the
resume lines it prints, and its losses against the stored reference; and a one-rank process group and a
snapshot held by a real keeper, for the tests of a restore's read from memory; the processes of a
failure.replace_in_place job's group (`group_members`)."""

from __future__ import annotations

import contextlib
import re
import socket
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from tests.conftest import metric_history, tiny_spec
from tests.golden import reference_losses
from tidal.worker.checkpoint import fetch, flat_state, keeper
from tidal.worker.health.rendezvous import NAMESPACE, PREFIX

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


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def hold(spec, step: int) -> None:
    """A one-rank snapshot of `step` held by this node's keeper of the job."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    facts = {"world_size": 1, "zero_stage": 2, "fingerprint": spec.fingerprint_hash(), "node": node,
             "state": {"step": step, "world_size": 1, "zero_stage": 2}}
    files = {"mp_rank_00_model_states.pt": {"module": {"w": torch.full((4,), float(step))}},
             "zero_pp_rank_0_mp_rank_00_optim_states.pt": {"o": torch.ones(3)}}
    k = keeper.handle(keeper.Owner.of(spec, 0), node, None)
    assert ray.get(k.put.remote("att", step, 0, facts, *packed(files))) is None


def group_members(job: str, world: int = 2) -> dict[int, int] | None:
    """rank -> pid of the newest generation of `world` ranks formed through the job's rendezvous (None: none yet)."""
    import ray

    names = [e["name"] for e in ray.util.list_named_actors(all_namespaces=True)
             if e["namespace"] == NAMESPACE and e["name"].startswith(f"{PREFIX}{job}-")]
    if not names:
        return None
    members = ray.get(ray.get_actor(names[0], namespace=NAMESPACE).members.remote())
    return members if len(members) == world else None
