"""Validate a KubeRay `RayCluster` manifest with Tidal's conventions (Ray's launcher schema does
not apply; KubeRay builds the Ray config itself).

Checked on the head group and every worker group: the site label and resource in
`rayStartParams`, whole GPUs, autoscaling bounds, and `TIDAL_STORAGE` / `MLFLOW_TRACKING_URI` in
the `env` of every container (a path in TIDAL_STORAGE must lie on a shared volume that container
mounts); on the head, a container that runs `mlflow server`, with authentication, and every
container's jobs carry MLflow credentials; no secret as a literal env value; the head service stays
inside the Kubernetes cluster; token auth stays on (cluster/exposure.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tidal.cluster.configs import (
    STORAGE_VAR,
    TRACKING_VAR,
    Problem,
    bounds_problems,
    gpu_problems,
    mlflow_server_problems,
    site_problems,
    storage_problems,
    tracking_problems,
)
from tidal.cluster.exposure import (
    auth_app_problems,
    auth_problems,
    credential_problems,
    kuberay_env_secret_problems,
    service_type_problems,
)
from tidal.cluster.kueue import KUEUE_KINDS, kueue_problems, label, quantity
from tidal.cluster.prestop import prestop_problems
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
from tidal.sites import SITE_LABEL
from tidal.spec.parse import load_yaml_all

_SHARED_VOLUME_KINDS = {"persistentVolumeClaim", "nfs", "csi"}
_OLD_STORAGE_ANNOTATION = "tidal.io/checkpoint-storage"


def check_kuberay(manifest: dict[str, Any]) -> list[Problem]:
    """Site labels and resources per group, autoscaling bounds, whole GPUs, storage and tracking, auth."""
    spec = manifest.get("spec") if isinstance(manifest.get("spec"), dict) else {}
    annotations = (manifest.get("metadata") or {}).get("annotations") or {}
    problems: list[Problem] = []
    if _OLD_STORAGE_ANNOTATION in annotations:
        problems.append((f"metadata.annotations.{_OLD_STORAGE_ANNOTATION}", f"is replaced by {STORAGE_VAR} in the "
                         f"env of every container: remove it and add `{{name: {STORAGE_VAR}, value: "
                         f"{annotations[_OLD_STORAGE_ANNOTATION]}}}`"))
    if spec.get("enableInTreeAutoscaling") is not True:
        problems.append(("spec.enableInTreeAutoscaling", "not true: set it so that cloud worker groups "
                         "scale from 0 when a job bursts and back when idle"))
    head = spec.get("headGroupSpec")
    if not isinstance(head, dict):
        problems.append(("spec.headGroupSpec", "missing: a RayCluster needs a head group"))
    else:
        problems += kuberay_group_problems("spec.headGroupSpec", head, True)
        problems += _mlflow_problems("spec.headGroupSpec.template.spec.containers", head)
        problems += service_type_problems("spec.headGroupSpec", head)
    groups = spec.get("workerGroupSpecs") or []
    if not groups:
        problems.append(("spec.workerGroupSpecs", "no worker groups: add an on-prem and a cloud GPU group"))
    for i, group in enumerate(groups):
        name = group.get("groupName", i) if isinstance(group, dict) else i
        if isinstance(group, dict):
            problems += kuberay_group_problems(f"spec.workerGroupSpecs[{name}]", group, False)
    if isinstance(head, dict) and _mlflow_has_auth(head):
        problems += [p for where, g in _groups(spec) for c in _containers(g)
                     for p in credential_problems(f"{where}.template.spec.containers[{c.get('name')}].env",
                                                  {e.get("name"): e for e in c.get("env") or [] if isinstance(e, dict)})]
    return problems + auth_problems(manifest)


def _groups(spec: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    groups = [("spec.headGroupSpec", spec.get("headGroupSpec"))]
    groups += [(f"spec.workerGroupSpecs[{g.get('groupName', i)}]", g)
               for i, g in enumerate(spec.get("workerGroupSpecs") or []) if isinstance(g, dict)]
    return [(w, g) for w, g in groups if isinstance(g, dict)]


def _containers(group: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in ((group.get("template") or {}).get("spec") or {}).get("containers") or [] if isinstance(c, dict)]


def kuberay_group_problems(where: str, group: dict[str, Any], is_head: bool, with_job: bool = False) -> list[Problem]:
    """`with_job`: the group belongs to a RayJob's cluster, which lives only as long as its job."""
    params = group.get("rayStartParams") if isinstance(group.get("rayStartParams"), dict) else {}
    labels = {**parse_labels(str(params.get("labels", ""))), **(group.get("labels") or {})}
    site = labels.get(SITE_LABEL)
    problems = site_problems(where, site, parse_resources(str(params.get("resources", ""))),
                             f"rayStartParams.labels {SITE_LABEL}")
    problems = [(w.replace(f"{where}.resources.", f"{where}.rayStartParams.resources."), m) for w, m in problems]
    problems += price_problems(where, labels, f"rayStartParams.labels {PRICE_LABEL}")
    problems += gpu_problems(f"{where}.rayStartParams.num-gpus", number(params.get("num-gpus")))
    pod = (group.get("template") or {}).get("spec") or {}
    for c in pod.get("containers") or []:
        for kind in ("limits", "requests"):
            gpus = ((c.get("resources") or {}).get(kind) or {}).get("nvidia.com/gpu")
            problems += gpu_problems(f"{where}.containers[{c.get('name')}].resources.{kind}.nvidia.com/gpu",
                                     number(str(gpus)) if gpus is not None else None)
        problems += _env_problems(f"{where}.template.spec.containers[{c.get('name')}].env", c, pod, is_head)
        problems += kuberay_env_secret_problems(f"{where}.template.spec.containers[{c.get('name')}].env",
                                                c.get("env") or [])
    if is_head:
        return problems
    problems += prestop_problems(where, pod)
    low, high = group.get("minReplicas", 0), group.get("maxReplicas")
    problems += bounds_problems(where, low, high, "minReplicas", "maxReplicas")
    if high is None:
        problems.append((f"{where}.maxReplicas", "missing: bound how many nodes the autoscaler may start"))
    if site == "cloud" and isinstance(low, int) and low > 0 and not with_job:
        problems.append((f"{where}.minReplicas", f"{low} keeps cloud nodes up while idle; set minReplicas: 0"))
    return problems


