"""`tidal cluster validate`'s entry: a cluster config file -> every problem in it, whichever kind
it is (a Ray cluster launcher config, Kubernetes manifests: KubeRay's RayCluster and RayJob, Kueue's queues,
or a quota file), and the quota files a launcher config's `ray start` commands name. Its own module because
`kuberay` builds on `configs`' rules: the dispatch above both keeps either from importing the other. The quota
file's own rules are the team queue's (admission/quotas.py), which this checks a file against from above."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from tidal.admission.quotas import QUOTAS_VAR, quota_problems
from tidal.cluster.configs import _START_KEYS, Problem, check_launcher
from tidal.cluster.kuberay import check_kuberay, is_manifest, manifest_problems
from tidal.cluster.shell import runs, shell_steps
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


def is_quota_file(data: Mapping[str, Any]) -> bool:
    """A parsed YAML file that is a quota file rather than a cluster config (both live in cluster_configs/)."""
    return "teams" in data and "provider" not in data and "kind" not in data


def named_quota_problems(config: Mapping[str, Any], start_keys: Iterable[str], config_dir: Path) -> list[Problem]:
    """The quota file each `ray start` command names in TIDAL_QUOTAS, checked where it can be read."""
    problems: list[Problem] = []
    for key in start_keys:
        for i, command in enumerate(str(c) for c in config.get(key) or []):
            for env, words in shell_steps(command):
                if runs(words, "ray", "start") and QUOTAS_VAR in env:
                    problems += named_file_problems(f"{key}[{i}].{QUOTAS_VAR}", env[QUOTAS_VAR], config_dir)
    return problems


def named_file_problems(where: str, value: str, config_dir: Path) -> list[Problem]:
    """The named quota file, checked at its path if it exists here, else as the file of the same
    name beside the config (the copy that is deployed to that path). A path that exists only on
    the cluster cannot be read here: `tidal cluster validate` on the file itself checks it."""
    if "://" not in value and not value.startswith(("/", "~", "$")):
        return [(where, f"{value!r} is relative, and each node would resolve it elsewhere: use an absolute path "
                 "on the head's disk or the shared storage, or an s3:// / gs:// URI")]
    candidates = [] if "://" in value else [Path(os.path.expandvars(os.path.expanduser(value)))]
    candidates.append(config_dir / Path(value.rstrip("/")).name)
    found = next((p for p in candidates if p.is_file()), None)
    if found is None:
        return []
    try:
        data = load_yaml(found.read_text())
    except yaml.YAMLError as e:
        return [(where, f"{found} is not YAML: {e}")]
    return [(f"{where} ({found.name}) {key}", msg) for key, msg in quota_problems(data)]


__all__ = ["is_quota_file", "named_file_problems", "named_quota_problems", "validate_cluster_config"]
