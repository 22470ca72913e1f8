"""A real cloud burst on Ray's autoscaler, simulated on this machine.

Ray's fake multi-node provider (cluster_configs/local-burst.yaml) runs one "on-prem" GPU node
from the start. A job with `scaling.site: any` needs 2 GPU workers; after `burst_after_s`
Tidal asks the autoscaler for cloud capacity, the autoscaler launches a "cloud" node, the job
runs on both sites, and once it ends the idle cloud node is terminated.

The head runs in its own session on its own ports and temp dir and is stopped by killing its
processes (never `ray stop`, which would kill every Ray on the machine). Fake GPUs are logical:
torch sees no CUDA, so the workers train on CPU with gloo.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import ROOT, metric_history, tiny_spec
from tidal.testing.heads import KEEP_LOGS_ENV, ray_head
from tidal.testing.processes import free_port, wait_for

pytestmark = pytest.mark.slow

IDLE_TIMEOUT_MIN = 0.5  # 30 s: long enough to still see the cloud node in the status taken after the job
MEMORY = 150 * 1024 * 1024  # object store per node: three raylets share a small machine


def burst_config(port: int, node_ip: str) -> dict[str, Any]:
    """The shipped local-burst config, with this head's GCS address and a short idle timeout."""
    config = yaml.safe_load((ROOT / "cluster_configs" / "local-burst.yaml").read_text())
    config["idle_timeout_minutes"] = IDLE_TIMEOUT_MIN
    config["provider"]["gcs_address"] = f"{node_ip}:{port}"
    types = config["available_node_types"]
    types["cloud.gpu"]["max_workers"] = 1
    for name in ("onprem.gpu", "cloud.gpu"):
        types[name]["resources"]["object_store_memory"] = MEMORY
    return config


@pytest.fixture(scope="module")
def burst_cluster() -> Iterator[str]:
    """A head with the fake multi-node autoscaler (tidal.testing.heads); yields its GCS address,
    this process its driver."""
    import ray

    tmp = Path(tempfile.mkdtemp(prefix="tb-", dir="/tmp"))  # short: Ray's socket paths have a length limit
    port, node_ip = free_port(), ray.util.get_node_ip_address()
    config = tmp / "cluster.yaml"
    config.write_text(yaml.safe_dump(burst_config(port, node_ip)))
    env = {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
    args = [f"--autoscaling-config={config}", "--num-gpus=0", f"--object-store-memory={MEMORY}",
            f"--resources={json.dumps({'site_onprem': 1000})}", "--labels=tidal.io/site=onprem"]
    try:
        with ray_head(tmp, 1, env, args=args, port=port, node_ip=node_ip, ray_tmp=tmp, connect=True) as head:
            yield head.gcs
    finally:
        if os.environ.get(KEEP_LOGS_ENV) != "1":
            shutil.rmtree(tmp, ignore_errors=True)


def nodes_by_site() -> dict[str, int]:
    import ray

    from tidal.sites import node_site

    counts: dict[str, int] = {}
    for n in ray.nodes():
        if n["Alive"] and n["Resources"].get("GPU"):
            site = node_site(n["Resources"], n.get("Labels") or {}) or "?"
            counts[site] = counts.get(site, 0) + 1
    return counts


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): burst decisions and configs are unit-tested (test_admission_policy, test_cluster_configs)
def test_job_bursts_to_cloud_and_the_cloud_node_is_released(burst_cluster: str, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch):
    import torch.distributed as dist

    import tidal

    if not dist.is_nccl_available():
        # worker/device.py picks "cpu:gloo,cuda:nccl" whenever GPUs are requested, and a CPU-only
        # torch refuses that string ("Distributed package doesn't have NCCL built in"). Until
        # dist_backend checks for NCCL, train the fake-GPU workers over plain gloo.
        monkeypatch.setattr("tidal.launch.trainer.dist_backend", lambda gpus: "gloo")
    from tidal.cluster.burst import burst_capacity, scaling_overrides
    from tidal.cluster.status import cluster_status

    # The on-prem GPU node (min_workers: 1) comes up by itself; no cloud node yet.
    wait_for("the on-prem GPU node", lambda: nodes_by_site() == {"onprem": 1}, timeout=90)

    spec = tiny_spec(tmp_path, "burst", **{"scaling.gpus_per_worker": 1, "scaling.site": "any",
                                           "scaling.burst_after_s": 2.0, "train.steps": 16})
    assert scaling_overrides(spec) == {"resources_per_worker": {"CPU": 1.0, "GPU": 1}}  # either site
    t0 = time.monotonic()
    with burst_capacity(spec) as watcher:
        assert watcher is not None, "the fake cluster has an autoscaler and site resources: burst applies"
        assert nodes_by_site() == {"onprem": 1, "cloud": 1}, "the autoscaler launched a cloud node"
        result = tidal.run(spec)
        status = cluster_status()
    out = capsys.readouterr().out
    print(out)
    print(status)

    assert len(metric_history(spec, result.mlflow_run_id, "loss")) == 16
    assert "asking the autoscaler for 1 cloud worker slot(s)" in out
    assert time.monotonic() - t0 >= spec.scaling.burst_after_s
    assert {"onprem": 1, "cloud": 1} in watcher.placements, f"workers seen: {watcher.placements}"
    assert "site cloud: 1 node(s)" in status and "site onprem:" in status

    # Request withdrawn, job over: the idle cloud node is terminated; the on-prem node stays.
    assert watcher.requested == 0
    wait_for("the idle cloud node to be released", lambda: nodes_by_site() == {"onprem": 1}, timeout=90)


