"""Check Kueue manifests and Kueue-managed RayJobs together, as Kueue would see them (v0.19).

The CRD schemas catch a misspelt field; what they cannot see is how the objects refer to each other.
These checks find what a user would otherwise learn from a job that stays pending forever: a
LocalQueue naming no ClusterQueue, a ClusterQueue naming a missing flavor or cohort, a RayJob whose
queue or priority class does not exist, or that asks for more than its ClusterQueue can ever get
(nominal quota plus what it may borrow from the cohort), or that Kueue's webhook would refuse
(pkg/controller/jobs/rayjob/rayjob_webhook.go, raycluster/common.go in kueue v0.19).

No Kubernetes client is involved: the objects are plain dicts from the YAML files.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

Problem = tuple[str, str]
Doc = dict[str, Any]

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
ELASTIC_ANNOTATION = "kueue.x-k8s.io/elastic-job"
KUEUE_KINDS = ("ResourceFlavor", "Cohort", "ClusterQueue", "LocalQueue", "WorkloadPriorityClass")
MAX_POD_SETS = 18  # Kueue's limit per workload: the head, the worker groups, the submitter
# KubeRay's defaults, which Kueue counts too when the manifest states no size (kueue v0.19:
# raycluster/common.go defaultAutoscalerResources, rayjob_controller.go defaultSubmitterResources).
_AUTOSCALER_REQUESTS = {"cpu": 0.5, "memory": 512 * 2**20}
_SUBMITTER_REQUESTS = {"cpu": 0.5, "memory": 200 * 2**20}

# Kubernetes resource quantities ("500m", "32Gi", "1e3"). Parsed by hand because the only parser
# is in the `kubernetes` client package, which Tidal does not otherwise need.
_QUANTITY = re.compile(r"^([+-]?(?:\d+(?:\.\d*)?|\.\d+))(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?$")
_SUFFIX = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
           **{s: 2.0 ** (10 * (i + 1)) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))}}


def quantity(value: Any) -> float | None:
    """A Kubernetes quantity as a number (cpu in cores, memory in bytes); None if it is not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    m = _QUANTITY.match(str(value).strip())
    if not m:
        return None
    number, suffix = float(m.group(1)), m.group(2) or ""
    if suffix[:1] in ("e", "E"):
        return number * 10.0 ** int(suffix[1:])
    return number * _SUFFIX.get(suffix, 1.0)


def name_of(doc: Doc) -> str:
    meta = doc.get("metadata") or {}
    return str(meta.get("name") or meta.get("generateName") or "?")


def label(doc: Doc) -> str:
    """How a problem names its object: `RayJob team-a/gpt-1b-elastic-`."""
    ns = (doc.get("metadata") or {}).get("namespace")
    return f"{doc.get('kind')} {ns + '/' if ns else ''}{name_of(doc)}"


# --- what a RayJob asks Kueue for -------------------------------------------------------------

@dataclass
class PodSet:
    """One of the pod sets Kueue builds from a RayJob, at the job's largest size."""

    name: str
    count: int
    requests: dict[str, float]
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)


def pod_requests(pod: dict[str, Any]) -> dict[str, float]:
    """Summed container requests (a limit stands for a missing request, as Kubernetes defaults it)."""
    total: dict[str, float] = {}
    for c in pod.get("containers") or []:
        res = (c or {}).get("resources") or {}
        for name, value in {**(res.get("limits") or {}), **(res.get("requests") or {})}.items():
            total[name] = total.get(name, 0.0) + (quantity(value) or 0.0)
    return total


def rayjob_pod_sets(job: Doc) -> list[PodSet]:
    """The head (with the autoscaler sidecar), every worker group at maxReplicas when it may grow,
    and the submitter pod in K8sJobMode: what Kueue counts against the quota."""
    spec = job.get("spec") or {}
    cluster = spec.get("rayClusterSpec") or {}
    autoscaling = cluster.get("enableInTreeAutoscaling") is True
    head = ((cluster.get("headGroupSpec") or {}).get("template") or {}).get("spec") or {}
    head_requests = pod_requests(head)
    if autoscaling:
        sidecar = ((cluster.get("autoscalerOptions") or {}).get("resources")) or None
        extra = pod_requests({"containers": [{"resources": sidecar}]}) if sidecar else _AUTOSCALER_REQUESTS
        head_requests = _add(head_requests, extra)
    sets = [_pod_set("head", 1, head, head_requests)]
    for i, group in enumerate(cluster.get("workerGroupSpecs") or []):
        pod = (group.get("template") or {}).get("spec") or {}
        count = group.get("maxReplicas") if autoscaling else group.get("replicas", 1)
        count = (count if isinstance(count, int) else 1) * max(int(group.get("numOfHosts") or 1), 1)
        sets.append(_pod_set(str(group.get("groupName", i)), count, pod, pod_requests(pod)))
    if spec.get("submissionMode", "K8sJobMode") == "K8sJobMode":
        pod = (spec.get("submitterPodTemplate") or {}).get("spec") or {}
        sets.append(_pod_set("submitter", 1, pod, pod_requests(pod) or dict(_SUBMITTER_REQUESTS)))
    return sets


