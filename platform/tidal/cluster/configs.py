"""Validate cluster configs: Ray's own cluster-launcher schema plus Tidal's conventions.

`validate_cluster_config(path)` returns one `(where, message)` pair per problem, empty when the
file is fine. `where` is a dotted key path (`available_node_types.gpu.resources.GPU`), so every
message names the node type and the key. Ray's check needs no cloud credentials because every
node type declares its `resources`.

Tidal's conventions, on top of Ray's schema (docs/cluster.md explains them):
- every node type carries the Ray label `tidal.io/site: onprem|cloud` AND the matching custom
  resource `site_onprem` / `site_cloud` (an integer), so placement works with either autoscaler;
- GPU counts are whole numbers; per-type `min_workers <= max_workers`; cloud GPU types start
  at `min_workers: 0` so that the autoscaler can release them;
- checkpoints go to shared storage, declared as `metadata.tidal.checkpoint_storage` (Ray keeps
  `metadata` and does not interpret it): a URI (s3://, gs://...) or a path that some setup
  command mounts (e.g. NFS in `initialization_commands`);
- token auth stays on: `RAY_AUTH_MODE=disabled` anywhere is an error.

A KubeRay `RayCluster` manifest gets the same conventions, checked on its groups.
"""

from __future__ import annotations

import copy
import difflib
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tidal.cluster import SITE_LABEL, SITES, site_resource

Problem = tuple[str, str]

# Providers whose nodes all live on this machine: any local path is shared by construction.
_SINGLE_MACHINE_PROVIDERS = ("fake_multinode",)
_FAKE_PROVIDER_MODULE = "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider"
_COMMAND_KEYS = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands")
# KubeRay: checkpoints in object storage instead of a mounted volume.
_K8S_STORAGE_ANNOTATION = "tidal.io/checkpoint-storage"
_AUTH_DISABLED = re.compile(r"RAY_AUTH_MODE\s*[=:]\s*[\"']?disabled", re.IGNORECASE)


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


# ---------------------------------------------------------------------------------------------
# Ray cluster launcher configs (ray up / ray start --autoscaling-config)
# ---------------------------------------------------------------------------------------------

def check_launcher(config: dict[str, Any]) -> list[Problem]:
    """Ray's schema first, then ours; both lists are reported so one run shows every fix."""
    problems = ray_schema_problems(config)
    if _provider_type(config) == "local":
        problems += _local_provider_problems(config)
    else:
        problems += _node_type_problems(config)
    problems += _storage_problems(config)
    problems += auth_problems(config)
    return problems


def ray_schema_problems(config: dict[str, Any]) -> list[Problem]:
    """Ray's own check: `prepare_config` (defaults) then `validate_config` (the JSON schema)."""
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    if _provider_type(config) == "local" and "available_node_types" in config:
        # Ray's prepare_config aborts the process with a log line here; say it ourselves.
        return [("available_node_types", "provider type 'local' accepts no available_node_types: "
                 "declare GPUs, labels and resources on the ray start lines (see cluster_configs/onprem.yaml)")]
    try:
        validate_config(_prepared(config, prepare_config))
    except jsonschema.ValidationError as e:
        where = ".".join(str(p) for p in e.absolute_path) or "<config>"
        return [(where, f"{e.message}{_did_you_mean(e)} (Ray's cluster config schema)")]
    except (ValueError, RuntimeError, KeyError, TypeError, NotImplementedError) as e:
        return [("<config>", f"{e} (Ray's cluster config check)")]
    return []


def _did_you_mean(e: Any) -> str:
    """For an unknown key, the closest key Ray's schema allows there."""
    if e.validator != "additionalProperties" or not isinstance(e.instance, dict):
        return ""
    allowed = list((e.schema.get("properties") or {}).keys())
    hints = [f"{k!r} -> {m[0]!r}" for k in e.instance if k not in allowed
             for m in [difflib.get_close_matches(str(k), allowed, n=1)] if m]
    return f"; did you mean {', '.join(hints)}?" if hints else ""


def _prepared(config: dict[str, Any], prepare_config: Any) -> dict[str, Any]:
    # The fake multi-node provider's defaults file is missing from the wheel, and Ray's monitor
    # reads such a config as written anyway: check it as written.
    if _provider_type(config) in _SINGLE_MACHINE_PROVIDERS:
        return copy.deepcopy(config)
    return prepare_config(copy.deepcopy(config))


