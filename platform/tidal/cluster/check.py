"""`tidal cluster validate`'s entry: a cluster config file -> every problem in it, whichever kind
it is (a Ray cluster launcher config, or Kubernetes manifests: KubeRay's RayCluster and RayJob, Kueue's queues). Its own module because `kuberay`
builds on `configs`' rules: the dispatch above both keeps either from importing the other."""

from __future__ import annotations

from pathlib import Path

import yaml

from tidal.admission.quotas import is_quota_file, named_quota_problems, quota_problems
from tidal.cluster.configs import _START_KEYS, Problem, check_launcher
from tidal.cluster.kuberay import check_kuberay, is_manifest, manifest_problems
from tidal.spec.parse import load_yaml


def validate_cluster_config(path: str | Path) -> list[Problem]:
    """Every problem in the cluster config at `path`, as (where, message); [] when it is fine."""
    if is_manifest(path):  # RayCluster, RayJob, Kueue's objects: one file may hold several
        return manifest_problems(path)
    try:
        config = load_yaml(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        return [("<file>", f"cannot read {path}: {e}")]
    if not isinstance(config, dict):
        return [("<file>", f"{path} holds no mapping; a cluster config is a YAML mapping of keys")]
    if config.get("kind") == "RayCluster":
        return check_kuberay(config)
    if is_quota_file(config):
        return quota_problems(config)
    return check_launcher(config) + named_quota_problems(config, _START_KEYS, Path(path).parent)


__all__ = ["validate_cluster_config"]
