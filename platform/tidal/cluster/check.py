"""`tidal cluster validate`'s entry: a cluster config file -> every problem in it, whichever kind
it is (a Ray cluster launcher config, or a KubeRay RayCluster). Its own module because `kuberay`
builds on `configs`' rules: the dispatch above both keeps either from importing the other."""

from __future__ import annotations

from pathlib import Path

import yaml

from tidal.cluster.configs import Problem, check_launcher
from tidal.cluster.kuberay import check_kuberay


def validate_cluster_config(path: str | Path) -> list[Problem]:
    """Every problem in the cluster config at `path`, as (where, message); [] when it is fine."""
    try:
        config = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        return [("<file>", f"cannot read {path}: {e}")]
    if not isinstance(config, dict):
        return [("<file>", f"{path} holds no mapping; a cluster config is a YAML mapping of keys")]
    if config.get("kind") == "RayCluster":
        return check_kuberay(config)
    return check_launcher(config)


__all__ = ["validate_cluster_config"]
