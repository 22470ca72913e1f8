"""Every shipped cluster config passes validation; broken variants fail with named messages; the
placement policy's decisions as pure functions. No Ray is started here."""

from __future__ import annotations

import argparse
import copy
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import ROOT, tiny_spec
from tidal.cluster.burst import (
    SITE_SLIVER,
    BurstWatcher,
    SiteRoom,
    cloud_request,
    decide,
    scaling_overrides,
    site_room,
    slots,
)
from tidal.cluster.check import validate_cluster_config
from tidal.cluster.cli import register
from tidal.cluster.configs import check_launcher
from tidal.cluster.kuberay import check_kuberay
from tidal.cluster.status import format_demand, format_workers
from tidal.prices import PRICE_LABEL, worker_price
from tidal.sites import SITE_LABEL
from tidal.spec.parse import load_yaml

CONFIGS = sorted((ROOT / "cluster_configs").rglob("*.yaml"))
LAUNCHER = [p for p in CONFIGS if "kuberay" not in p.parts and p.name != "quotas.yaml"]  # quotas: a quota file
KUBERAY = ROOT / "cluster_configs" / "kuberay" / "raycluster.yaml"


def load(path: Path) -> dict[str, Any]:
    return load_yaml(path.read_text())


def wheres(problems: list[tuple[str, str]]) -> list[str]:
    return [w for w, _ in problems]


# --- every shipped config -------------------------------------------------------------------