def requested_gpu_bundles() -> int:
    """GPU bundles in the autoscaler's standing request (what request_resources last asked for)."""
    from tidal.cluster.status import demand_record
    from tidal.ray_private import autoscaler_report

    record = demand_record(autoscaler_report()) or {}
    return sum(d["count"] for d in record.get("request_demand", []) if d["shape"].get("GPU"))


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): two jobs bursting; summing and the budget rule are unit-tested (test_admission_policy)
def test_two_jobs_bursts_are_summed_and_a_team_past_its_budget_is_refused(burst_cluster: str, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch):
    """request_resources is global: when each job called it, the second job's burst replaced the
    first's (the autoscaler asked for 1 bundle, not 2). Under admission one caller sends the sum,
    and a team whose cloud budget is spent is refused, naming the team and the budget."""
    import ray

    from tidal.admission.naming import ACTOR, NAMESPACE
    from tidal.cluster.burst import BurstWatcher

    quotas = {"unit": "gpus", "defaults": {"team": "vision", "priority": "normal"},
              "teams": {"vision": {"onprem": {"guaranteed": 1}, "cloud": {"borrow": 4}},
                        "interns": {"onprem": {"borrow": 1}, "cloud": {"borrow": 4},
                                    "cloud_budget": {"gpu_hours_per_day": 0.0002}}}}  # 0.72 GPU-seconds
    (tmp_path / "quotas.yaml").write_text(yaml.safe_dump(quotas))
    monkeypatch.setenv("TIDAL_QUOTAS", str(tmp_path / "quotas.yaml"))
    monkeypatch.setenv("TIDAL_QUEUE", str(tmp_path / "queue" / "queue.json"))

    def watcher(name: str, team: str) -> BurstWatcher:
        return BurstWatcher(tiny_spec(tmp_path, name, **{"scaling.gpus_per_worker": 1, "scaling.site": "any",
                                                         "scheduling.team": team}))

    one, two, spender, late = (watcher("burst-one", "vision"), watcher("burst-two", "vision"),
                               watcher("burst-spender", "interns"), watcher("burst-late", "interns"))
    try:
        one.request(1)
        two.request(1)
        wait_for("the autoscaler asked for both jobs' bursts", lambda: requested_gpu_bundles() == 2, timeout=30)
        spender.request(1)
        assert spender.requested == 1, "nothing spent today yet: granted"
        time.sleep(3)  # the interns' burst holds a GPU for longer than their budget
        late.request(1)
        assert late.requested == 0 and late.refused is not None
        assert "team 'interns'" in late.refused and "0.0002 GPU-hours per day" in late.refused, late.refused
        wait_for("the vision team's two bursts still requested, the interns' withdrawn",
                 lambda: requested_gpu_bundles() == 2, timeout=30)
    finally:
        for w in (one, two, spender, late):
            w.clear()
        with contextlib.suppress(ValueError):
            ray.kill(ray.get_actor(ACTOR, namespace=NAMESPACE))