def _node_type_problems(config: dict[str, Any]) -> list[Problem]:
    node_types = config.get("available_node_types")
    if not isinstance(node_types, dict) or not node_types:
        return [("available_node_types", "no node types: declare a head type and GPU worker types, "
                 "each with resources and the label tidal.io/site")]
    head = config.get("head_node_type")
    problems: list[Problem] = []
    for name, node in node_types.items():
        if isinstance(node, dict):
            problems += node_type_problems(f"available_node_types.{name}", node, is_head=name == head)
    return problems


def node_type_problems(where: str, node: dict[str, Any], is_head: bool = False) -> list[Problem]:
    """One node type: worker bounds, whole GPUs, the site label and its resource."""
    resources = node.get("resources")
    if not isinstance(resources, dict):
        return [(f"{where}.resources", "missing: declare the node's CPU, GPU and site resource "
                 "(e.g. {CPU: 8, GPU: 1, site_cloud: 1000}) so planning needs no cloud credentials")]
    problems = _bounds_problems(where, node.get("min_workers", 0), node.get("max_workers"),
                                "min_workers", "max_workers")
    problems += _gpu_problems(f"{where}.resources.GPU", resources.get("GPU"))
    labels = node.get("labels") if isinstance(node.get("labels"), dict) else {}
    site = labels.get(SITE_LABEL)
    problems += _site_problems(where, site, resources, f"labels.{SITE_LABEL}")
    if site == "cloud" and not is_head and resources.get("GPU") and node.get("min_workers", 0) > 0:
        problems.append((f"{where}.min_workers", f"{node['min_workers']} keeps cloud GPU nodes up "
                         "while idle; set min_workers: 0 so the autoscaler starts them on demand"))
    return problems


def _bounds_problems(where: str, low: Any, high: Any, low_key: str, high_key: str) -> list[Problem]:
    if isinstance(low, int) and isinstance(high, int) and low > high:
        return [(f"{where}.{low_key}", f"{low} is above {high_key} ({high}); set {low_key} <= {high_key}")]
    return []


def _gpu_problems(where: str, gpus: Any) -> list[Problem]:
    if gpus is None or (isinstance(gpus, int) and not isinstance(gpus, bool) and gpus >= 0):
        return []
    return [(where, f"{gpus!r} is not a whole number of GPUs; Ray schedules GPUs per node as an "
             "integer (a fractional GPU belongs in a job's gpus_per_worker, not in a node type)")]


def _site_problems(where: str, site: Any, resources: dict[str, Any], label_key: str) -> list[Problem]:
    """The site label names one site and the node declares that site's resource (and no other)."""
    if site not in SITES:
        got = "missing" if site is None else f"{site!r} is not a site"
        return [(f"{where}.{label_key}", f"{got}: label every node type {SITE_LABEL}: onprem or cloud "
                 "so that jobs can be placed by site")]
    wanted = site_resource(site)
    value = resources.get(wanted)
    problems: list[Problem] = []
    if value is None:
        problems.append((f"{where}.resources.{wanted}", f"missing: a node labelled {SITE_LABEL}={site} "
                         f"must also declare the custom resource {wanted} (e.g. {wanted}: 1000), which "
                         "jobs pinned to the site require"))
    elif not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        problems.append((f"{where}.resources.{wanted}", f"{value!r}: use a positive integer such as 1000"))
    for other in SITES:
        if other != site and site_resource(other) in resources:
            problems.append((f"{where}.resources.{site_resource(other)}",
                             f"a node labelled {SITE_LABEL}={site} must not declare {site_resource(other)}; remove it"))
    return problems


