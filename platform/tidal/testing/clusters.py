"""A multi-node Ray cluster on this machine, one raylet per simulated node (`ray.cluster_utils.Cluster`):
a head with no CPUs, so that Ray Train's workers land on the 1-CPU worker nodes a test adds and
removes (node loss, preemption, regrowth). Shut down by Ray's own Cluster, which stops the
processes it started, by PID."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def raylet_cluster(workers: int = 0, cpus_per_node: int = 1, connect: bool = True) -> Iterator[Any]:
    """A `ray.cluster_utils.Cluster` with `workers` worker nodes registered; `connect`: this process
    is its driver (`ray.init`) for the block. Start it after any environment its nodes must inherit
    (e.g. `moto_s3`'s endpoint)."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=connect, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for _ in range(workers):
            cluster.add_node(num_cpus=cpus_per_node)
        if workers:
            cluster.wait_for_nodes()
        yield cluster
    finally:
        if connect:
            ray.shutdown()
        cluster.shutdown()


def add_worker_node(cluster: Any, cpus: int = 1) -> Any:
    """A worker node, registered before it returns."""
    node = cluster.add_node(num_cpus=cpus)
    cluster.wait_for_nodes()
    return node
