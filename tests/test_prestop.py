"""The shipped KubeRay manifests drain each worker pod's Ray node before Kubernetes stops it (a
`preStop` running `tidal cluster drain-node`), with a grace period that outlasts the drain
(tidal/cluster/prestop.py); `tidal cluster validate` refuses a grace too short for it. The manifests'
match with KubeRay's CRDs is tests/test_kueue_manifests.py's; the preStop run on a real raylet is
tests/test_notice_e2e.py's."""

from __future__ import annotations

import copy

import pytest
import yaml

from tests.conftest import ROOT
from tests.helpers import cluster_spec, prestop_command
from tidal.cluster.kuberay import check_kuberay
from tidal.cluster.prestop import RAY_STOP_S, drain_deadline_s

KUBERAY = ROOT / "cluster_configs" / "kuberay"
MANIFESTS = ["raycluster.yaml", "rayjob.yaml", "rayjob-elastic.yaml"]


@pytest.mark.parametrize("name", MANIFESTS)
def test_every_worker_pod_drains_its_node_before_it_stops_with_room_to_save(name):
    spec = cluster_spec(KUBERAY / name)
    for group in spec["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        deadline = drain_deadline_s(pod["containers"][0])
        assert deadline is not None, f"{name} {group['groupName']}: no drain-node preStop"
        assert pod["terminationGracePeriodSeconds"] >= deadline + RAY_STOP_S
        assert deadline >= 30, "room for a step and a save of a real job"
    assert "lifecycle" not in spec["headGroupSpec"]["template"]["spec"]["containers"][0]


def test_a_grace_period_shorter_than_the_drain_is_refused_naming_it():
    manifest = yaml.safe_load((KUBERAY / "raycluster.yaml").read_text())
    assert check_kuberay(manifest) == []
    short = copy.deepcopy(manifest)
    del short["spec"]["workerGroupSpecs"][0]["template"]["spec"]["terminationGracePeriodSeconds"]  # Kubernetes' 30 s
    problems = check_kuberay(short)
    assert len(problems) == 1
    where, message = problems[0]
    assert where.endswith("template.spec.terminationGracePeriodSeconds") and "at least 115" in message, problems


def test_the_prestop_command_is_tidals_own_cli():
    import argparse

    from tidal.cluster.cli import register

    command = prestop_command()
    assert command[:3] == ["tidal", "cluster", "drain-node"]
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(command[1:])
    assert args.deadline_s == 105 and args.address is None  # RAY_ADDRESS: KubeRay sets it in every Ray container