def _local_provider_problems(config: dict[str, Any]) -> list[Problem]:
    """provider: local has one implicit node type; each `ray start` line declares what its node has."""
    problems = _bounds_problems("<config>", config.get("min_workers"), config.get("max_workers"),
                                "min_workers", "max_workers")
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        line = " ".join(str(c) for c in config.get(key) or [] if "ray start" in str(c))
        if not line:
            problems.append((key, "no `ray start` line: add one that declares --num-gpus, "
                             f"--resources (site_onprem) and --labels ({SITE_LABEL}=onprem)"))
            continue
        flags = _start_flags(line)
        problems += _gpu_problems(f"{key}.--num-gpus", _number(flags.get("num-gpus")))
        site = _parse_labels(flags.get("labels", "")).get(SITE_LABEL)
        found = _site_problems(key, site, _parse_resources(flags.get("resources", "")), f"--labels {SITE_LABEL}")
        problems += [(w.replace(f"{key}.resources.", f"{key}.--resources."), m) for w, m in found]
    return problems


def _start_flags(line: str) -> dict[str, str]:
    """`--key=value` / `--key value` flags of a shell line (enough for `ray start`)."""
    try:
        words = shlex.split(line)
    except ValueError:
        words = line.split()
    flags: dict[str, str] = {}
    for i, word in enumerate(words):
        if not word.startswith("--"):
            continue
        key, eq, value = word[2:].partition("=")
        if not eq and i + 1 < len(words) and not words[i + 1].startswith("--"):
            value = words[i + 1]
        flags[key] = value
    return flags


