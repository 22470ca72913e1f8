"""The memory tier's peer copy (checkpoint.memory.peer) across a resize: an elastic job's node lost
between persistent checkpoints takes its rank's own snapshots with it; the group, restarted at one
worker on the node left, resumes from the copy that node's keeper held for its peer, by byte range
at the smaller size; when a node returns it grows back from the one-worker snapshot the same way.
No checkpoint file is read from storage (there is none before the end), a few steps are replayed
each time, and the losses are the undisturbed run's. One raylet per simulated node
(ray.cluster_utils.Cluster)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray
from ray.cluster_utils import Cluster

from tests.conftest import metric_history
from tests.helpers import wait_for_step, wait_for_world_size
from tests.memory_jobs import assert_undisturbed_losses, memory_spec, resumes
from tests.slow_step import slow_env
from tidal.testing.clusters import add_worker_node, raylet_cluster
from tidal.testing.processes import wait_for
from tidal.testing.runs import finished, run_in_background
from tidal.worker.checkpoint import keeper

pytestmark = pytest.mark.slow
EVERY = 3  # a snapshot every 3 steps; no persistent checkpoint before the last step


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with raylet_cluster(workers=2) as c:  # one worker each
        yield c


def complete_snapshot(job: str, world: int, at_least: int) -> int | None:
    """The newest step of `world` ranks every rank of which some keeper holds, if at least `at_least`."""
    ranks: dict[tuple[str, int], set[int]] = {}
    for k in keeper.named(job).values():
        for e in ray.get(k.listing.remote()):
            if e["world_size"] == world:
                ranks.setdefault((e["attempt"], e["step"]), set()).add(e["rank"])
    done = [s for (_, s), r in ranks.items() if r == set(range(world))]
    return max(done) if done and max(done) >= at_least else None


def elastic_memory_spec(tmp_path, name: str, hold, **env: str):
    """A 1-2 worker job with snapshots every EVERY steps and no persistent checkpoint before its end;
    each micro-batch sleeps while the file `hold` exists (tests/slow_step.py; no number changes), so
    the job is still training when a returning node is seen, however long Ray takes."""
    hold.touch()
    return memory_spec(tmp_path, name, every=EVERY, **slow_env(0.08, hold), **env).with_overrides({
        "checkpoint.every_steps": 100, "scaling.min_workers": 1, "scaling.max_workers": 2,
        "scaling.elastic_check_s": 2, "train.step_fn": "tests.slow_step:step"})


def test_a_lost_node_resumes_smaller_from_its_peers_copy_then_grows_back_from_memory(cluster, tmp_path, capfd):
    hold = tmp_path / "hold"
    spec = elastic_memory_spec(tmp_path, "mem-node", hold)
    t, out = run_in_background(spec)
    wait_for_world_size(spec, 2)
    wait_for_step(spec, 7)
    wait_for("a complete 2-worker snapshot past step 6", lambda: complete_snapshot(spec.name, 2, 6), 120, every=0.1)
    holders = {name.rsplit(":", 1)[1] for name in keeper.named(spec.name)}
    assert len(holders) == 2, f"one keeper on each of the group's nodes: {holders}"
    lost = next(n for n in cluster.worker_nodes if n.node_id in holders)
    cluster.remove_node(lost)
    wait_for_world_size(spec, 1)
    shrunk = resumes(capfd.readouterr().out)
    wait_for("a 1-worker snapshot after the resume",
             lambda: complete_snapshot(spec.name, 1, shrunk[-1][1] + EVERY) if shrunk else None, 120, every=0.1)
    add_worker_node(cluster)
    wait_for_world_size(spec, 2)
    hold.unlink()
    result = finished(t, out)
    printed = capfd.readouterr().out

    assert result.error is None, result.error
    *_, (where, step, redo), (again, step2, redo2) = shrunk + resumes(printed)
    assert where.startswith("the in-memory snapshot") and "a peer's copy" in where, printed[-3000:]
    assert lost.node_id[:8] not in where, "the lost node's keeper cannot have served it"
    assert again.startswith("the in-memory snapshot"), "grown back from the 1-worker snapshot, not storage"
    assert step >= 6 and step % EVERY == 0 and step2 > step and step2 % EVERY == 0
    world = metric_history(spec, result.mlflow_run_id, "world_size")
    sizes = [world[s] for s in sorted(world)]
    assert [a for a, b in zip(sizes, sizes[1:] + [None], strict=True) if a != b][-3:] == [2, 1, 2], sizes
    assert 0 <= redo < 2 * EVERY and 0 <= redo2 < 2 * EVERY, f"replayed {redo} and {redo2} step(s)"
    assert not list((tmp_path / "cache").rglob("*.pt")), "no checkpoint file copied, none left on the node"
    assert_undisturbed_losses(tmp_path, spec, result)
    assert keeper.named(spec.name) == {}, "the job's keepers outlived it"


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): the completeness rule is unit-tested (test_memory_tier) and a kill mid-snapshot runs in test_memory_tier_e2e
def test_a_node_lost_while_its_snapshot_is_copied_resumes_from_the_complete_one_before(cluster, tmp_path, capfd):
    """Rank 1's hand-over of step 9 waits 8 s (to its own keeper and its peer's): its node is removed
    meanwhile, so step 9 is held for rank 0 only, and the group, restarted at one worker, resumes from
    step 6, whose rank-1 shard the peer's keeper holds; never from the partial step 9."""
    from tidal.worker.checkpoint.memory import DELAY_ENV

    while len(cluster.worker_nodes) < 2:
        add_worker_node(cluster)
    hold = tmp_path / "hold"
    spec = elastic_memory_spec(tmp_path, "mem-midcopy", hold, **{DELAY_ENV: "8@1:9"})
    t, out = run_in_background(spec)

    def rank_1_mid_copy() -> str | None:
        """The node rank 1 ran on, once rank 0's shard of step 9 is held and rank 1's is not."""
        shards = [e for k in keeper.named(spec.name).values() for e in ray.get(k.listing.remote())]
        at_9 = {e["rank"] for e in shards if e["step"] == 9}
        six = [e["node"] for e in shards if e["step"] == 6 and e["rank"] == 1]
        return six[0] if at_9 == {0} and six else None

    node_of_1 = wait_for("rank 1's snapshot of step 9 half handed over", rank_1_mid_copy, 180, every=0.1)
    cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id == node_of_1))
    wait_for_world_size(spec, 1)
    hold.unlink()
    result = finished(t, out)
    printed = capfd.readouterr().out

    assert result.error is None, result.error
    (where, step, _), = resumes(printed)
    assert step == 6 and where.startswith("the in-memory snapshot") and "a peer's copy" in where, printed[-3000:]
    assert not list((tmp_path / "cache").rglob("*.pt")), "no checkpoint file copied, none left on the node"
    assert_undisturbed_losses(tmp_path, spec, result)