def _pod_set(name: str, count: int, pod: dict[str, Any], requests: dict[str, float]) -> PodSet:
    return PodSet(name, count, requests, dict(pod.get("nodeSelector") or {}), list(pod.get("tolerations") or []))


def _add(a: dict[str, float], b: dict[str, float], times: int = 1) -> dict[str, float]:
    return {k: a.get(k, 0.0) + times * b.get(k, 0.0) for k in a.keys() | b.keys()}


# --- how much a ClusterQueue can ever get -----------------------------------------------------

def flavor_quotas(cq: Doc) -> dict[tuple[str, str], dict[str, Any]]:
    """(flavor, resource) -> its quota entry, over every resource group of the ClusterQueue."""
    out = {}
    for group in (cq.get("spec") or {}).get("resourceGroups") or []:
        for flavor in group.get("flavors") or []:
            for res in flavor.get("resources") or []:
                out[(flavor.get("name"), res.get("name"))] = res
    return out


def ceiling(cq: Doc, flavor: str, resource: str, cohort: list[Doc]) -> float:
    """The most of (flavor, resource) the ClusterQueue's workloads can hold at once: its nominal
    quota plus what it may borrow, which is bounded by its borrowingLimit and by what the other
    ClusterQueues of its cohort lend (their lendingLimit, else their whole nominal quota)."""
    entry = flavor_quotas(cq).get((flavor, resource))
    if entry is None:
        return 0.0
    nominal = quantity(entry.get("nominalQuota")) or 0.0
    if not (cq.get("spec") or {}).get("cohortName"):
        return nominal
    lent = 0.0
    for other in cohort:
        o = flavor_quotas(other).get((flavor, resource))
        if other is not cq and o is not None:
            lent += quantity(o.get("lendingLimit", o.get("nominalQuota"))) or 0.0
    limit = quantity(entry.get("borrowingLimit")) if "borrowingLimit" in entry else math.inf
    return nominal + min(limit if limit is not None else math.inf, lent)


def eligible_flavors(pod_set: PodSet, cq: Doc, flavors: dict[str, Doc]) -> list[str]:
    """The ClusterQueue's flavors this pod set may take: their node labels agree with its
    nodeSelector, and it (or the flavor) tolerates their taints (Kueue's flavor assigner)."""
    names = {f for f, _ in flavor_quotas(cq)}
    out = []
    for name in sorted(names):
        spec = (flavors.get(name) or {}).get("spec") or {}
        labels = spec.get("nodeLabels") or {}
        if any(k in pod_set.node_selector and pod_set.node_selector[k] != v for k, v in labels.items()):
            continue
        tolerations = pod_set.tolerations + list(spec.get("tolerations") or [])
        if all(_tolerated(t, tolerations) for t in spec.get("nodeTaints") or []):
            out.append(name)
    return out


def _tolerated(taint: dict[str, Any], tolerations: Iterable[dict[str, Any]]) -> bool:
    for t in tolerations:
        if t.get("effect") and t.get("effect") != taint.get("effect"):
            continue
        if t.get("operator") == "Exists" and t.get("key") in (None, taint.get("key")):
            return True
        if t.get("key") == taint.get("key") and t.get("value") == taint.get("value"):
            return True
    return False


