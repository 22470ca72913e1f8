"""Validate cluster configs: Ray's own cluster-launcher schema plus Tidal's conventions.

`tidal.cluster.check.validate_cluster_config(path)` returns one `(where, message)` pair per problem, empty when the
file is fine. `where` is a dotted key path (`available_node_types.gpu.resources.GPU`), so every
message names the node type and the key. Ray's check needs no cloud credentials because every
node type declares its `resources`.

Tidal's conventions, on top of Ray's schema (docs/cluster.md explains them):
- every node type carries the Ray label `tidal.io/site: onprem|cloud` AND the matching custom
  resource `site_onprem` / `site_cloud` (an integer), so placement works with either autoscaler;
- GPU counts are whole numbers; per-type `min_workers <= max_workers`; cloud GPU types start
  at `min_workers: 0` so that the autoscaler can release them;
- where jobs store and track is the cluster's to say: every `ray start` command sets
  `TIDAL_STORAGE` (an s3:// / gs:// URI, or a path that some command mounts) and
  `MLFLOW_TRACKING_URI` (an http(s):// server), since variables on that command line reach every
  job and worker the node starts; the head starts that `mlflow server`, with its database on the
  head's disk and its artifacts on the shared storage;
- token auth stays on: `RAY_AUTH_MODE=disabled` anywhere is an error;
- nothing is exposed that should not be (cluster/exposure.py): MLflow off loopback runs MLflow's
  authentication app and binds the head's private address, its jobs carry MLflow credentials, Ray's
  dashboard stays off public addresses, and no secret is written inline;
- every node type says what it costs: the label `tidal.io/price-per-hour` (tidal/prices.py).

A KubeRay `RayCluster` manifest gets the same conventions, checked on its groups (kuberay.py).
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any
from urllib.parse import urlparse

from tidal.cluster.exposure import (
    auth_app_problems,
    auth_problems,
    credential_problems,
    dashboard_problems,
    inline_secret_problems,
    mlflow_exposure_problems,
)
from tidal.cluster.shell import (
    flags_of,
    number,
    parse_labels,
    parse_resources,
    runs,
    shell_steps,
    shell_words,
    under,
)
from tidal.prices import PRICE_LABEL, price_problems
from tidal.ray_private import FAKE_PROVIDER_MODULE, check_with_ray_schema
from tidal.sites import SITE_LABEL, SITES, site_resource

Problem = tuple[str, str]

STORAGE_VAR, TRACKING_VAR = "TIDAL_STORAGE", "MLFLOW_TRACKING_URI"
# Providers whose nodes all live on this machine: any local path is shared by construction.
_SINGLE_MACHINE_PROVIDERS = ("fake_multinode",)
_FAKE_PROVIDER_MODULE = FAKE_PROVIDER_MODULE
_COMMAND_KEYS = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands")
_START_KEYS = ("head_start_ray_commands", "worker_start_ray_commands")
_LOOPBACK = ("localhost", "127.0.0.1", "::1", "0.0.0.0")


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
    problems += _environment_problems(config)
    problems += _mlflow_problems(config)
    problems += _exposure_problems(config)
    problems += auth_problems(config)
    return problems


def ray_schema_problems(config: dict[str, Any]) -> list[Problem]:
    """Ray's own check: `prepare_config` (defaults) then `validate_config` (the JSON schema)."""
    import jsonschema
    if _provider_type(config) == "local" and "available_node_types" in config:
        # Ray's prepare_config aborts the process with a log line here; say it ourselves.
        return [("available_node_types", "provider type 'local' accepts no available_node_types: "
                 "declare GPUs, labels and resources on the ray start lines (see cluster_configs/onprem.yaml)")]
    try:
        check_with_ray_schema(config, _prepared)
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
    problems = bounds_problems(where, node.get("min_workers", 0), node.get("max_workers"),
                               "min_workers", "max_workers")
    problems += gpu_problems(f"{where}.resources.GPU", resources.get("GPU"))
    labels = node.get("labels") if isinstance(node.get("labels"), dict) else {}
    site = labels.get(SITE_LABEL)
    problems += site_problems(where, site, resources, f"labels.{SITE_LABEL}")
    problems += price_problems(where, labels, f"labels.{PRICE_LABEL}")
    if site == "cloud" and not is_head and resources.get("GPU") and node.get("min_workers", 0) > 0:
        problems.append((f"{where}.min_workers", f"{node['min_workers']} keeps cloud GPU nodes up "
                         "while idle; set min_workers: 0 so the autoscaler starts them on demand"))
    return problems


