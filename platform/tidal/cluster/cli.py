"""`tidal cluster validate FILE...` and `tidal cluster status`: argument parsing and printing only.

Imports nothing heavy at module level, so that `tidal --help` never loads ray.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from tidal.output import add_output_flag, print_json


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `cluster` command to the `tidal` parser's subparsers; returns its parser."""
    c = subparsers.add_parser("cluster", help="check cluster configs; show nodes by site and where jobs run",
                              description="Cluster configs and cluster state (see docs/cluster.md).")
    sub = c.add_subparsers(title="cluster commands", metavar="COMMAND")
    v = sub.add_parser("validate", help="check cluster configs with Ray's schema and Tidal's conventions",
                       description="Check Ray cluster launcher YAMLs and KubeRay RayCluster manifests: Ray's "
                       "schema, site labels and resources, whole GPUs, worker bounds, token auth, TIDAL_STORAGE / "
                       "MLFLOW_TRACKING_URI on every node with an mlflow server on the head, and what is exposed: "
                       "MLflow off loopback only with authentication on a private address, no dashboard on a "
                       "public address, no secret written inline (docs/security.md).")
    v.add_argument("files", nargs="+", metavar="FILE", help="e.g. cluster_configs/*.yaml cluster_configs/kuberay/*.yaml")
    v.set_defaults(func=validate_command)
    s = sub.add_parser("status", help="nodes by site with GPUs used/free, pending demand, where jobs run",
                       description="Connects to the cluster's GCS and prints nodes by site, the autoscaler's "
                       "pending demand and the Ray Train workers of each job.")
    s.add_argument("--address", default=None,
                   help="Ray cluster (GCS) address, e.g. head:6379 (default: $RAY_ADDRESS, else 'auto')")
    add_output_flag(s, "an object with nodes (node_id, site, ip, gpus_total, gpus_used, cpus_total, cpus_used), "
                    "autoscaler (pending_launches, pending_nodes, resource_demand, pg_demand, request_demand; null "
                    "without an autoscaler) and workers (job_id, node_id, site, workers: Ray Train workers there)")
    s.set_defaults(func=status_command)
    from tidal.cluster.node_cli import register_node_commands

    register_node_commands(sub)
    c.set_defaults(func=lambda _args: c.print_help() or 0)
    return c


def validate_command(args: argparse.Namespace) -> int:
    """Exit 0 with one `ok` line per good file; exit 2 with one line per problem otherwise."""
    from tidal.cluster.check import validate_cluster_config

    bad = 0
    for path in args.files:
        problems = validate_cluster_config(path)
        if not problems:
            print(f"ok  {path}")
            continue
        bad += 1
        print(f"{path}: {len(problems)} problem(s)")
        for where, message in problems:
            print(f"  {where}: {message}")
    return 2 if bad else 0


def status_command(args: argparse.Namespace) -> int:
    from tidal.cluster.status import cluster_record, cluster_status

    _connect(args.address or os.environ.get("RAY_ADDRESS") or "auto")
    if args.output == "json":
        print_json(cluster_record())
    else:
        print(cluster_status())
    return 0


def _connect(address: str) -> None:
    import logging

    import ray

    from tidal.errors import ClusterError

    if address.startswith(("http://", "https://")):
        raise ClusterError(f"--address {address} is a dashboard URL; cluster status needs the GCS address "
                           "(e.g. head:6379), as `ray status --address` does")
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    except ConnectionError as e:
        raise ClusterError(f"cannot reach a Ray cluster at {address!r}: {e}. Start one (`ray up`, `ray start "
                           "--head`) or pass --address head:6379; with token auth set RAY_AUTH_MODE=token") from e


__all__ = ["register", "status_command", "validate_command"]