def _env_problems(where: str, container: dict[str, Any], pod: dict[str, Any], is_head: bool) -> list[Problem]:
    """Both variables in this container's env; a storage path lies on a shared volume it mounts."""
    env = {e.get("name"): e.get("value") for e in container.get("env") or [] if isinstance(e, dict)}
    problems: list[Problem] = []
    for var, example in ((STORAGE_VAR, "/mnt/tidal/runs}` (a path on a shared volume mounted here, or "
                          "s3://bucket/tidal-runs)"),
                         (TRACKING_VAR, "http://127.0.0.1:5000}` (the mlflow server in this pod)" if is_head
                          else "http://tidal-head-svc:5000}` (<cluster name>-head-svc: the head's mlflow server)")):
        if var not in env:
            problems.append((where, f"no {var}: add `{{name: {var}, value: {example}; the pod's env reaches "
                             "every job and worker this Ray node starts"))
        elif not isinstance(env[var], str):
            continue  # valueFrom (a ConfigMap, a Secret): checked where it is defined
        elif var == STORAGE_VAR:
            problems += storage_problems(f"{where}.{var}", env[var], lambda p: _on_shared_volume(p, container, pod),
                                         "on no shared volume this container mounts; mount a ReadWriteMany "
                                         "persistentVolumeClaim or nfs volume there")
        else:
            problems += tracking_problems(f"{where}.{var}", env[var], single_machine=False, on_head=is_head)
    return problems


