"""Every Kubernetes manifest in cluster_configs/kuberay/ against the real CRDs, and the Kueue
objects and RayJobs against each other.

The schemas are the unmodified CRDs of KubeRay v1.7.0 and Kueue v0.19.2 in ../shared/schemas/
(see its README); each document's apiVersion and kind pick the CRD version's openAPIV3Schema. The
API server refuses an unknown field (kubectl's default field validation is Strict) while a CRD
schema leaves `additionalProperties` open, so `strict()` closes every object that lists its
properties and does not preserve unknown fields: a misspelt field is refused here as there.
"""

from __future__ import annotations

import copy
import re
import shutil
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tidal.cluster.check import validate_cluster_config
from tidal.cluster.kuberay import check_rayjob, manifest_problems
from tidal.cluster.kueue import (
    ELASTIC_ANNOTATION,
    PRIORITY_LABEL,
    QUEUE_LABEL,
    kueue_problems,
    quantity,
)
from tidal.errors import SpecError
from tidal.spec.load import load_spec
from tidal.spec.parse import load_yaml, load_yaml_all

ROOT = Path(__file__).resolve().parents[1]
KUBERAY = ROOT / "cluster_configs" / "kuberay"
SCHEMAS = ROOT.parent / "shared" / "schemas"
if not SCHEMAS.is_dir():  # a worktree beside the main checkout
    SCHEMAS = Path("/work/shared/schemas")
FILES = sorted({*KUBERAY.glob("*.yaml"), *KUBERAY.glob("*.yml")})


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in load_yaml_all(path.read_text()) if d is not None]


ALL = [(f, i, d) for f in FILES for i, d in enumerate(documents(f))]


def strict(schema: Any) -> Any:
    """The schema with every listed-properties object closed, as the API server's strict field
    validation treats it (x-kubernetes-preserve-unknown-fields keeps an object open)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@cache
def crds() -> dict[tuple[str, str], Any]:
    """(apiVersion, kind) -> a validator for that CRD version's schema."""
    out = {}
    for path in sorted(SCHEMAS.glob("*/*.yaml")):
        crd = load_yaml(path.read_text())  # libyaml where present: the CRDs are 2.5 MB of YAML
        for version in crd["spec"]["versions"]:
            schema = strict(version["schema"]["openAPIV3Schema"])
            out[(f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])] = \
                jsonschema.Draft7Validator(schema)
    return out


def schema_problems(doc: dict[str, Any]) -> list[str]:
    """One line per schema error, naming the field's path; a kind with no CRD here is one too."""
    validator = crds().get((doc.get("apiVersion"), doc.get("kind")))
    if validator is None:
        return [f"{doc.get('apiVersion')}/{doc.get('kind')}: no CRD in {SCHEMAS} for this apiVersion and kind"]
    return [f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
            for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))]


def all_docs() -> list[dict[str, Any]]:
    return [copy.deepcopy(d) for _, _, d in ALL]


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    meta = lambda d: d.get("metadata") or {}  # noqa: E731
    return next(d for d in docs if d["kind"] == kind and name in (None, meta(d).get("name"), meta(d).get("generateName")))


# --- every document of every file -------------------------------------------------------------

def test_the_schemas_and_the_manifests_are_there():
    kinds = {d["kind"] for _, _, d in ALL}
    assert {"RayCluster", "RayJob", "ResourceFlavor", "Cohort", "ClusterQueue", "LocalQueue",
            "WorkloadPriorityClass"} <= kinds
    assert len(crds()) >= 14  # 7 CRDs, two served versions each


@pytest.mark.parametrize("path,index,doc", ALL, ids=[f"{f.name}[{i}]-{d.get('kind')}" for f, i, d in ALL])
def test_every_manifest_matches_its_crd(path: Path, index: int, doc: dict[str, Any]):
    assert schema_problems(doc) == []


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_file_passes_tidal_cluster_validate(path: Path):
    assert validate_cluster_config(path) == []


def test_the_objects_agree_with_each_other():
    assert kueue_problems(all_docs()) == []


def test_a_misspelt_field_is_refused_naming_it():
    cq = copy.deepcopy(find(all_docs(), "ClusterQueue", "team-a"))
    quota = cq["spec"]["resourceGroups"][0]["flavors"][0]["resources"][2]
    quota["nominalQuata"] = quota.pop("nominalQuota")
    got = schema_problems(cq)
    assert any("spec.resourceGroups.0.flavors.0.resources.2" in p and "nominalQuata" in p for p in got), got
    assert any("'nominalQuota' is a required property" in p for p in got), got
    job = copy.deepcopy(find(all_docs(), "RayJob", "gpt-1b-elastic-"))
    job["spec"]["rayClusterSpec"]["enableInTreeAutoScaling"] = job["spec"]["rayClusterSpec"].pop("enableInTreeAutoscaling")
    got = schema_problems(job)
    assert any(p.startswith("spec.rayClusterSpec:") and "enableInTreeAutoScaling" in p for p in got), got