def fit_problems(where: str, job: Doc, cq: Doc, cohort: list[Doc], flavors: dict[str, Doc]) -> list[Problem]:
    """The job at its largest size within what its ClusterQueue can ever hold, per flavor choice."""
    covered = {r for _, r in flavor_quotas(cq)}
    demand: dict[tuple[str, ...], dict[str, float]] = {}
    problems: list[Problem] = []
    for ps in rayjob_pod_sets(job):
        missing = sorted(r for r, v in ps.requests.items() if v > 0 and r not in covered)
        if missing:
            problems.append((f"{where} pod set {ps.name}", f"requests {', '.join(missing)}, which ClusterQueue "
                             f"{name_of(cq)} does not cover: Kueue would never admit it; add it to the "
                             "queue's coveredResources or remove the request"))
        allowed = tuple(eligible_flavors(ps, cq, flavors))
        if not allowed:
            problems.append((f"{where} pod set {ps.name}", f"nodeSelector {ps.node_selector} matches no flavor "
                             f"of ClusterQueue {name_of(cq)} (or a taint is not tolerated)"))
            continue
        demand[allowed] = _add(demand.get(allowed, {}), ps.requests, ps.count)
    for allowed, wants in demand.items():
        for resource, amount in sorted(wants.items()):
            most = sum(ceiling(cq, f, resource, cohort) for f in allowed)
            if resource in covered and amount > most * (1 + 1e-9):
                problems.append((f"{where}", f"needs {_show(resource, amount)} of {resource} on flavor(s) "
                                 f"{', '.join(allowed)} at its largest size, but ClusterQueue {name_of(cq)} can "
                                 f"hold at most {_show(resource, most)} there (nominalQuota + what it may "
                                 "borrow): it would wait forever; lower maxReplicas or raise the quota"))
    return problems


def _show(resource: str, amount: float) -> str:
    return f"{amount / 2**30:g}Gi" if resource == "memory" else f"{amount:g}"


# --- the objects together ---------------------------------------------------------------------

def kueue_problems(docs: list[Doc], report: list[Doc] | None = None) -> list[Problem]:
    """Every broken reference and unfit RayJob among `docs` (all the manifests that will be applied
    together); only those about the objects in `report` (default: all) are returned."""
    by_kind: dict[str, dict[str, Doc]] = {}
    for d in docs:
        by_kind.setdefault(str(d.get("kind")), {})[_key(d)] = d
    shown = {id(d) for d in (report if report is not None else docs)}
    problems: list[Problem] = []
    for d in docs:
        if id(d) not in shown:
            continue
        kind = d.get("kind")
        if kind == "ClusterQueue":
            problems += _cluster_queue_problems(d, by_kind)
        elif kind == "LocalQueue":
            cq = (d.get("spec") or {}).get("clusterQueue")
            if cq not in by_kind.get("ClusterQueue", {}):
                problems.append((f"{label(d)} spec.clusterQueue", f"{cq!r} names no ClusterQueue; choose one of "
                                 f"{sorted(by_kind.get('ClusterQueue', {}))}"))
        elif kind == "RayJob":
            problems += rayjob_kueue_problems(d, by_kind)
    return problems


def _key(d: Doc) -> str:
    meta = d.get("metadata") or {}
    if d.get("kind") == "LocalQueue":
        return f"{meta.get('namespace', 'default')}/{meta.get('name')}"
    return str(meta.get("name") or meta.get("generateName"))


def _cluster_queue_problems(cq: Doc, by_kind: dict[str, dict[str, Doc]]) -> list[Problem]:
    spec = cq.get("spec") or {}
    where, problems = label(cq), []
    cohort = spec.get("cohortName")
    if cohort is None:
        problems.append((f"{where} spec.cohortName", "missing: without a cohort the team can neither lend idle "
                         "quota nor borrow; set cohortName to the Cohort the teams share"))
    elif cohort not in by_kind.get("Cohort", {}):
        problems.append((f"{where} spec.cohortName", f"{cohort!r} names no Cohort; choose one of "
                         f"{sorted(by_kind.get('Cohort', {}))} or add the Cohort"))
    for i, group in enumerate(spec.get("resourceGroups") or []):
        covered = list(group.get("coveredResources") or [])
        for flavor in group.get("flavors") or []:
            at = f"{where} spec.resourceGroups[{i}].flavors[{flavor.get('name')}]"
            if flavor.get("name") not in by_kind.get("ResourceFlavor", {}):
                problems.append((at, f"names no ResourceFlavor; choose one of {sorted(by_kind.get('ResourceFlavor', {}))}"))
            listed = [r.get("name") for r in flavor.get("resources") or []]
            if listed != covered:  # Kueue: "Each flavor MUST list all the resources ... in the same order"
                problems.append((f"{at}.resources", f"lists {listed}; every flavor must list coveredResources "
                                 f"{covered} in that order"))
    return problems


