"""The memory tier's peer copy (checkpoint.memory.peer): a node lost between persistent checkpoints
takes its ranks' own snapshots with it, and the group, restarted at the same size on the nodes left,
resumes from the copies the next node's keeper held: no checkpoint from storage, a few steps
replayed, the undisturbed run's losses. One raylet per simulated node (ray.cluster_utils.Cluster)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray
from ray.cluster_utils import Cluster

from tests.conftest import metric_history
from tests.helpers import finished, run_in_background, wait_for_step
from tests.memory_jobs import assert_undisturbed_losses, memory_spec, resumes
from tidal.testing.clusters import raylet_cluster
from tidal.testing.processes import wait_for
from tidal.worker.checkpoint import keeper

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with raylet_cluster(workers=3) as c:  # two for the group, one to take the lost node's place
        yield c


def complete_snapshot(job: str, at_least: int) -> int | None:
    """The newest step every rank of which some keeper holds, if at least `at_least`."""
    ranks: dict[tuple[str, int], set[int]] = {}
    for k in keeper.keepers(job).values():
        for e in ray.get(k.listing.remote()):
            ranks.setdefault((e["attempt"], e["step"]), set()).add(e["rank"])
    done = [s for (_, s), r in ranks.items() if r == {0, 1}]
    return max(done) if done and max(done) >= at_least else None


def test_a_lost_node_resumes_from_its_peers_copy(cluster, tmp_path, capfd):
    spec = memory_spec(tmp_path, "mem-node")
    t, out = run_in_background(spec)
    wait_for_step(spec, 13)
    wait_for("a complete snapshot past step 12", lambda: complete_snapshot(spec.name, 12), 120, every=0.1)
    holders = {name.rsplit(":", 1)[1] for name in keeper.keepers(spec.name)}
    assert len(holders) == 2, f"one keeper on each of the group's nodes: {holders}"
    lost = next(n for n in cluster.worker_nodes if n.node_id in holders)
    cluster.remove_node(lost)
    result = finished(t, out)
    printed = capfd.readouterr().out

    assert result.error is None, result.error
    (where, step, redo), = resumes(printed)
    assert where.startswith("the in-memory snapshot") and "a peer's copy" in where, printed[-3000:]
    assert lost.node_id[:8] not in where, "the lost node's keeper cannot have served it"
    assert 12 <= step < 20 and step % 3 == 0
    replayed = metric_history(spec, result.mlflow_run_id, "max_steps_lost")[40]
    assert replayed == redo and 0 <= replayed < 2 * 3, f"replayed {replayed} step(s)"
    assert not list((tmp_path / "cache").rglob("*.pt")), "a checkpoint file was copied from storage"
    assert_undisturbed_losses(tmp_path, spec, result)
    assert keeper.keepers(spec.name) == {}, "the job's keepers outlived it"
