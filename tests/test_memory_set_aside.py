"""A memory snapshot that does not load is set aside, so the next restart does not choose it again;
one whose copy went while it was read is kept (found in review: a snapshot that failed to load was
chosen again by every restart, each failing on it, until the job's restarts ran out). Real Ray keepers
holding real segments, the restore's own path up to DeepSpeed's load."""

from __future__ import annotations

import pytest

from tests.conftest import tiny_spec
from tests.memory_jobs import hold, one_rank_group
from tidal.errors import CheckpointError
from tidal.storage import Found
from tidal.worker.checkpoint import keeper, memory, restore
from tidal.worker.checkpoint.route import Load, Route

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]


class RefusingEngine:
    """Stands in for a DeepSpeed engine whose load refuses the states it is served (as a model whose
    shapes changed does): everything before it, the fetch from the keepers included, is the real path."""

    checkpoint_engine = None
    optimizer = None

    def __init__(self) -> None:
        self.served: list[str] = []

    def load_checkpoint(self, folder: str, tag: str, **_: object) -> tuple[str, dict]:
        self.served.append(tag)
        raise RuntimeError("Error(s) in loading state_dict: size mismatch for w")


def test_a_snapshot_that_does_not_load_is_set_aside_and_the_next_restart_takes_the_one_before(tmp_path):
    spec = tiny_spec(tmp_path, name="mem-refused", **{"checkpoint.memory.every_steps": 3}).resolved()
    try:
        hold(spec, 9)
        hold(spec, 12)
        _, plan = memory.newest_complete(spec)
        assert plan.step == 12
        engine = RefusingEngine()
        with one_rank_group(), pytest.raises(CheckpointError, match="set aside"):
            restore.restore(engine, Found("memory", None, plan.state, None), Route(Load.AS_SAVED, memory=plan))
        assert engine.served == ["global_step12"], "the snapshot's states reached DeepSpeed's load"
        _, plan = memory.newest_complete(spec)
        assert plan is not None and plan.step == 9, "the next restart chose the snapshot that did not load again"
    finally:
        keeper.remove(keeper.Owner.of(spec, 0))


def test_a_snapshot_whose_copy_went_while_it_was_read_is_kept(tmp_path):
    spec = tiny_spec(tmp_path, name="mem-lost-copy", **{"checkpoint.memory.every_steps": 3}).resolved()
    try:
        hold(spec, 12)
        _, plan = memory.newest_complete(spec)
        lost = memory.ShardLost("the in-memory snapshot of step 12 lost rank 0's shard while it was being restored")
        assert restore._memory_load_failed(plan, lost) is lost
        assert not memory.unloadable(ConnectionError("keeper gone")) and memory.unloadable(KeyError("w"))
        _, again = memory.newest_complete(spec)
        assert again is not None and again.step == 12, "a transient failure set a sound snapshot aside"
    finally:
        keeper.remove(keeper.Owner.of(spec, 0))