def rayjob_kueue_problems(job: Doc, by_kind: dict[str, dict[str, Doc]]) -> list[Problem]:
    """Queue and priority class exist; what Kueue's webhook refuses; the job fits its quota."""
    meta, spec = job.get("metadata") or {}, job.get("spec") or {}
    labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
    where, ns = label(job), meta.get("namespace")
    queue, priority = labels.get(QUEUE_LABEL), labels.get(PRIORITY_LABEL)
    queues = by_kind.get("LocalQueue", {})
    problems = _webhook_problems(where, spec, annotations)
    if queue is None:
        return problems + [(f"{where} metadata.labels.{QUEUE_LABEL}", "missing: name the team's LocalQueue, or "
                            "Kueue will not manage (nor count) this job")]
    if not ns:
        problems.append((f"{where} metadata.namespace", "missing: a LocalQueue lives in a namespace; set the "
                         "team's namespace so the queue can be checked"))
    local = queues.get(f"{ns}/{queue}")
    if ns and local is None:
        problems.append((f"{where} metadata.labels.{QUEUE_LABEL}", f"{queue!r} names no LocalQueue in namespace "
                         f"{ns}; choose one of {sorted(k for k in queues if k.startswith(f'{ns}/'))}"))
    classes = by_kind.get("WorkloadPriorityClass", {})
    if priority is not None and priority not in classes:
        problems.append((f"{where} metadata.labels.{PRIORITY_LABEL}", f"{priority!r} names no "
                         f"WorkloadPriorityClass; choose one of {sorted(classes)}"))
    cq = by_kind.get("ClusterQueue", {}).get(((local or {}).get("spec") or {}).get("clusterQueue"))
    if cq is not None:
        cohort = [c for c in by_kind["ClusterQueue"].values()
                  if (c.get("spec") or {}).get("cohortName") == (cq.get("spec") or {}).get("cohortName")]
        problems += fit_problems(where, job, cq, cohort, by_kind.get("ResourceFlavor", {}))
    return problems


def _webhook_problems(where: str, spec: Doc, annotations: Doc) -> list[Problem]:
    """What Kueue's RayJob webhook refuses (or, for the annotation, silently ignores)."""
    cluster = spec.get("rayClusterSpec") or {}
    elastic = annotations.get(ELASTIC_ANNOTATION) == "true"
    autoscaling = cluster.get("enableInTreeAutoscaling") is True
    problems: list[Problem] = []
    if spec.get("clusterSelector"):
        problems.append((f"{where} spec.clusterSelector", "a Kueue-managed RayJob cannot use an existing "
                         "cluster; remove clusterSelector and give rayClusterSpec"))
    if spec.get("shutdownAfterJobFinishes") is not True:
        problems.append((f"{where} spec.shutdownAfterJobFinishes", "must be true: Kueue refuses a job whose "
                         "Ray cluster would outlive it and keep holding the team's quota"))
    if autoscaling and not elastic:
        problems.append((f"{where} spec.rayClusterSpec.enableInTreeAutoscaling", "true without the annotation "
                         f"{ELASTIC_ANNOTATION}: \"true\": Kueue refuses autoscaling on a non-elastic job; add "
                         "the annotation (feature gate ElasticJobsViaWorkloadSlices) or set it false"))
    if elastic and not autoscaling:
        problems.append((f"{where} spec.rayClusterSpec.enableInTreeAutoscaling", f"not true on an {ELASTIC_ANNOTATION} "
                         "job: nothing would ever resize it; set enableInTreeAutoscaling: true"))
    groups = cluster.get("workerGroupSpecs") or []
    if len(groups) + 1 > MAX_POD_SETS:
        problems.append((f"{where} spec.rayClusterSpec.workerGroupSpecs", f"{len(groups)} groups: a Kueue "
                         f"workload holds at most {MAX_POD_SETS} pod sets (the head and the groups)"))
    for g in groups:
        if g.get("groupName") == "head":
            problems.append((f"{where} spec.rayClusterSpec.workerGroupSpecs[head].groupName",
                             "\"head\" is reserved by Kueue for the head group; rename the group"))
    return problems


__all__ = ["ELASTIC_ANNOTATION", "KUEUE_KINDS", "PRIORITY_LABEL", "QUEUE_LABEL", "PodSet", "ceiling", "label",
           "eligible_flavors", "fit_problems", "kueue_problems", "quantity", "rayjob_pod_sets"]
