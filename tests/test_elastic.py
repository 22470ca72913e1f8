"""Node loss, preemption and regrowth on a multi-node local cluster (one raylet per simulated node).

The head has no CPUs, so Ray Train workers land on the 1-CPU worker nodes the tests add and remove.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.core.generated import autoscaler_pb2

from tests.conftest import metric_history, tiny_spec
from tests.helpers import (
    chatter_in,
    wait_for_step,
    wait_for_world_size,
)
from tests.slow_step import slow_env
from tidal.storage import RunDir
from tidal.testing.clusters import add_worker_node, raylet_cluster
from tidal.testing.processes import wait_for
from tidal.testing.runs import finished, run_in_background

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with raylet_cluster() as c:
        yield c


def drain(c: Cluster, node, seconds: float) -> None:
    """What a cloud provider's reclaim notice does: drain the node with a deadline."""
    gcs = ray._raylet.GcsClient(address=c.gcs_address)
    accepted, why = gcs.drain_node(node.node_id, autoscaler_pb2.DrainNodeReason.DRAIN_NODE_REASON_PREEMPTION,
                                   "test: spot reclaim", int((time.time() + seconds) * 1000))
    assert accepted, why


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): the preemption plan (a synchronous save, then the drain) is unit-tested (test_plan)
def test_preemption_warning_saves_at_the_step_reached_and_loses_nothing(cluster, tmp_path, capfd):
    a, b = add_worker_node(cluster), add_worker_node(cluster)
    spec = tiny_spec(tmp_path, name="preempted", **{"train.steps": 400, "train.global_batch": 64, "checkpoint.every_steps": 100})
    t, out = run_in_background(spec)
    wait_for_step(spec, 30)
    spare = add_worker_node(cluster)  # where the preempted worker will go
    drain(cluster, a, seconds=8)
    result = finished(t, out)

    run_id = result.mlflow_run_id
    assert sorted(metric_history(spec, run_id, "loss")) == list(range(1, 401))
    lost = metric_history(spec, run_id, "max_steps_lost")
    assert lost[400] == 0, "the emergency checkpoint was at the step reached"
    ckpt_bytes = metric_history(spec, run_id, "checkpoint_bytes")
    emergency = [s for s in ckpt_bytes if s % 100]
    assert len(emergency) == 1 and 30 <= emergency[0] < 100, sorted(ckpt_bytes)
    assert_console_is_tidals(capfd, "preemption warning: saving an emergency checkpoint", "resumed from")
    cluster.remove_node(a)
    cluster.remove_node(spare)
    del b


def test_elastic_shrinks_on_node_loss_grows_back_and_counts_the_worker_hours_it_used(cluster, tmp_path, capfd):
    nodes = [n for n in cluster.worker_nodes]
    while len(nodes) < 2:
        nodes.append(add_worker_node(cluster))
    every, steps = 5, 160
    # Each micro-batch sleeps 60 ms until the group has grown back (tests/slow_step.py's hold), so that
    # the job still trains when the returning node is seen, however long Ray takes (node start plus
    # Ray's elastic check took over 20 s once): about 2 steps a second until then (a few dozen
    # steps done by the grow), ~6 after.
    hold = tmp_path / "hold"
    hold.touch()
    spec = tiny_spec(tmp_path, name="elastic", **{
        "train.steps": steps, "train.global_batch": 64, "checkpoint.every_steps": every,
        "scaling.min_workers": 1, "scaling.max_workers": 2, "scaling.elastic_check_s": 2,
        "train.step_fn": "tests.slow_step:step",
    }, worker_env=slow_env(0.06, hold))
    t, out = run_in_background(spec)
    wait_for_step(spec, every + 2)  # past the first checkpoint
    wait_for_world_size(spec, 2)  # an elastic group may start small while nodes settle, then grow
    cluster.remove_node(nodes[-1])
    wait_for_world_size(spec, 1)
    # The node returns once the shrunk group has saved (so the grow reshards a 1-worker checkpoint).
    run = RunDir(spec.checkpoint.storage, spec.name)
    before = run.latest_complete().step
    wait_for("a checkpoint at 1 worker", lambda: run.latest_complete().step > before, timeout=120)
    add_worker_node(cluster)
    wait_for_world_size(spec, 2)
    hold.unlink()
    result = finished(t, out)

    run_id = result.mlflow_run_id
    loss = metric_history(spec, run_id, "loss")
    world = metric_history(spec, run_id, "world_size")
    assert sorted(loss) == list(range(1, steps + 1)), "every step done, each logged once"
    sizes = [world[s] for s in sorted(world)]
    changes = [sizes[0]] + [b for a, b in zip(sizes, sizes[1:], strict=False) if a != b]
    assert changes[-3:] == [2, 1, 2], changes  # shrank on the node loss, grew back when it returned
    assert metric_history(spec, run_id, "max_steps_lost")[steps] <= every
    assert metric_history(spec, run_id, "resizes")[steps] == len(changes) - 1
    for s in sorted(loss)[1:]:  # continuous: no jump back towards the initial loss after a resize
        assert loss[s] < loss[1] * 0.9 or s < 20, (s, loss[s], loss[1])
    assert_gpu_hours_follow_the_world_size(spec, run_id)
    assert_console_is_tidals(capfd, "resharded for 1", "resharded for 2")