def bounds_problems(where: str, low: Any, high: Any, low_key: str, high_key: str) -> list[Problem]:
    if isinstance(low, int) and isinstance(high, int) and low > high:
        return [(f"{where}.{low_key}", f"{low} is above {high_key} ({high}); set {low_key} <= {high_key}")]
    return []


def gpu_problems(where: str, gpus: Any) -> list[Problem]:
    if gpus is None or (isinstance(gpus, int) and not isinstance(gpus, bool) and gpus >= 0):
        return []
    return [(where, f"{gpus!r} is not a whole number of GPUs; Ray schedules GPUs per node as an "
             "integer (a fractional GPU belongs in a job's gpus_per_worker, not in a node type)")]


def site_problems(where: str, site: Any, resources: dict[str, Any], label_key: str) -> list[Problem]:
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
    problems = bounds_problems("<config>", config.get("min_workers"), config.get("max_workers"),
                               "min_workers", "max_workers")
    for key in _START_KEYS:
        line = " ".join(str(c) for c in config.get(key) or [] if "ray start" in str(c))
        if not line:
            problems.append((key, "no `ray start` line: add one that declares --num-gpus, "
                             f"--resources (site_onprem) and --labels ({SITE_LABEL}=onprem)"))
            continue
        flags = flags_of(shell_words(line))
        problems += gpu_problems(f"{key}.--num-gpus", number(flags.get("num-gpus")))
        labels = parse_labels(flags.get("labels", ""))
        found = site_problems(key, labels.get(SITE_LABEL), parse_resources(flags.get("resources", "")),
                              f"--labels {SITE_LABEL}")
        problems += [(w.replace(f"{key}.resources.", f"{key}.--resources."), m) for w, m in found]
        problems += price_problems(key, labels, f"--labels {PRICE_LABEL}")
    return problems


def _environment_problems(config: dict[str, Any]) -> list[Problem]:
    """Every `ray start` sets TIDAL_STORAGE and MLFLOW_TRACKING_URI on its own command line."""
    fake = _provider_type(config) in _SINGLE_MACHINE_PROVIDERS
    problems = _old_storage_key(config)
    for key in _START_KEYS:
        is_head, commands = key == _START_KEYS[0], [str(c) for c in config.get(key) or []]
        starts = [(i, env) for i, c in enumerate(commands) for env, words in shell_steps(c) if runs(words, "ray", "start")]
        if not starts and _provider_type(config) != "local" and (is_head or not fake):
            problems.append((key, f"no `ray start` command: add one that sets {STORAGE_VAR} and {TRACKING_VAR}"))
        for i, env in starts:
            earlier = {n for c in commands[:i] for e, w in shell_steps(c) if w[:1] == ["export"] for n in e}
            problems += [(f"{key}[{i}].{var}", _missing_env(var, is_head, var in earlier))
                         for var in (STORAGE_VAR, TRACKING_VAR) if var not in env]
            if STORAGE_VAR in env:
                problems += storage_problems(f"{key}[{i}].{STORAGE_VAR}", env[STORAGE_VAR], partial(_shared, config),
                                             "that no command mounts; mount shared storage there in "
                                             "initialization_commands (e.g. `sudo mount -t nfs4 server:/export "
                                             f"{env[STORAGE_VAR]}`)")
            if TRACKING_VAR in env:
                problems += tracking_problems(f"{key}[{i}].{TRACKING_VAR}", env[TRACKING_VAR], fake, is_head)
    return problems


