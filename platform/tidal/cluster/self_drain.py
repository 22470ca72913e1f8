"""Drain the Ray node this process runs on, with a deadline: what a cloud's interruption notice
(cluster/notice_watch.py) and a Kubernetes pod's `preStop` (`tidal cluster drain-node`) both do,
so that the job's own preemption path runs (Ray Train reads the drain, Tidal's workers save an
emergency checkpoint at the step reached, Ray restarts the group elsewhere after the deadline).

Ray's DrainNode RPC is the one private call (tidal/ray_private.py); no driver is connected, so a
watcher on every node costs no Ray worker process.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from tidal import ray_private
from tidal.errors import ClusterError

POD_IP_ENV = "MY_POD_IP"  # KubeRay's downward-API variable in every Ray container


def gcs_address(address: str | None) -> str:
    """The cluster's GCS address: `--address`, else RAY_ADDRESS (host:port, as `ray start` takes)."""
    found = address or os.environ.get("RAY_ADDRESS")
    if not found or found in ("auto", "local") or found.startswith(("http://", "https://", "ray://")):
        raise ClusterError(f"which cluster? got {found!r}: pass --address HEAD:6379 (the GCS address this "
                           "node's `ray start --address` used)")
    return found


def this_node_id(address: str, node_id: str | None = None, ip: str | None = None, timeout_s: float = 30.0) -> str:
    """This node's Ray id: `node_id` when given, else the one alive node at this host's address (a
    KubeRay pod's MY_POD_IP, which KubeRay sets from the pod's status), waited for up to `timeout_s`:
    the watcher may start before its raylet has registered."""
    if node_id:
        return node_id
    import ray.util

    ip = ip or os.environ.get(POD_IP_ENV) or ray.util.get_node_ip_address()
    deadline = time.time() + timeout_s
    while True:
        nodes = [n for n, at in ray_private.alive_nodes(address).items() if at == ip]
        if len(nodes) == 1:
            return nodes[0]
        if len(nodes) > 1:
            raise ClusterError(f"{len(nodes)} Ray nodes run at {ip} ({', '.join(sorted(nodes))}): pass --node-id "
                               "to say which one this is")
        if time.time() >= deadline:
            raise ClusterError(f"no alive Ray node at {ip} in the cluster at {address} after {timeout_s:.0f} s: "
                               "start it (`ray start --address ...`) first, or pass --node-id")
        time.sleep(1.0)


def drainer(address: str, node_id: str) -> Callable[[float, str], tuple[bool, str]]:
    """drain(deadline_s, reason) -> (accepted, Ray's reason for refusing) for this node."""
    def drain(deadline_s: float, reason: str) -> tuple[bool, str]:
        return ray_private.drain_node(address, node_id, reason, int(deadline_s * 1000))
    return drain


def drain_and_wait(address: str, node_id: str, deadline_s: float, reason: str,
                   say: Callable[[str], None], sleep: Callable[[float], None] = time.sleep) -> bool:
    """A pod's `preStop`: drain this node for `deadline_s` from now, then wait out the deadline.
    Ray Train keeps the group until the deadline (Tidal's workers save at their next log step, then
    train no further) and only then restarts it on other nodes; the node must stay up until then,
    or the save dies with it. Returns whether Ray accepted the drain."""
    until = time.time() + deadline_s
    accepted, why = ray_private.drain_node(address, node_id, reason, int(until * 1000))
    if not accepted:
        say(f"Ray refused to drain node {node_id}: {why}; the node goes without a warning to its jobs")
        return False
    say(f"drained node {node_id} ({reason}): its jobs save at the step reached; waiting {deadline_s:.0f} s "
        "for the deadline")
    while (left := until - time.time()) > 0:
        sleep(min(left, 1.0))
    return True