def _mlflow_problems(where: str, head: dict[str, Any]) -> list[Problem]:
    """A container of the head pod runs `mlflow server` (the same image has it: Tidal depends on MLflow)."""
    pod = (head.get("template") or {}).get("spec") or {}
    found = _mlflow_container(head)
    if found:
        c, words = found
        env = {e.get("name") for e in c.get("env") or [] if isinstance(e, dict)}
        return (mlflow_server_problems(f"{where}[{c.get('name')}]", words,
                                       lambda p: _on_shared_volume(p, c, pod), single_interface=True)
                + auth_app_problems(f"{where}[{c.get('name')}].env", flags_of(words), env))
    return [(where, "no container runs `mlflow server`: add a second container to the head pod (the same image) "
             "with command [mlflow, server] and args --app-name basic-auth --host 0.0.0.0 --port 5000 "
             "--backend-store-uri sqlite:////mlflow/mlflow.db --artifacts-destination /mnt/tidal/mlartifacts "
             "(see cluster_configs/kuberay/raycluster.yaml), and port 5000 on the head's first container so that "
             "KubeRay's head service exposes it")]


def _mlflow_container(head: dict[str, Any]) -> tuple[dict[str, Any], list[str]] | None:
    """The head pod's container that runs `mlflow server`, with that command's words."""
    for c in _containers(head):
        line = " ".join(str(w) for w in [*(c.get("command") or []), *(c.get("args") or [])])
        for _, words in shell_steps(line):
            if runs(words, "mlflow", "server"):
                return c, words
    return None


def _mlflow_has_auth(head: dict[str, Any]) -> bool:
    found = _mlflow_container(head)
    return bool(found and flags_of(found[1]).get("app-name"))


def _on_shared_volume(path: str, container: dict[str, Any], pod: dict[str, Any]) -> bool:
    shared = {v.get("name") for v in pod.get("volumes") or [] if isinstance(v, dict) and _SHARED_VOLUME_KINDS & v.keys()}
    return any(m.get("name") in shared and under(path, str(m.get("mountPath", "")))
               for m in container.get("volumeMounts") or [])


# ---------------------------------------------------------------------------------------------
# Files of Kubernetes manifests: RayClusters, Kueue-managed RayJobs, Kueue's own objects
# ---------------------------------------------------------------------------------------------

def is_manifest(path: str | Path) -> bool:
    """Every YAML document in the file is a Kubernetes object (apiVersion and kind)."""
    docs = _documents(Path(path))
    return bool(docs) and all(isinstance(d, dict) and "apiVersion" in d and "kind" in d for d in docs)


def manifest_problems(path: str | Path) -> list[Problem]:
    """Each object's own rules, then the references between objects, resolved among every manifest
    of the file's folder (the set applied together: queues, flavors, priority classes, jobs)."""
    path = Path(path)
    docs = _documents(path) or []
    context = list(docs)
    for other in sorted({*path.parent.glob("*.yaml"), *path.parent.glob("*.yml")} - {path}):
        if is_manifest(other):
            context += _documents(other) or []
    problems: list[Problem] = []
    for doc in docs:
        kind = doc.get("kind")
        if kind == "RayCluster":
            problems += check_kuberay(doc)
        elif kind == "RayJob":
            problems += check_rayjob(doc)
        elif kind not in KUEUE_KINDS:
            problems.append((label(doc), f"kind {kind!r} is not checked here; keep RayCluster, RayJob and "
                             f"Kueue's {', '.join(KUEUE_KINDS)} in cluster_configs/kuberay/"))
    return problems + kueue_problems(context, report=docs)


def _documents(path: Path) -> list[Any] | None:
    try:
        return [d for d in load_yaml_all(path.read_text()) if d is not None]
    except (OSError, yaml.YAMLError):
        return None


