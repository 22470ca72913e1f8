"""A multi-node Ray cluster on this machine, one raylet per simulated node (`ray.cluster_utils.Cluster`):
a head with no CPUs, so that Ray Train's workers land on the 1-CPU worker nodes a test adds and
removes (node loss, preemption, regrowth). Shut down by Ray's own Cluster, which stops the
processes it started, by PID.

Ray's Cluster gives each node a 150 MiB object store (a test default; a real node's is 30% of its
memory). What moves state through the object store at a real size (the memory tier's hand-over to
its keepers and its restore) needs `object_store_bytes`: past capacity Ray falls back to allocating
objects on disk, and a measure of it would be one of that fallback."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def raylet_cluster(workers: int = 0, cpus_per_node: int = 1, connect: bool = True,
                   object_store_bytes: int | None = None) -> Iterator[Any]:
    """A `ray.cluster_utils.Cluster` with `workers` worker nodes registered; `connect`: this process
    is its driver (`ray.init`) for the block; `object_store_bytes`: each worker node's object store
    (None: Ray's test default, 150 MiB). Start it after any environment its nodes must inherit
    (e.g. `moto_s3`'s endpoint)."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=connect, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for _ in range(workers):
            cluster.add_node(num_cpus=cpus_per_node, **_store(object_store_bytes))
        if workers:
            cluster.wait_for_nodes()
        yield cluster
    finally:
        if connect:
            ray.shutdown()
        cluster.shutdown()


def add_worker_node(cluster: Any, cpus: int = 1, object_store_bytes: int | None = None) -> Any:
    """A worker node, registered before it returns."""
    node = cluster.add_node(num_cpus=cpus, **_store(object_store_bytes))
    cluster.wait_for_nodes()
    return node


def _store(object_store_bytes: int | None) -> dict[str, int]:
    return {"object_store_memory": object_store_bytes} if object_store_bytes else {}