def test_a_wrong_value_is_refused_naming_the_field():
    cq = copy.deepcopy(find(all_docs(), "ClusterQueue", "team-b"))
    cq["spec"]["preemption"]["reclaimWithinCohort"] = "Sometimes"
    assert any(p.startswith("spec.preemption.reclaimWithinCohort:") for p in schema_problems(cq))


def test_a_kind_without_a_crd_is_refused():
    assert schema_problems({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}}) != []
    assert schema_problems({"apiVersion": "kueue.x-k8s.io/v1beta3", "kind": "LocalQueue"}) != []


# --- what the RayJobs carry -------------------------------------------------------------------

def rayjobs() -> list[dict[str, Any]]:
    return [d for d in all_docs() if d["kind"] == "RayJob"]


def test_every_rayjob_is_queued_with_a_priority_and_the_elastic_one_autoscales():
    jobs = rayjobs()
    assert len(jobs) >= 2
    for job in jobs:
        labels = job["metadata"]["labels"]
        assert labels[QUEUE_LABEL] and labels[PRIORITY_LABEL] in {"low", "normal", "high"}
        assert job["spec"]["shutdownAfterJobFinishes"] is True
    elastic = [j for j in jobs if (j["metadata"].get("annotations") or {}).get(ELASTIC_ANNOTATION) == "true"]
    assert elastic and all(j["spec"]["rayClusterSpec"]["enableInTreeAutoscaling"] is True for j in elastic)
    group = elastic[0]["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    assert group["minReplicas"] < group["maxReplicas"]


def test_the_rayjobs_clusters_keep_raycluster_yamls_env_contract():
    """Image, token auth, TIDAL_STORAGE and MLFLOW_TRACKING_URI in every container, as raycluster.yaml."""
    cluster = find(all_docs(), "RayCluster")
    image = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
    for job in rayjobs():
        spec = job["spec"]["rayClusterSpec"]
        pods = [spec["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in spec["workerGroupSpecs"]]
        for pod in pods:
            for c in pod["containers"]:
                env = {e["name"]: e for e in c["env"]}
                assert c["image"] == image
                assert env["RAY_AUTH_MODE"]["value"] == "token"
                assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "tidal-ray-token"
                assert {"TIDAL_STORAGE", "MLFLOW_TRACKING_URI"} <= env.keys()


@pytest.mark.parametrize("path", [f for f in FILES if any(d["kind"] == "RayJob" for d in documents(f))],
                         ids=lambda p: p.name)
def test_the_rayjob_entrypoint_runs_a_spec_tidal_accepts(path: Path):
    """The ConfigMap the manifest tells to create, with the entrypoint's --set, is a valid job:
    e.g. its global batch stays fixed across the whole elastic range."""
    source = re.search(r"--from-file=job\.yaml=(\S+)", path.read_text())
    assert source, f"{path.name} does not say which job spec its ConfigMap holds"
    for job in (d for d in documents(path) if d["kind"] == "RayJob"):
        words = job["spec"]["entrypoint"].split()
        assert words[:3] == ["tidal", "run", "/etc/tidal/job.yaml"]
        sets = [b for a, b in zip(words, words[1:], strict=False) if a == "--set"]
        load_spec(ROOT / source.group(1), sets)
        with pytest.raises(SpecError, match="global_batch"):  # the check above can fail
            load_spec(ROOT / source.group(1), [*sets, "scaling.min_workers=1", "scaling.max_workers=7"])


# --- references and quotas, broken one at a time ---------------------------------------------

def problems_after(change) -> list[tuple[str, str]]:
    docs = all_docs()
    change(docs)
    return kueue_problems(docs)


def test_a_localqueue_naming_no_clusterqueue():
    got = problems_after(lambda d: find(d, "LocalQueue")["spec"].update(clusterQueue="team-c"))
    assert [w for w, m in got] == ["LocalQueue team-a/training spec.clusterQueue"], got
    assert "'team-c' names no ClusterQueue" in got[0][1] and "team-a" in got[0][1]


def test_a_clusterqueue_with_a_missing_flavor_or_outside_the_cohort():
    def change(docs):
        cq = find(docs, "ClusterQueue", "team-b")
        cq["spec"]["resourceGroups"][0]["flavors"][1]["name"] = "gcp"
        cq["spec"]["cohortName"] = "others"
    got = dict(problems_after(change))
    assert "names no ResourceFlavor" in got["ClusterQueue team-b spec.resourceGroups[0].flavors[gcp]"]
    assert "'others' names no Cohort" in got["ClusterQueue team-b spec.cohortName"]
    got = dict(problems_after(lambda d: find(d, "ClusterQueue", "team-a")["spec"].pop("cohortName")))
    assert "missing" in got["ClusterQueue team-a spec.cohortName"]


def test_flavor_resources_out_of_coveredresources_order():
    def change(docs):
        res = find(docs, "ClusterQueue", "team-a")["spec"]["resourceGroups"][0]["flavors"][0]["resources"]
        res.reverse()
    got = dict(problems_after(change))
    assert "in that order" in got["ClusterQueue team-a spec.resourceGroups[0].flavors[onprem].resources"]


def test_a_rayjob_with_an_unknown_queue_or_priority_class():
    def change(docs):
        labels = find(docs, "RayJob", "gpt-1b-elastic-")["metadata"]["labels"]
        labels[QUEUE_LABEL], labels[PRIORITY_LABEL] = "trainig", "urgent"
    got = dict(problems_after(change))
    assert "'trainig' names no LocalQueue in namespace team-a; choose one of ['team-a/training']" in \
        got[f"RayJob team-a/gpt-1b-elastic- metadata.labels.{QUEUE_LABEL}"]
    assert "['high', 'low', 'normal']" in got[f"RayJob team-a/gpt-1b-elastic- metadata.labels.{PRIORITY_LABEL}"]
    # a queue of the same name in ANOTHER namespace does not count
    got = dict(problems_after(lambda d: find(d, "RayJob", "gpt-1b-elastic-")["metadata"].update(namespace="team-c")))
    assert "names no LocalQueue in namespace team-c" in got[f"RayJob team-c/gpt-1b-elastic- metadata.labels.{QUEUE_LABEL}"]


def test_a_rayjob_larger_than_its_queue_can_ever_hold_would_wait_forever():
    """team-a: 8 on-prem GPUs nominal + at most 4 borrowed (team-b lends 4): a 13-GPU job never runs."""
    def grow(n):
        def change(docs):
            find(docs, "RayJob", "gpt-1b-elastic-")["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["maxReplicas"] = n
        return change
    assert problems_after(grow(12)) == []
    got = [m for _, m in problems_after(grow(13)) if "nvidia.com/gpu" in m]
    assert got and "needs 13 of nvidia.com/gpu" in got[0] and "at most 12" in got[0], got
    # with no lending limit on team-b, its whole share (8) may be borrowed, up to team-a's borrowingLimit 8
    def lend_all(docs):
        grow(13)(docs)
        find(docs, "ClusterQueue", "team-b")["spec"]["resourceGroups"][0]["flavors"][0]["resources"][2].pop("lendingLimit")
    assert not [m for _, m in problems_after(lend_all) if "nvidia.com/gpu" in m]


def test_a_pod_pinned_to_a_site_no_flavor_offers():
    def change(docs):
        pod = find(docs, "RayJob", "gpt-1b-urgent-")["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]
        pod["nodeSelector"] = {"tidal.io/site": "edge"}
    got = [m for _, m in problems_after(change)]
    assert any("matches no flavor of ClusterQueue team-b" in m for m in got), got


def test_a_resource_the_queue_does_not_cover():
    def change(docs):
        c = find(docs, "RayJob", "gpt-1b-urgent-")["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
        c["resources"]["requests"]["ephemeral-storage"] = "100Gi"
    got = [m for _, m in problems_after(change)]
    assert any("requests ephemeral-storage, which ClusterQueue team-b does not cover" in m for m in got), got


@pytest.mark.parametrize("change,where,text", [
    (lambda j: j["spec"].update(shutdownAfterJobFinishes=False), "spec.shutdownAfterJobFinishes", "must be true"),
    (lambda j: j["metadata"].pop("annotations"), "spec.rayClusterSpec.enableInTreeAutoscaling",
     "Kueue refuses autoscaling on a non-elastic job"),
    (lambda j: j["spec"]["rayClusterSpec"].update(enableInTreeAutoscaling=False),
     "spec.rayClusterSpec.enableInTreeAutoscaling", "nothing would ever resize it"),
    (lambda j: j["spec"].update(clusterSelector={"ray.io/cluster": "tidal"}), "spec.clusterSelector", "existing cluster"),
    (lambda j: j["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].update(groupName="head"),
     "spec.rayClusterSpec.workerGroupSpecs[head].groupName", "reserved"),
], ids=["no-shutdown", "autoscaling-not-elastic", "elastic-not-autoscaling", "existing-cluster", "group-named-head"])
def test_what_kueues_webhook_refuses(change, where: str, text: str):
    got = dict(problems_after(lambda d: change(find(d, "RayJob", "gpt-1b-elastic-"))))
    assert text in got[f"RayJob team-a/gpt-1b-elastic- {where}"], got


# --- Tidal's side of a RayJob -----------------------------------------------------------------

def elastic_job() -> dict[str, Any]:
    return find(all_docs(), "RayJob", "gpt-1b-elastic-")


def test_the_worker_range_must_match_the_worker_groups():
    assert check_rayjob(elastic_job()) == []
    job = elastic_job()
    job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["maxReplicas"] = 6
    got = dict(check_rayjob(job))
    assert "set scaling.max_workers=6" in got["RayJob team-a/gpt-1b-elastic- spec.entrypoint scaling.max_workers"]
    job = elastic_job()
    job["spec"]["entrypoint"] = job["spec"]["entrypoint"].replace("--set scaling.min_workers=2", "")
    assert "does not state the worker range" in dict(check_rayjob(job))["RayJob team-a/gpt-1b-elastic- spec.entrypoint"]
    fixed = find(all_docs(), "RayJob", "gpt-1b-urgent-")  # 2 pods x 4 GPUs, 1 GPU per worker
    fixed["spec"]["entrypoint"] = fixed["spec"]["entrypoint"].replace("gpus_per_worker=1", "gpus_per_worker=2")
    got = dict(check_rayjob(fixed))
    assert "8, but the worker groups' replicas hold 4 workers of 2 GPU(s)" in \
        got["RayJob team-b/gpt-1b-urgent- spec.entrypoint scaling.min_workers"]


def test_a_rayjob_cluster_is_a_tidal_cluster():
    job = elastic_job()
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    head["env"] = [e for e in head["env"] if e["name"] != "TIDAL_STORAGE"]
    job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["rayStartParams"]["labels"] = "tidal.io/price-per-hour=2"
    wheres = [w for w, _ in check_rayjob(job)]
    assert "RayJob team-a/gpt-1b-elastic- spec.rayClusterSpec.headGroupSpec.template.spec.containers[ray-head].env" in wheres
    assert any(w.endswith("workerGroupSpecs[onprem-gpu].rayStartParams.labels tidal.io/site") for w in wheres), wheres
    job = elastic_job()
    job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"][0]["value"] = "disabled"
    assert any("RAY_AUTH_MODE" in m for _, m in check_rayjob(job))


# --- tidal cluster validate on a folder of manifests ------------------------------------------

def test_validate_resolves_references_across_the_folder(tmp_path: Path):
    """A RayJob file alone has no queues to name: they come from the other files of its folder."""
    for f in FILES:
        shutil.copy(f, tmp_path / f.name)
    assert validate_cluster_config(tmp_path / "rayjob-elastic.yaml") == []
    (tmp_path / "kueue-queues.yaml").write_text((tmp_path / "kueue-queues.yaml").read_text()
                                                .replace("name: training\n  namespace: team-a", "name: batch\n  namespace: team-a"))
    got = validate_cluster_config(tmp_path / "rayjob-elastic.yaml")
    assert got and "names no LocalQueue in namespace team-a; choose one of ['team-a/batch']" in got[0][1], got
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(FILES[0].parent / "rayjob.yaml", alone / "rayjob.yaml")
    assert any("names no LocalQueue" in m for _, m in validate_cluster_config(alone / "rayjob.yaml"))


def test_validate_refuses_a_kind_it_does_not_check(tmp_path: Path):
    (tmp_path / "extra.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: job}\ndata: {}\n")
    got = manifest_problems(tmp_path / "extra.yaml")
    assert got == [("ConfigMap job", got[0][1])] and "is not checked here" in got[0][1]


def test_quantities():
    assert quantity("500m") == 0.5 and quantity("32Gi") == 32 * 2**30 and quantity(8) == 8.0
    assert quantity("1e3") == 1000.0 and quantity("2k") == 2000.0 and quantity("1.5") == 1.5
    assert quantity("eight") is None and quantity(True) is None


def test_what_a_kueue_preemption_costs_is_what_the_docs_say():
    """Kueue suspends a RayJob by deleting its Ray cluster, head pod included; a head pod without a
    `preStop` stops its GCS and driver at once, so no emergency checkpoint can be made: the docs
    must say so and never list Kueue's preemption among the warnings that save."""
    import yaml

    root = Path(__file__).resolve().parent.parent
    heads = []
    for path in sorted((root / "cluster_configs" / "kuberay").glob("ray*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            spec = (doc or {}).get("spec", {})
            head = (spec.get("rayClusterSpec") or spec).get("headGroupSpec")
            if head:
                heads += [c for c in head["template"]["spec"]["containers"]]
    assert heads
    if not any((c.get("lifecycle") or {}).get("preStop") for c in heads):
        cluster = (root / "docs" / "cluster.md").read_text()
        assert "A Kueue\npreemption gets no emergency checkpoint" in cluster
        rows = [line for line in (root / "docs" / "reliability.md").read_text().splitlines()
                if line.startswith("|") and "Kueue" in line]
        assert rows and all("drain-node" not in row for row in rows), rows
