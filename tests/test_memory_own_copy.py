"""A surviving rank's rollback reads its shard from the slot it wrote and still maps in its own process
(issue 76): no keeper is asked for it, and only where the slot's stamp is the agreed snapshot's;
anything else (another step, a slot being rewritten) is read through the keeper as a new process
reads it. Real Ray keepers holding real segments, the restore's own read of a snapshot's states."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_spec
from tests.memory_jobs import hold, one_rank_group
from tidal.worker.checkpoint import flat_state, keeper, memory, segment
from tidal.worker.checkpoint.memory import Pending, ShardLost

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]

FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt")


def snapshot(tier: memory.Tier, step: int) -> None:
    """What `Tier.snapshot` does after DeepSpeed hands its states over: the one copy into a slot, then the
    hand-over's commit to the node's keeper and the ranks' agreement (one rank here)."""
    import ray

    states = {FILES[0]: {"module": {"w": torch.full((8,), float(step))}}, FILES[1]: {"o": torch.arange(5.0) + step}}
    planned = flat_state.plan(states)
    pending = Pending(step, slot=1 - tier.kept if tier.kept is not None else 0)
    assert tier._write(pending, planned) is None
    facts = {"world_size": 1, "zero_stage": 2, "fingerprint": tier.spec.fingerprint_hash(), "node": tier.node,
             "state": {"step": step, "world_size": 1, "zero_stage": 2, "attempt": tier.attempt}}
    assert ray.get(tier.own.commit.remote(tier.attempt, step, 0, pending.slot, facts, planned.record)) is None
    tier.kept = pending.slot


def test_a_survivor_rolls_back_from_its_own_copy_with_no_keeper_asked(tmp_path):
    spec = tiny_spec(tmp_path, name="mem-own-copy", **{"checkpoint.memory.every_steps": 3}).resolved()
    owner = keeper.Owner.of(spec, 0)
    try:
        with one_rank_group():
            tier = memory.Tier(spec, 0, 1)
            snapshot(tier, 6)
            _, plan = memory.newest_complete(spec)
            assert plan is not None and plan.step == 6
            # The node's keeper gone after it listed the snapshot: a read through it fails, the own copy does not.
            keeper.remove(owner)
            states, _ = memory._states(plan, list(FILES))
            assert torch.equal(states[FILES[0]]["module"]["w"], torch.full((8,), 6.0))
            assert torch.equal(states[FILES[1]]["o"], torch.arange(5.0) + 6)
            assert memory.restored_from() == "its own copy"
            # A slot being rewritten (its stamp cleared) is not served from the own copy either.
            tier2 = memory.Tier(spec, 0, 1)
            snapshot(tier2, 9)
            _, plan = memory.newest_complete(spec)
            slot = tier2.kept
            segment.write_stamp(tier2.maps[slot][1], 0)
            with pytest.raises(ShardLost):
                memory._states(plan, list(FILES))
    finally:
        keeper.remove(owner)


def test_a_snapshot_this_process_did_not_write_is_read_through_the_keeper(tmp_path):
    spec = tiny_spec(tmp_path, name="mem-not-own", **{"checkpoint.memory.every_steps": 3}).resolved()
    try:
        with one_rank_group():
            tier = memory.Tier(spec, 0, 1)
            snapshot(tier, 6)  # this process's own copy: of another attempt and step than the one agreed
            keeper.remove(keeper.Owner.of(spec, 0))
            hold(spec, 12)  # a keeper holding a shard another process wrote
            _, plan = memory.newest_complete(spec)
            assert plan is not None and plan.step == 12
            states, _ = memory._states(plan, list(FILES))
            assert torch.equal(states[FILES[0]]["module"]["w"], torch.full((4,), 12.0))
            assert memory.restored_from() == "this node's keeper"
            assert memory.restored_from() is None, "said once"
    finally:
        keeper.remove(keeper.Owner.of(spec, 0))