def check_rayjob(job: dict[str, Any]) -> list[Problem]:
    """The RayJob's own cluster is a Tidal cluster (the groups' rules above, token auth), and a
    `tidal run` entrypoint's worker range matches what its worker groups can hold."""
    where = f"{label(job)} spec.rayClusterSpec"
    cluster = (job.get("spec") or {}).get("rayClusterSpec")
    if not isinstance(cluster, dict):
        return [(where, "missing: a Kueue-managed RayJob creates its own cluster; give rayClusterSpec")]
    problems: list[Problem] = []
    if isinstance(cluster.get("headGroupSpec"), dict):
        problems += kuberay_group_problems(f"{where}.headGroupSpec", cluster["headGroupSpec"], True)
    for i, group in enumerate(cluster.get("workerGroupSpecs") or []):
        problems += kuberay_group_problems(f"{where}.workerGroupSpecs[{group.get('groupName', i)}]", group, False,
                                           with_job=True)
    return problems + worker_range_problems(job) + auth_problems(job)


def worker_range_problems(job: dict[str, Any]) -> list[Problem]:
    """`tidal run ... --set scaling.min_workers=A --set scaling.max_workers=B` against the groups:
    A workers fill the groups at their smallest, B at their largest. Otherwise Kueue reserves quota
    for pods Tidal never uses, or Tidal waits for workers Kueue will never admit."""
    spec = job.get("spec") or {}
    words = shell_words(str(spec.get("entrypoint", "")))
    if not runs(words, "tidal", "run"):
        return []
    where = f"{label(job)} spec.entrypoint"
    sets = dict(w.partition("=")[::2] for w in (b for a, b in zip(words, words[1:], strict=False) if a == "--set"))
    low, high = number(sets.get("scaling.min_workers")), number(sets.get("scaling.max_workers"))
    if not (isinstance(low, int) and isinstance(high, int)):
        return [(where, "does not state the worker range: add --set scaling.min_workers=N --set "
                 "scaling.max_workers=M so that it can be checked against the worker groups' replicas")]
    cluster = spec.get("rayClusterSpec") or {}
    autoscaling = cluster.get("enableInTreeAutoscaling") is True
    gpus = number(sets.get("scaling.gpus_per_worker", "0"))
    cpus = number(sets.get("scaling.cpus_per_worker", "1"))
    small = large = 0
    for group in cluster.get("workerGroupSpecs") or []:
        per_pod = _workers_per_pod(group, gpus, cpus)
        if per_pod is None:
            return []  # the pod's size is not stated: nothing to compare with
        large += per_pod * int(group.get("maxReplicas" if autoscaling else "replicas", 1) or 0)
        small += per_pod * int(group.get("minReplicas" if autoscaling else "replicas", 1) or 0)
    what = "minReplicas/maxReplicas" if autoscaling else "replicas"
    unit = f"{gpus} GPU(s)" if isinstance(gpus, int) and gpus > 0 else f"{cpus} CPU(s)"
    problems: list[Problem] = []
    for key, wanted, got in (("min_workers", low, small), ("max_workers", high, large)):
        if wanted != got:
            problems.append((f"{where} scaling.{key}", f"{wanted}, but the worker groups' {what} hold {got} "
                             f"workers of {unit} at their {'smallest' if key == 'min_workers' else 'largest'}: "
                             f"set scaling.{key}={got} or change the groups' {what}"))
    return problems


def _workers_per_pod(group: dict[str, Any], gpus: Any, cpus: Any) -> int | None:
    """Tidal workers one pod of the group holds: its GPUs per worker's GPUs (CPUs for a CPU job)."""
    params = group.get("rayStartParams") or {}
    if isinstance(gpus, int) and gpus > 0:
        have = number(params.get("num-gpus"))
        return have // gpus if isinstance(have, int) else None
    pod = (group.get("template") or {}).get("spec") or {}
    have = quantity(params.get("num-cpus")) or sum(
        quantity(((c.get("resources") or {}).get("requests") or {}).get("cpu")) or 0.0 for c in pod.get("containers") or [])
    return int(have // cpus) if have and isinstance(cpus, int | float) and cpus > 0 else None


__all__ = ["check_kuberay", "check_rayjob", "is_manifest", "kuberay_group_problems", "manifest_problems",
           "worker_range_problems"]