def _number(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def _parse_labels(text: str) -> dict[str, str]:
    pairs = (item.partition("=") for item in text.split(",") if "=" in item)
    return {k.strip(): v.strip() for k, _, v in pairs}


def _parse_resources(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text.strip().strip("'\""))
    except ValueError:
        try:
            value = json.loads(json.loads(text))  # KubeRay's '"{\"a\": 1}"' form
        except (ValueError, TypeError):
            return {}
    return value if isinstance(value, dict) else {}


def _storage_problems(config: dict[str, Any]) -> list[Problem]:
    where = "metadata.tidal.checkpoint_storage"
    meta = config.get("metadata") if isinstance(config.get("metadata"), dict) else {}
    tidal = meta.get("tidal") if isinstance(meta.get("tidal"), dict) else {}
    storage = tidal.get("checkpoint_storage")
    if not isinstance(storage, str) or not storage:
        return [(where, "missing: name the storage every node shares for checkpoints "
                 "(an s3:// or gs:// URI, or a path that initialization_commands mount)")]
    if "://" in storage or _provider_type(config) in _SINGLE_MACHINE_PROVIDERS:
        return []
    if any("mount" in cmd and storage.rstrip("/") in cmd for cmd in _all_commands(config)):
        return []
    return [(where, f"{storage!r} is a local path that no command mounts; mount shared storage there "
             "in initialization_commands (e.g. `sudo mount -t nfs4 server:/export " f"{storage}`) "
             "or use an s3:// / gs:// URI")]


def _all_commands(config: dict[str, Any]) -> Iterator[str]:
    for key in _COMMAND_KEYS:
        yield from (str(c) for c in config.get(key) or [])
    for node in (config.get("available_node_types") or {}).values():
        if isinstance(node, dict):
            for key in ("initialization_commands", "worker_setup_commands"):
                yield from (str(c) for c in node.get(key) or [])


def auth_problems(config: Any) -> list[Problem]:
    """Token auth is Ray 2.60's default; a config that turns it off is refused."""
    problems = []
    for where, value in _walk(config, ""):
        if isinstance(value, str) and _AUTH_DISABLED.search(value):
            problems.append((where, "sets RAY_AUTH_MODE=disabled; keep token auth on (remove it and "
                             "give every node the token: ~/.ray/auth_token or RAY_AUTH_TOKEN)"))
        elif isinstance(value, dict) and value.get("name") == "RAY_AUTH_MODE" and value.get("value") == "disabled":
            problems.append((where, "sets RAY_AUTH_MODE to disabled; keep token auth on (value: token)"))
    return problems


def _walk(value: Any, where: str) -> Iterator[tuple[str, Any]]:
    yield where or "<config>", value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _walk(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _walk(v, f"{where}[{i}]")


def _provider_type(config: dict[str, Any]) -> str | None:
    provider = config.get("provider") if isinstance(config.get("provider"), dict) else {}
    if provider.get("type") == "external" and provider.get("module") == _FAKE_PROVIDER_MODULE:
        return "fake_multinode"
    return provider.get("type")


# ---------------------------------------------------------------------------------------------
# KubeRay RayCluster manifests (Ray's launcher schema does not apply; KubeRay builds the config)
# ---------------------------------------------------------------------------------------------

def check_kuberay(manifest: dict[str, Any]) -> list[Problem]:
    """Site labels and resources per group, autoscaling bounds, whole GPUs, shared storage, auth."""
    spec = manifest.get("spec") if isinstance(manifest.get("spec"), dict) else {}
    annotations = (manifest.get("metadata") or {}).get("annotations") or {}
    volumes_needed = "://" not in str(annotations.get(_K8S_STORAGE_ANNOTATION, ""))
    problems: list[Problem] = []
    if spec.get("enableInTreeAutoscaling") is not True:
        problems.append(("spec.enableInTreeAutoscaling", "not true: set it so that cloud worker groups "
                         "scale from 0 when a job bursts and back when idle"))
    head = spec.get("headGroupSpec")
    if not isinstance(head, dict):
        problems.append(("spec.headGroupSpec", "missing: a RayCluster needs a head group"))
    else:
        problems += kuberay_group_problems("spec.headGroupSpec", head, True, volumes_needed)
    groups = spec.get("workerGroupSpecs") or []
    if not groups:
        problems.append(("spec.workerGroupSpecs", "no worker groups: add an on-prem and a cloud GPU group"))
    for i, group in enumerate(groups):
        name = group.get("groupName", i) if isinstance(group, dict) else i
        if isinstance(group, dict):
            problems += kuberay_group_problems(f"spec.workerGroupSpecs[{name}]", group, False, volumes_needed)
    return problems + auth_problems(manifest)


def kuberay_group_problems(where: str, group: dict[str, Any], is_head: bool,
                           volumes_needed: bool = True) -> list[Problem]:
    params = group.get("rayStartParams") if isinstance(group.get("rayStartParams"), dict) else {}
    labels = {**_parse_labels(str(params.get("labels", ""))), **(group.get("labels") or {})}
    site = labels.get(SITE_LABEL)
    problems = _site_problems(where, site, _parse_resources(str(params.get("resources", ""))),
                              f"rayStartParams.labels {SITE_LABEL}")
    problems = [(w.replace(f"{where}.resources.", f"{where}.rayStartParams.resources."), m) for w, m in problems]
    problems += _gpu_problems(f"{where}.rayStartParams.num-gpus", _number(params.get("num-gpus")))
    containers = ((group.get("template") or {}).get("spec") or {}).get("containers") or []
    for c in containers:
        for kind in ("limits", "requests"):
            gpus = ((c.get("resources") or {}).get(kind) or {}).get("nvidia.com/gpu")
            problems += _gpu_problems(f"{where}.containers[{c.get('name')}].resources.{kind}.nvidia.com/gpu", _number(
                str(gpus)) if gpus is not None else None)
    if volumes_needed:
        problems += _kuberay_storage_problems(where, group)
    if is_head:
        return problems
    low, high = group.get("minReplicas", 0), group.get("maxReplicas")
    problems += _bounds_problems(where, low, high, "minReplicas", "maxReplicas")
    if high is None:
        problems.append((f"{where}.maxReplicas", "missing: bound how many nodes the autoscaler may start"))
    if site == "cloud" and isinstance(low, int) and low > 0:
        problems.append((f"{where}.minReplicas", f"{low} keeps cloud nodes up while idle; set minReplicas: 0"))
    return problems


def _kuberay_storage_problems(where: str, group: dict[str, Any]) -> list[Problem]:
    pod = (group.get("template") or {}).get("spec") or {}
    shared = {v.get("name") for v in pod.get("volumes") or []
              if isinstance(v, dict) and ({"persistentVolumeClaim", "nfs", "csi"} & v.keys())}
    mounted = {m.get("name") for c in pod.get("containers") or [] for m in c.get("volumeMounts") or []}
    if shared & mounted:
        return []
    return [(f"{where}.template.spec.volumes", "no shared volume mounted: mount a ReadWriteMany "
             "persistentVolumeClaim or nfs volume for checkpoints, or annotate the RayCluster with "
             f"{_K8S_STORAGE_ANNOTATION}: s3://bucket/path when checkpoints go to object storage")]


__all__ = ["Problem", "auth_problems", "check_kuberay", "check_launcher", "node_type_problems",
           "ray_schema_problems", "validate_cluster_config"]