def _missing_env(var: str, is_head: bool, exported_earlier: bool) -> str:
    example = {STORAGE_VAR: f"`{var}=s3://bucket/tidal-runs` (or gs://..., or a path every node mounts)",
               TRACKING_VAR: f"`{var}=http://{'127.0.0.1' if is_head else '$RAY_HEAD_IP'}:5000` (the head's mlflow server)"}
    hint = (" An `export` in an earlier command does not reach it: Ray's launcher runs each command in "
            "its own shell.") if exported_earlier else ""
    return (f"this `ray start` does not set {var}: put {example[var]} in front of `ray start` in this command; "
            f"variables on that line reach every job and worker the node starts.{hint}")


def _old_storage_key(config: dict[str, Any]) -> list[Problem]:
    meta = config.get("metadata") if isinstance(config.get("metadata"), dict) else {}
    old = (meta.get("tidal") or {}).get("checkpoint_storage") if isinstance(meta.get("tidal"), dict) else None
    if old is None:
        return []
    return [("metadata.tidal.checkpoint_storage", f"is replaced by {STORAGE_VAR} on every node: remove it and "
             f"put `{STORAGE_VAR}={old}` on every `ray start` command")]


def _mlflow_problems(config: dict[str, Any]) -> list[Problem]:
    """The head starts the `mlflow server` that MLFLOW_TRACKING_URI points at."""
    key, fake = _START_KEYS[0], _provider_type(config) in _SINGLE_MACHINE_PROVIDERS
    for i, env, words in _mlflow_servers(config):
        return (mlflow_server_problems(f"{key}[{i}]", words, partial(_shared, config), single_machine=fake)
                + auth_app_problems(f"{key}[{i}]", flags_of(words), env))
    return [(key, "no `mlflow server`: start MLflow on the head in the background, with authentication on the "
             "head's private address, as cluster_configs/aws-burst.yaml does (`nohup mlflow server --app-name "
             "basic-auth --host $HEAD_IP --port 5000 --backend-store-uri sqlite:///$HOME/mlflow/mlflow.db "
             "--artifacts-destination s3://bucket/mlartifacts ... &`, its settings and secrets read from files), "
             "and point MLFLOW_TRACKING_URI at it on every node")]


def _mlflow_servers(config: dict[str, Any]) -> Iterator[tuple[int, dict[str, str], list[str]]]:
    """(index, environment, words) of each `mlflow server` among the head's start commands."""
    for i, command in enumerate(str(c) for c in config.get(_START_KEYS[0]) or []):
        for env, words in shell_steps(command):
            if runs(words, "mlflow", "server"):
                yield i, env, words


def _exposure_problems(config: dict[str, Any]) -> list[Problem]:
    """Inline secrets in any command; on every `ray start`, the dashboard's address and, when the
    head's MLflow asks for a password, the credentials its jobs write with (cluster/exposure.py)."""
    auth = any(flags_of(words).get("app-name") for _, _, words in _mlflow_servers(config))
    problems: list[Problem] = []
    for key in (*_COMMAND_KEYS, *_START_KEYS):
        for i, command in enumerate(str(c) for c in config.get(key) or []):
            for env, words in shell_steps(command):
                problems += inline_secret_problems(f"{key}[{i}]", env)
                if runs(words, "ray", "start"):
                    problems += dashboard_problems(f"{key}[{i}]", flags_of(words))
                    problems += credential_problems(f"{key}[{i}]", env) if auth and key in _START_KEYS else []
    return list(dict.fromkeys(problems))  # an `export` reaches every later step of its line: report it once


def _shared(config: dict[str, Any], path: str) -> bool:
    """Every node sees `path`: all nodes are this machine, or some setup command mounts it."""
    return _provider_type(config) in _SINGLE_MACHINE_PROVIDERS or _mounted(config, path)


def _mounted(config: dict[str, Any], path: str) -> bool:
    """`path` is, or lies under, a folder that some setup command mounts."""
    return any(w.startswith("/") and under(path, w) for c in _all_commands(config) if "mount" in c
               for w in shell_words(c))