def assert_console_is_tidals(capfd, *said: str) -> None:
    """What the person who ran it read (`tidal.run` in this process, as from a notebook, which
    connected to Ray itself): Tidal's lines, which say a worker failed, the group restarted and
    resized, and no Ray or DeepSpeed chatter: not even the surviving worker's traceback (its collective
    failed when its peer's node went), whose error Tidal's line names (tracking/quiet.PeerLost).
    `said`: Tidal's lines the path must have printed."""
    printed = capfd.readouterr()
    with capfd.disabled():
        print(printed.out[-3000:])
    console = printed.out + printed.err
    assert "[tidal]" in console and all(line in console for line in said), console[-3000:]
    noise = chatter_in(console)
    assert not noise, "\n".join(noise[:40])


def assert_gpu_hours_follow_the_world_size(spec, run_id: str) -> None:
    """Issue 18: gpu_hours (worker-hours on CPU) is the integral of world size over time in the
    logged series, within 5%, not the final world size times the wall time."""
    client = __import__("mlflow").tracking.MlflowClient(spec.tracking.uri)
    run = client.get_run(run_id)
    # Each logged world size holds back to the previous point, or to its worker group's start if later.
    up = {m.step: m.value for m in client.get_metric_history(run_id, "uptime_s")}
    series = sorted((m.timestamp / 1000, m.value, up[m.step]) for m in client.get_metric_history(run_id, "world_size"))
    integral, prev = 0.0, None
    for t, w, uptime in series:
        start = t - uptime if prev is None else max(prev, t - uptime)
        integral += w * (t - start)
        prev = t
    gpu_hours = run.data.metrics["gpu_hours"]
    naive = run.data.metrics["world_size"] * (run.info.end_time - run.info.start_time) / 1000
    print(f"[gpu-hours] gpu_hours {gpu_hours * 3600:.1f} worker-s; integral of the series {integral:.1f}; "
          f"final world x wall {naive:.1f}")
    assert gpu_hours * 3600 == pytest.approx(integral, rel=0.05)
    assert gpu_hours * 3600 < 0.95 * naive, "not the final world size times the wall time"
    assert run.data.metrics["gpu_hours_cloud"] == 0, "no node here is labelled cloud"


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): sizing after a node loss also in the shrink/grow test
def test_after_a_failure_the_next_group_is_sized_without_the_lost_node(cluster):
    """Train V2's elastic policy sizes a new group from Ray's autoscaling coordinator, which looks at
    the nodes every 20 s; Tidal's ClusterView has it look again at a failure (tidal/launch/callbacks.py).
    Asks the coordinator as Train does, through Ray's own client, so a change in Ray fails here."""
    from ray.train import ScalingConfig
    from ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client import (
        TrainAutoscalingCoordinatorClient,
    )

    from tidal.launch.callbacks import ClusterView
    from tidal.ray_private import AUTOSCALING_COORDINATOR as COORDINATOR

    with contextlib.suppress(ValueError):  # a fresh coordinator: its next look is 20 s away
        ray.kill(ray.get_actor(COORDINATOR, namespace=COORDINATOR), no_restart=True)
    nodes = list(cluster.worker_nodes)
    while len(nodes) < 2:
        nodes.append(add_worker_node(cluster))
    train = TrainAutoscalingCoordinatorClient("test-elastic")
    train.send_resource_request(ScalingConfig(num_workers=(1, 2)), 2)

    def reserved_nodes() -> int:
        return len(ray.get(train._autoscaling_coordinator.get_reserved_resources.remote("test-elastic")))

    assert reserved_nodes() == 2
    cluster.remove_node(nodes[-1])
    wait_for("the removed node dead in Ray's view",
             lambda: not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == nodes[-1].node_id), 60, every=0.1)
    assert reserved_nodes() == 2, "Ray's own view still counts the lost node (why ClusterView exists)"
    view = ClusterView(every_s=0.1, for_s=0.0)
    view.after_exception(None, {0: RuntimeError("node lost")})
    assert reserved_nodes() == 1
    follow_up = view.thread
    follow_up.join(10)  # its one more look ends before the cluster goes
    assert not follow_up.is_alive() and view.thread is None
    train.cancel_resource_request()
