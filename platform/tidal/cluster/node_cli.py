"""`tidal cluster watch-notices` and `tidal cluster drain-node`: the commands a node runs for itself
(started by the cluster configs: after `ray start`, and as a Kubernetes pod's `preStop`), so that a
warning the cloud or Kubernetes gives becomes a Ray drain and the job's emergency checkpoint.
Argument parsing and printing only; imports nothing heavy at module level."""

from __future__ import annotations

import argparse
from typing import Any


def say(line: str) -> None:
    print(f"[tidal] {line}", flush=True)


def register_node_commands(sub: Any) -> None:
    w = sub.add_parser("watch-notices", help="drain this Ray node when its cloud announces an interruption",
                       description="Read this instance's metadata service (AWS spot instance-action and rebalance "
                       "recommendation with IMDSv2, GCE instance/preempted, Azure Scheduled Events Preempt) and, on "
                       "an interruption notice, drain this Ray node with the notice's deadline, so that its jobs save "
                       "an emergency checkpoint at the step reached. Without a metadata service it says so once and "
                       "exits 0. Run it on each node after `ray start` (docs/cluster.md).")
    _node_flags(w)
    w.add_argument("--cloud", choices=["auto", "aws", "gcp", "azure"], default="auto",
                   help="whose metadata service to read (default: auto, the one that answers; none: exit 0)")
    w.add_argument("--endpoint", default=None, help="the metadata service's base URL (default: "
                   "$TIDAL_METADATA_ENDPOINT, else http://169.254.169.254)")
    w.add_argument("--poll-s", type=float, default=5.0, help="seconds between reads (default: 5, AWS's advice)")
    w.set_defaults(func=_watch)
    d = sub.add_parser("drain-node", help="drain this Ray node with a deadline and wait for it (a pod's preStop)",
                       description="Tell Ray this node goes in --deadline-s seconds (a preemption drain): its jobs "
                       "save an emergency checkpoint at the step reached and Ray restarts them on other nodes at the "
                       "deadline. Waits until then, so that the node outlives the save. The Kubernetes manifests in "
                       "cluster_configs/kuberay/ run it as each worker's preStop.")
    _node_flags(d)
    d.add_argument("--deadline-s", type=float, required=True,
                   help="seconds from now until the node goes (a pod's terminationGracePeriodSeconds less a margin)")
    d.set_defaults(func=_drain)


def _node_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=None, help="the cluster's GCS address, HEAD:6379 (default: $RAY_ADDRESS)")
    p.add_argument("--node-id", default=None, help="this node's Ray id (default: the one Ray node at this host's address)")


def _watch(args: argparse.Namespace) -> int:
    from tidal.cluster.notice_watch import run_watcher

    return run_watcher(args.address, args.node_id, args.cloud, args.endpoint, args.poll_s, say)


def _drain(args: argparse.Namespace) -> int:
    from tidal.cluster.self_drain import drain_and_wait, gcs_address, this_node_id

    address = gcs_address(args.address)
    node = this_node_id(address, args.node_id)
    reason = f"the node goes in {args.deadline_s:.0f} s (Kubernetes is stopping its pod)"
    return 0 if drain_and_wait(address, node, args.deadline_s, reason, say) else 1