def _all_commands(config: dict[str, Any]) -> Iterator[str]:
    for key in _COMMAND_KEYS:
        yield from (str(c) for c in config.get(key) or [])
    for node in (config.get("available_node_types") or {}).values():
        if isinstance(node, dict):
            for key in ("initialization_commands", "worker_setup_commands"):
                yield from (str(c) for c in node.get(key) or [])


# ---------------------------------------------------------------------------------------------
# Rules shared with KubeRay manifests: where jobs store and track, MLflow on the head, auth
# ---------------------------------------------------------------------------------------------

def storage_problems(where: str, value: str, shared: Callable[[str], bool], mount_hint: str) -> list[Problem]:
    """A place every node reaches: an object-store URI, or an absolute path on shared storage."""
    if "://" in value:
        return []
    if not value.startswith(("/", "~", "$")):
        return [(where, f"{value!r} is relative, so each job would resolve it inside its own working "
                 "directory; use an absolute path every node mounts or an s3:// / gs:// URI")]
    if shared(value):
        return []
    return [(where, f"{value!r} is a local path {mount_hint}, or use an s3:// / gs:// URI")]


def tracking_problems(where: str, value: str, single_machine: bool, on_head: bool) -> list[Problem]:
    """An MLflow server that this node reaches (a SQLite file only when every node is one machine)."""
    if value.startswith(("http://", "https://")):
        if not (single_machine or on_head) and urlparse(value).hostname in _LOOPBACK:
            return [(where, f"{value!r} points at this worker itself, which runs no MLflow server; point "
                     "it at the head's, e.g. http://$RAY_HEAD_IP:5000")]
        return []
    if single_machine and value.startswith(("sqlite:////", "sqlite:///$")):
        return []
    return [(where, f"{value!r} is not an MLflow server every node reaches: set http://<head>:5000, the "
             "mlflow server the head starts (an absolute sqlite://// file only on a single-machine cluster)")]


def mlflow_server_problems(where: str, words: list[str], shared: Callable[[str], bool],
                           single_machine: bool = False, single_interface: bool = False) -> list[Problem]:
    """`mlflow server` flags: a database on the head's disk, artifacts on shared storage, reachable,
    and locked when reachable (`single_interface`: in a pod, where 0.0.0.0 is the pod's own IP)."""
    flags = flags_of(words)
    problems: list[Problem] = []
    if not flags.get("backend-store-uri"):
        problems.append((f"{where}.--backend-store-uri", "missing: MLflow would keep runs wherever the command "
                         "runs; keep its database on the head's disk, e.g. --backend-store-uri "
                         "sqlite:///$HOME/mlflow/mlflow.db"))
    artifacts_key = "artifacts-destination" if flags.get("artifacts-destination") else "default-artifact-root"
    artifacts = flags.get(artifacts_key)
    if not artifacts:
        problems.append((f"{where}.--artifacts-destination", "missing: MLflow would keep artifacts in "
                         "./mlartifacts on the head; put them on the shared storage, e.g. "
                         "--artifacts-destination s3://bucket/mlartifacts (or a path every node mounts)"))
    else:
        problems += storage_problems(f"{where}.--{artifacts_key}", artifacts, shared, "that other nodes "
                                     f"cannot read; put the artifacts on the storage {STORAGE_VAR} uses")
    if not single_machine and flags.get("host", "127.0.0.1") in ("127.0.0.1", "localhost"):
        problems.append((f"{where}.--host", "MLflow listens on this machine only (127.0.0.1 is its default), "
                         "so other nodes cannot reach it; bind the head's private address with authentication: "
                         "--app-name basic-auth --host $HEAD_IP (see cluster_configs/aws-burst.yaml)"))
    return problems + mlflow_exposure_problems(where, flags, single_interface)


def _provider_type(config: dict[str, Any]) -> str | None:
    provider = config.get("provider") if isinstance(config.get("provider"), dict) else {}
    if provider.get("type") == "external" and provider.get("module") == _FAKE_PROVIDER_MODULE:
        return "fake_multinode"
    return provider.get("type")


__all__ = ["STORAGE_VAR", "TRACKING_VAR", "Problem", "check_launcher", "node_type_problems",
           "ray_schema_problems"]