def test_all_expected_configs_exist():
    names = {p.relative_to(ROOT / "cluster_configs").as_posix() for p in CONFIGS}
    assert {"onprem.yaml", "aws-burst.yaml", "gcp-burst.yaml", "azure-burst.yaml", "local-burst.yaml",
            "kuberay/raycluster.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_is_valid(path: Path):
    assert validate_cluster_config(path) == []


@pytest.mark.parametrize("path", [p for p in LAUNCHER if load(p)["provider"]["type"] != "local"], ids=lambda p: p.name)
def test_every_node_type_has_site_label_and_resource(path: Path):
    config = load(path)
    for name, node in config["available_node_types"].items():
        site = node["labels"][SITE_LABEL]
        assert node["resources"][f"site_{site}"] > 0, name
        if site == "cloud" and node["resources"].get("GPU"):
            assert node.get("min_workers", 0) == 0, name


def test_burst_configs_have_spot_and_on_demand_gpu_types():
    for name in ("aws-burst.yaml", "gcp-burst.yaml", "azure-burst.yaml"):
        types = load(ROOT / "cluster_configs" / name)["available_node_types"]
        markets = {n["labels"].get("tidal.io/market") for n in types.values() if n["resources"].get("GPU")}
        assert markets == {"spot", "on-demand"}, name


# --- broken variants: each names the node type and the key ----------------------------------

def aws() -> dict[str, Any]:
    return copy.deepcopy(load(ROOT / "cluster_configs" / "aws-burst.yaml"))


L40S = "available_node_types.gpu.l40s.spot"


def test_fractional_gpu_is_refused():
    c = aws()
    c["available_node_types"]["gpu.l40s.spot"]["resources"]["GPU"] = 0.5
    problems = check_launcher(c)
    assert f"{L40S}.resources.GPU" in wheres(problems)
    assert any("whole number of GPUs" in m for _, m in problems)


def test_min_above_max_is_refused():
    c = aws()
    c["available_node_types"]["gpu.l40s.spot"].update(min_workers=3, max_workers=2)
    problems = check_launcher(c)
    assert (f"{L40S}.min_workers", "3 is above max_workers (2); set min_workers <= max_workers") in problems


def test_unknown_key_is_refused_by_rays_schema_with_a_suggestion():
    c = aws()
    c["available_node_types"]["gpu.l40s.spot"]["lables"] = {}
    c["idle_timout_minutes"] = 3
    problems = check_launcher(c)
    assert len(problems) == 1  # jsonschema reports the first problem it meets
    where, msg = problems[0]
    assert "was unexpected" in msg and "Ray's cluster config schema" in msg
    assert "did you mean" in msg


def test_missing_resources_are_refused():
    c = aws()
    del c["available_node_types"]["gpu.l40s.spot"]["resources"]
    problems = check_launcher(c)
    assert f"{L40S}.resources" in wheres(problems)
    assert any("'resources' is a required property" in m for _, m in problems)


def test_missing_site_label_is_refused():
    c = aws()
    c["available_node_types"]["gpu.l40s.spot"]["labels"] = {PRICE_LABEL: "0.90"}
    problems = check_launcher(c)
    assert wheres(problems) == [f"{L40S}.labels.{SITE_LABEL}"]
    assert "onprem or cloud" in problems[0][1]


@pytest.mark.parametrize(("price", "says"), [(None, "missing: what this node costs per hour"),
                                              ("cheap", "is not a price"), ("-1", "is not a price")])
def test_every_node_type_declares_a_price(price: str | None, says: str):
    c = aws()
    labels = c["available_node_types"]["gpu.l40s.spot"]["labels"]
    labels.pop(PRICE_LABEL)
    if price is not None:
        labels[PRICE_LABEL] = price
    problems = check_launcher(c)
    assert wheres(problems) == [f"{L40S}.labels.{PRICE_LABEL}"] and says in problems[0][1]


def test_a_worker_pays_its_share_of_the_node():
    node = {"CPU": 192, "GPU": 8}
    assert worker_price({PRICE_LABEL: "32.00"}, node, cpus=8, gpus=2) == pytest.approx(8.0)  # 2 of 8 GPUs
    assert worker_price({PRICE_LABEL: "32.00"}, node, cpus=48, gpus=0) == pytest.approx(8.0)  # a CPU job: CPUs
    assert worker_price({}, node, cpus=1, gpus=1) is None


def test_site_resource_must_match_the_label():
    c = aws()
    node = c["available_node_types"]["gpu.l40s.spot"]
    node["resources"].pop("site_cloud")
    node["resources"]["site_onprem"] = 1000
    assert set(wheres(check_launcher(c))) == {f"{L40S}.resources.site_cloud", f"{L40S}.resources.site_onprem"}


def test_cloud_gpu_type_must_start_at_zero():
    c = aws()
    c["available_node_types"]["gpu.l40s.spot"]["min_workers"] = 1
    assert wheres(check_launcher(c)) == [f"{L40S}.min_workers"]


@pytest.mark.parametrize("where", ["setup_commands", "worker_start_ray_commands"])
def test_auth_disabled_is_refused(where: str):
    c = aws()
    c[where].append("export RAY_AUTH_MODE=disabled")
    problems = check_launcher(c)
    assert len(problems) == 1 and problems[0][0].startswith(where)
    assert "keep token auth on" in problems[0][1]


# --- where jobs store and track: TIDAL_STORAGE, MLFLOW_TRACKING_URI, the head's mlflow server --

def config(name: str) -> dict[str, Any]:
    return copy.deepcopy(load(ROOT / "cluster_configs" / name))


def without(var: str, command: str) -> str:
    return re.sub(rf"{var}=\S+\s*", "", command)


def start_index(commands: list[str]) -> int:
    return next(i for i, c in enumerate(commands) if "ray start" in c)


LAUNCHERS = ["aws-burst.yaml", "gcp-burst.yaml", "azure-burst.yaml", "onprem.yaml"]
CLUSTER_VARS = ["TIDAL_STORAGE", "MLFLOW_TRACKING_URI"]


@pytest.mark.parametrize("var", CLUSTER_VARS)
@pytest.mark.parametrize("name", LAUNCHERS)
def test_worker_start_without_a_cluster_variable_is_refused(name: str, var: str):
    c = config(name)
    c["worker_start_ray_commands"] = [without(var, cmd) for cmd in c["worker_start_ray_commands"]]
    problems = check_launcher(c)
    i = start_index(c["worker_start_ray_commands"])
    assert wheres(problems) == [f"worker_start_ray_commands[{i}].{var}"]
    assert f"does not set {var}" in problems[0][1] and "in front of `ray start`" in problems[0][1]


@pytest.mark.parametrize("var", CLUSTER_VARS)
@pytest.mark.parametrize("name", [*LAUNCHERS, "local-burst.yaml"])
def test_head_start_without_a_cluster_variable_is_refused(name: str, var: str):
    c = config(name)
    c["head_start_ray_commands"] = [without(var, cmd) for cmd in c["head_start_ray_commands"]]
    problems = check_launcher(c)
    assert wheres(problems) == [f"head_start_ray_commands[{start_index(c['head_start_ray_commands'])}].{var}"]


@pytest.mark.parametrize("name", [*LAUNCHERS, "local-burst.yaml"])
def test_head_without_mlflow_server_is_refused(name: str):
    c = config(name)
    c["head_start_ray_commands"] = [cmd for cmd in c["head_start_ray_commands"] if "mlflow server" not in cmd]
    problems = check_launcher(c)
    assert wheres(problems) == ["head_start_ray_commands"]
    assert "no `mlflow server`" in problems[0][1] and "MLFLOW_TRACKING_URI" in problems[0][1]


def test_an_export_in_an_earlier_command_does_not_reach_ray_start():
    c = aws()
    start = without("TIDAL_STORAGE", c["worker_start_ray_commands"][1])
    c["worker_start_ray_commands"] = ["ray stop", "export TIDAL_STORAGE=s3://b/runs", start]
    problems = check_launcher(c)
    assert wheres(problems) == ["worker_start_ray_commands[2].TIDAL_STORAGE"]
    assert "its own shell" in problems[0][1]
    c["worker_start_ray_commands"] = ["ray stop", f"export TIDAL_STORAGE=s3://b/runs; {start}"]
    assert check_launcher(c) == []


def test_storage_must_be_shared_and_absolute():
    onprem = config("onprem.yaml")
    onprem["initialization_commands"] = []  # the NFS mount is gone: /mnt/tidal is a local disk
    problems = check_launcher(onprem)
    assert set(wheres(problems)) == {"head_start_ray_commands[2].TIDAL_STORAGE",
                                     "worker_start_ray_commands[1].TIDAL_STORAGE",
                                     "head_start_ray_commands[1].--artifacts-destination"}
    assert all("no command mounts" in m or "other nodes cannot read" in m for _, m in problems)
    c = config("local-burst.yaml")  # one machine: a local path is shared, but must be absolute
    c["head_start_ray_commands"][1] = c["head_start_ray_commands"][1].replace("TIDAL_STORAGE=$PWD/", "TIDAL_STORAGE=./")
    problems = check_launcher(c)
    assert wheres(problems) == ["head_start_ray_commands[1].TIDAL_STORAGE"] and "relative" in problems[0][1]


@pytest.mark.parametrize("uri", ["sqlite:///mlflow.db", "http://localhost:5000", "./mlruns"])
def test_workers_track_to_the_heads_server(uri: str):
    c = aws()
    c["worker_start_ray_commands"][1] = re.sub(r"MLFLOW_TRACKING_URI=\S+", f"MLFLOW_TRACKING_URI={uri}",
                                               c["worker_start_ray_commands"][1])
    problems = check_launcher(c)
    assert wheres(problems) == ["worker_start_ray_commands[1].MLFLOW_TRACKING_URI"]


def test_single_machine_cluster_may_track_to_a_sqlite_file():
    c = config("local-burst.yaml")
    c["head_start_ray_commands"][1] = c["head_start_ray_commands"][1].replace(
        "MLFLOW_TRACKING_URI=http://127.0.0.1:5000", "MLFLOW_TRACKING_URI=sqlite:////tmp/tidal/mlflow.db")
    assert check_launcher(c) == []


def test_mlflow_server_flags():
    c = aws()
    c["head_start_ray_commands"][1] = "nohup mlflow server --port 5000 > ~/mlflow.log 2>&1 < /dev/null &"
    assert set(wheres(check_launcher(c))) == {"head_start_ray_commands[1].--backend-store-uri",
                                              "head_start_ray_commands[1].--artifacts-destination",
                                              "head_start_ray_commands[1].--host"}
    c["head_start_ray_commands"][1] = ("MLFLOW_AUTH_CONFIG_PATH=/a.ini MLFLOW_AUTH_ADMIN_PASSWORD=\"$(cat p)\" "
                                       "MLFLOW_FLASK_SERVER_SECRET_KEY=\"$(cat k)\" mlflow server --app-name basic-auth "
                                       "--host $HEAD_IP --backend-store-uri sqlite:////m.db --default-artifact-root "
                                       "s3://b/mlartifacts &")
    assert check_launcher(c) == []


# --- what a config exposes: MLflow's authentication and address, the dashboard, inline secrets --

def mlflow_line(c: dict[str, Any]) -> int:
    return next(i for i, cmd in enumerate(c["head_start_ray_commands"]) if "mlflow server" in cmd)


@pytest.mark.parametrize("name", LAUNCHERS)
def test_mlflow_on_every_interface_without_auth_is_refused(name: str):
    """The configs as they were before issue #37: MLflow on 0.0.0.0:5000 with no authentication."""
    c = config(name)
    i = mlflow_line(c)
    c["head_start_ray_commands"][i] = c["head_start_ray_commands"][i].replace("--app-name basic-auth ", "").replace(
        "--host $HEAD_IP", "--host 0.0.0.0")
    problems = check_launcher(c)
    assert wheres(problems) == [f"head_start_ray_commands[{i}].--host"] * 2
    assert "without authentication" in problems[0][1] and "--app-name basic-auth" in problems[0][1]
    assert "every interface" in problems[1][1] and "private address" in problems[1][1]


@pytest.mark.parametrize("name", LAUNCHERS)
def test_mlflow_without_auth_on_a_private_address_is_refused(name: str):
    c = config(name)
    i = mlflow_line(c)
    c["head_start_ray_commands"][i] = c["head_start_ray_commands"][i].replace("--app-name basic-auth ", "")
    problems = check_launcher(c)
    assert wheres(problems) == [f"head_start_ray_commands[{i}].--host"]
    assert "MLflow listens on $HEAD_IP without authentication" in problems[0][1]


def test_mlflow_on_loopback_needs_no_auth_and_a_public_ip_is_refused():
    c = config("local-burst.yaml")  # one machine: 127.0.0.1, no authentication needed
    assert "--host 127.0.0.1" in c["head_start_ray_commands"][0] and check_launcher(c) == []
    c = aws()
    c["head_start_ray_commands"][1] = c["head_start_ray_commands"][1].replace("--host $HEAD_IP", "--host 54.1.2.3")
    problems = check_launcher(c)
    assert wheres(problems) == ["head_start_ray_commands[1].--host"] and "a public address" in problems[0][1]


@pytest.mark.parametrize("var", ["MLFLOW_AUTH_CONFIG_PATH", "MLFLOW_AUTH_ADMIN_PASSWORD",
                                 "MLFLOW_FLASK_SERVER_SECRET_KEY"])
def test_basic_auth_app_gets_what_it_needs_to_start_locked(var: str):
    """Without its settings MLflow's packaged default_permission READ lets every user read every team's
    runs; without the admin password or the CSRF key the server does not start (tests/test_mlflow_auth.py)."""
    c = aws()
    c["head_start_ray_commands"][1] = re.sub(rf'{var}=("[^"]+"|\S+)\s*', "", c["head_start_ray_commands"][1])
    problems = check_launcher(c)
    assert wheres(problems) == [f"head_start_ray_commands[1].{var}"] and "basic-auth app needs" in problems[0][1]
    m = load(KUBERAY)
    mlflow = containers(m, "head")[1]
    mlflow["env"] = [e for e in mlflow["env"] if e["name"] != var]
    assert wheres(check_kuberay(m)) == [f"spec.headGroupSpec.template.spec.containers[mlflow].env.{var}"]


@pytest.mark.parametrize("name", LAUNCHERS)
@pytest.mark.parametrize("key", ["head_start_ray_commands", "worker_start_ray_commands"])
def test_jobs_on_a_cluster_with_mlflow_auth_carry_credentials(name: str, key: str):
    c = config(name)
    c[key] = [re.sub(r'MLFLOW_TRACKING_(USERNAME=\S+|PASSWORD="[^"]+")\s*', "", cmd) for cmd in c[key]]
    problems = check_launcher(c)
    assert wheres(problems) == [f"{key}[{start_index(c[key])}]"]
    assert "MLFLOW_TRACKING_USERNAME" in problems[0][1] and "MLFLOW_TRACKING_TOKEN" in problems[0][1]
    c[key] = [cmd.replace("RAY_AUTH_MODE=", 'MLFLOW_TRACKING_TOKEN="$(cat ~/.tidal/mlflow-token)" RAY_AUTH_MODE=') for cmd in c[key]]
    assert check_launcher(c) == []  # a token does as well


@pytest.mark.parametrize("name", LAUNCHERS)
def test_dashboard_on_a_public_address_is_refused(name: str):
    c = config(name)
    i = start_index(c["head_start_ray_commands"])
    c["head_start_ray_commands"][i] += " --dashboard-host=0.0.0.0"
    problems = check_launcher(c)
    assert wheres(problems) == [f"head_start_ray_commands[{i}].--dashboard-host"]
    assert "ray dashboard" in problems[0][1] and "TLS" in problems[0][1]
    c["head_start_ray_commands"][i] = c["head_start_ray_commands"][i].replace("0.0.0.0", "10.0.0.10")
    assert check_launcher(c) == []  # a private address is not public


@pytest.mark.parametrize(("key", "var"), [("head_start_ray_commands", "MLFLOW_AUTH_ADMIN_PASSWORD"),
                                          ("worker_start_ray_commands", "MLFLOW_TRACKING_PASSWORD"),
                                          ("setup_commands", "RAY_AUTH_TOKEN")])
def test_inline_secret_is_refused_naming_the_key(key: str, var: str):
    c = aws()
    if key == "setup_commands":
        c[key].append(f"export {var}=abc123; echo $HOME")
        i = len(c[key]) - 1
    else:
        i = next(j for j, cmd in enumerate(c[key]) if var in cmd)
        c[key][i] = re.sub(rf'{var}="[^"]+"', f"{var}=hunter2", c[key][i])
    problems = check_launcher(c)
    assert wheres(problems) == [f"{key}[{i}].{var}"]
    assert "secret written inline" in problems[0][1] and "$(cat" in problems[0][1]


def test_old_checkpoint_storage_key_is_replaced_by_tidal_storage():
    c = aws()
    c["metadata"] = {"tidal": {"checkpoint_storage": "s3://b/runs"}}
    problems = check_launcher(c)
    assert wheres(problems) == ["metadata.tidal.checkpoint_storage"]
    assert "replaced by TIDAL_STORAGE on every node" in problems[0][1]


def test_local_provider_declares_everything_on_ray_start_lines():
    c = load(ROOT / "cluster_configs" / "onprem.yaml")
    c["worker_start_ray_commands"] = ["TIDAL_STORAGE=/mnt/tidal/runs MLFLOW_TRACKING_URI=http://$RAY_HEAD_IP:5000 "
                                      "MLFLOW_TRACKING_TOKEN=$(cat ~/t) ray start --address=$RAY_HEAD_IP:6379 --num-gpus=1.5"]
    problems = check_launcher(c)
    assert set(wheres(problems)) == {"worker_start_ray_commands.--num-gpus",
                                     f"worker_start_ray_commands.--labels {SITE_LABEL}",
                                     f"worker_start_ray_commands.--labels {PRICE_LABEL}"}
    c = load(ROOT / "cluster_configs" / "onprem.yaml")
    c["available_node_types"] = {"x": {"resources": {}, "node_config": {}}}
    assert "available_node_types" in wheres(check_launcher(c))


def test_unreadable_files(tmp_path: Path):
    (tmp_path / "a.yaml").write_text("just text")
    assert wheres(validate_cluster_config(tmp_path / "a.yaml")) == ["<file>"]
    assert wheres(validate_cluster_config(tmp_path / "missing.yaml")) == ["<file>"]


# --- KubeRay ----------------------------------------------------------------------------------

def test_kuberay_manifest_groups_carry_sites_and_bounds():
    m = load(KUBERAY)
    assert m["kind"] == "RayCluster" and m["spec"]["enableInTreeAutoscaling"] is True
    sites = {}
    for g in m["spec"]["workerGroupSpecs"]:
        assert f"{SITE_LABEL}=" in g["rayStartParams"]["labels"]
        labels = dict(kv.split("=") for kv in g["rayStartParams"]["labels"].split(","))
        sites[labels[SITE_LABEL]] = g
        assert float(labels[PRICE_LABEL]) >= 0
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
    assert set(sites) == {"onprem", "cloud"}
    assert sites["cloud"]["minReplicas"] == 0


def test_kuberay_broken_variants():
    m = load(KUBERAY)
    cloud = m["spec"]["workerGroupSpecs"][1]
    cloud["minReplicas"], cloud["maxReplicas"] = 3, 2
    cloud["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = 0.5
    del m["spec"]["workerGroupSpecs"][0]["rayStartParams"]["labels"]
    m["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"] = [{"name": "RAY_AUTH_MODE", "value": "disabled"}]
    got = set(wheres(check_kuberay(m)))
    assert {"spec.workerGroupSpecs[cloud-gpu].minReplicas",
            "spec.workerGroupSpecs[cloud-gpu].containers[ray-worker].resources.limits.nvidia.com/gpu",
            f"spec.workerGroupSpecs[onprem-gpu].rayStartParams.labels {SITE_LABEL}"} <= got
    assert any(w.startswith("spec.headGroupSpec.template") for w in got)  # the auth env


def containers(m: dict[str, Any], group: str) -> list[dict[str, Any]]:
    spec = m["spec"]
    g = spec["headGroupSpec"] if group == "head" else next(
        g for g in spec["workerGroupSpecs"] if g["groupName"] == group)
    return g["template"]["spec"]["containers"]


CLOUD_WORKER = "spec.workerGroupSpecs[cloud-gpu].template.spec.containers[ray-worker].env"


@pytest.mark.parametrize("var", CLUSTER_VARS)
def test_kuberay_worker_without_a_cluster_variable_is_refused(var: str):
    m = load(KUBERAY)
    worker = containers(m, "cloud-gpu")[0]
    worker["env"] = [e for e in worker["env"] if e["name"] != var]  # its own list: the anchor is shared
    problems = check_kuberay(m)
    assert wheres(problems) == [CLOUD_WORKER] and f"no {var}" in problems[0][1]


@pytest.mark.parametrize("var", CLUSTER_VARS)
def test_kuberay_every_head_container_sets_the_cluster_variables(var: str):
    m = load(KUBERAY)
    for c in containers(m, "head"):
        c["env"] = [e for e in c["env"] if e["name"] != var]
    assert set(wheres(check_kuberay(m))) == {"spec.headGroupSpec.template.spec.containers[ray-head].env",
                                             "spec.headGroupSpec.template.spec.containers[mlflow].env"}


def test_kuberay_head_without_mlflow_server_is_refused():
    m = load(KUBERAY)
    m["spec"]["headGroupSpec"]["template"]["spec"]["containers"] = containers(m, "head")[:1]
    problems = check_kuberay(m)
    assert wheres(problems) == ["spec.headGroupSpec.template.spec.containers"]
    assert "mlflow server" in problems[0][1]


def test_kuberay_storage_and_tracking_values():
    m = load(KUBERAY)
    worker = containers(m, "cloud-gpu")[0]
    worker["volumeMounts"] = []
    problems = check_kuberay(m)
    assert wheres(problems) == [f"{CLOUD_WORKER}.TIDAL_STORAGE"] and "shared volume" in problems[0][1]
    worker["env"] = [{**e, "value": "s3://b/runs"} if e["name"] == "TIDAL_STORAGE" else e for e in worker["env"]]
    assert check_kuberay(m) == []  # object storage needs no volume
    worker["env"] = [{**e, "value": "http://localhost:5000"} if e["name"] == "MLFLOW_TRACKING_URI" else e
                     for e in worker["env"]]
    assert wheres(check_kuberay(m)) == [f"{CLOUD_WORKER}.MLFLOW_TRACKING_URI"]
    m = load(KUBERAY)
    m["metadata"]["annotations"] = {"tidal.io/checkpoint-storage": "s3://b/runs"}
    assert wheres(check_kuberay(m)) == ["metadata.annotations.tidal.io/checkpoint-storage"]


def test_kuberay_exposure_and_inline_secrets():
    m = load(KUBERAY)
    mlflow = containers(m, "head")[1]
    mlflow["args"] = [a for a in mlflow["args"] if not a.startswith("--app-name")]
    problems = check_kuberay(m)
    assert wheres(problems) == ["spec.headGroupSpec.template.spec.containers[mlflow].--host"]
    assert "without authentication" in problems[0][1]  # 0.0.0.0 alone is the pod's IP: not refused
    m = load(KUBERAY)
    m["spec"]["headGroupSpec"]["serviceType"] = "LoadBalancer"
    mlflow = containers(m, "head")[1]
    mlflow["env"] = [{"name": e["name"], "value": "hunter2"} if e["name"] == "MLFLOW_AUTH_ADMIN_PASSWORD" else e
                     for e in mlflow["env"]]
    worker = containers(m, "cloud-gpu")[0]
    worker["env"] = [e for e in worker["env"] if not e["name"].startswith("MLFLOW_TRACKING_")
                     or e["name"] == "MLFLOW_TRACKING_URI"]
    assert set(wheres(check_kuberay(m))) == {
        "spec.headGroupSpec.serviceType",
        "spec.headGroupSpec.template.spec.containers[mlflow].env.MLFLOW_AUTH_ADMIN_PASSWORD",
        CLOUD_WORKER}


# --- the CLI ----------------------------------------------------------------------------------

def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tidal")
    register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_validate_ok_and_problems(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert cli(["cluster", "validate", *map(str, CONFIGS)]) == 0
    out = capsys.readouterr().out
    assert out.count("ok  ") == len(CONFIGS)
    c = aws()
    c["available_node_types"]["gpu.l40s.spot"]["resources"]["GPU"] = 0.5
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(c))
    assert cli(["cluster", "validate", str(bad)]) == 2
    out = capsys.readouterr().out
    assert f"{L40S}.resources.GPU:" in out and "Traceback" not in out


def test_cluster_cli_does_not_import_ray():
    code = ("import sys, argparse; from tidal.cluster.cli import register; "
            "register(argparse.ArgumentParser().add_subparsers()); print('ray' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


# --- the placement policy (pure) ------------------------------------------------------------

def test_pinned_sites_require_their_resource():
    for site in ("onprem", "cloud"):
        d = decide(site, 2, SiteRoom(), waited_s=0, burst_after_s=300, autoscaler=True)
        assert (d.action, d.worker_resource, d.cloud_bundles) == ("run", f"site_{site}", 0)


def test_any_prefers_onprem_when_it_has_room():
    d = decide("any", 2, SiteRoom(onprem_free=4), waited_s=0, burst_after_s=300, autoscaler=True)
    assert (d.action, d.worker_resource, d.cloud_bundles) == ("run", None, 0)
    assert "on-prem has room" in d.reason


def test_any_waits_then_bursts_for_the_missing_workers():
    room = SiteRoom(onprem_free=1)
    d = decide("any", 3, room, waited_s=10, burst_after_s=300, autoscaler=True)
    assert d.action == "wait" and d.cloud_bundles == 0 and "290s" in d.reason
    d = decide("any", 3, room, waited_s=300, burst_after_s=300, autoscaler=True)
    assert (d.action, d.cloud_bundles) == ("burst", 2)


def test_burst_request_covers_cloud_nodes_already_busy():
    # The autoscaler sizes total capacity to a request: 2 busy cloud slots + 1 missing = 3.
    d = decide("any", 2, SiteRoom(onprem_free=1, cloud_free=0, cloud_total=2), waited_s=5, burst_after_s=0, autoscaler=True)
    assert (d.action, d.cloud_bundles) == ("burst", 3)


def test_idle_cloud_capacity_is_used_without_waiting():
    d = decide("any", 2, SiteRoom(onprem_free=1, cloud_free=1, cloud_total=1), waited_s=0, burst_after_s=300, autoscaler=True)
    assert (d.action, d.cloud_bundles) == ("run", 0)


def test_no_autoscaler_never_waits():
    d = decide("any", 2, SiteRoom(), waited_s=0, burst_after_s=300, autoscaler=False)
    assert (d.action, d.cloud_bundles) == ("run", 0) and "no autoscaler" in d.reason


def test_scaling_overrides_and_cloud_request(tmp_path: Path):
    spec = tiny_spec(tmp_path, **{"scaling.gpus_per_worker": 1, "scaling.site": "onprem"})
    assert scaling_overrides(spec) == {"resources_per_worker": {"CPU": 1.0, "GPU": 1, "site_onprem": SITE_SLIVER}}
    spec = tiny_spec(tmp_path, **{"scaling.site": "any"})
    assert scaling_overrides(spec) == {"resources_per_worker": {"CPU": 1.0}}
    bundles, selectors = cloud_request(tiny_spec(tmp_path, **{"scaling.gpus_per_worker": 1}), 2)
    assert bundles == [{"CPU": 1.0, "GPU": 1, "site_cloud": SITE_SLIVER}] * 2
    assert selectors == [{SITE_LABEL: "cloud"}] * 2


def test_slots_and_site_room():
    bundle = {"CPU": 1.0, "GPU": 1}
    assert slots({"CPU": 4.0, "GPU": 2.0}, bundle) == 2
    assert slots({"CPU": 0.5, "GPU": 2.0}, bundle) == 0
    nodes = [
        {"NodeID": "head", "Alive": True, "Resources": {"CPU": 1.0, "site_onprem": 1000.0}, "Labels": {}},
        {"NodeID": "op", "Alive": True, "Resources": {"CPU": 2.0, "GPU": 2.0}, "Labels": {SITE_LABEL: "onprem"}},
        {"NodeID": "cl", "Alive": True, "Resources": {"CPU": 1.0, "GPU": 1.0, "site_cloud": 1000.0}, "Labels": {}},
        {"NodeID": "gone", "Alive": False, "Resources": {"CPU": 8.0, "GPU": 8.0, "site_cloud": 1.0}, "Labels": {}},
        {"NodeID": "plain", "Alive": True, "Resources": {"CPU": 8.0, "GPU": 8.0}, "Labels": {}},
    ]
    available = {"head": {"CPU": 1.0}, "op": {"CPU": 1.0, "GPU": 1.0}, "cl": {"CPU": 0.0, "GPU": 0.0},
                 "plain": {"CPU": 8.0, "GPU": 8.0}}
    assert site_room(nodes, available, bundle) == SiteRoom(onprem_free=1, cloud_free=0, cloud_total=1)


def test_watcher_waits_then_bursts_then_clears(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The controller loop with a fake clock and cluster: wait, burst, wait for launch, clear."""
    spec = tiny_spec(tmp_path, **{"scaling.gpus_per_worker": 1, "scaling.burst_after_s": 3.0})
    now = [0.0]
    rooms = iter([SiteRoom(onprem_free=1)] * 5 + [SiteRoom(onprem_free=1, cloud_free=1, cloud_total=1)] * 10)
    sent: list[list[dict[str, float]]] = []
    w = BurstWatcher(spec, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    monkeypatch.setattr(w, "room", lambda: next(rooms))
    monkeypatch.setattr("ray.autoscaler.sdk.request_resources", lambda bundles, **_: sent.append(bundles))
    d = w.wait_for_room()
    assert d.action == "burst" and d.cloud_bundles == 1 and now[0] >= 3.0
    assert sent and len(sent[0]) == 1 and sent[0][0]["site_cloud"] == SITE_SLIVER
    w.clear()
    assert sent[-1] == [] and w.requested == 0


# --- status formatting (pure) ---------------------------------------------------------------

def test_status_formatting():
    status = {"autoscaler_report": {"pending_launches": {"cloud.gpu": 1}, "pending_nodes": []},
              "load_metrics_report": {"pg_demand": [[{"GPU": 1.0, "CPU": 1.0}, 2]]}}
    text = "\n".join(format_demand(status))
    assert "1x cloud.gpu" in text and "2x {CPU: 1, GPU: 1}" in text
    assert "none reporting" in format_demand({})[0]
    assert format_workers([], []) == ["training workers: none running"]
