"""A warned node loss on real Ray, one raylet per simulated node (`ray.cluster_utils.Cluster`): the
node's cloud announces its interruption in its metadata service (served on 127.0.0.1 as AWS documents
it, tidal/testing/metadata.py), the node's `tidal cluster watch-notices` drains it in Ray with the
notice's deadline, the job saves at the step reached, the node goes, the job resumes at the smaller
size from that checkpoint with no step trained twice, then grows back when a node returns.

Before the watcher, the notice was ignored: the node just went, and the job lost the steps since
its last periodic checkpoint (tests/test_elastic.py's node loss)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT, metric_history, tiny_spec
from tests.helpers import prestop_command
from tests.slow_step import slow_env
from tidal.storage import RunDir, check_complete, checkpoint_dir_name
from tidal.testing.clusters import add_worker_node, raylet_cluster
from tidal.testing.metadata import MetadataState, metadata_server
from tidal.testing.processes import start_in_session, stop_session, wait_for
from tidal.testing.runs import finished, run_in_background
from tidal.worker.checkpoint.snapshot import WRITE_DELAY_ENV

pytestmark = pytest.mark.slow

DEADLINE_S = 12  # the notice's lead (AWS gives 120 s; shorter here to keep the test short)
POD_IP = "127.0.0.2"  # a simulated pod's own address (loopback): the preStop finds its node by it


@pytest.fixture(scope="module")
def cluster() -> Iterator:
    with raylet_cluster() as c:
        yield c


@pytest.fixture(autouse=True)
def nodes_removed_after(cluster) -> Iterator[None]:
    """Each test starts from a cluster with no worker node, whether the one before passed or not: a
    failed test's nodes left behind took the next test's job, so that its warned node sat idle and Ray
    drained it at once (the full extended run of 2026-12-06)."""
    yield
    for node in list(cluster.worker_nodes):
        cluster.remove_node(node)


def records(trace: Path) -> list[dict]:
    """Every log step rank 0 trained, in every life of the job (worker/metrics.trace_loss)."""
    return [json.loads(line) for line in trace.read_text().splitlines()] if trace.exists() else []


def node_env() -> dict[str, str]:
    """A node's environment for Tidal's commands: this checkout's package, and Ray's token auth
    (the cluster configs start the watcher with RAY_AUTH_MODE=token)."""
    path = os.pathsep.join([str(ROOT / "platform"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "RAY_AUTH_MODE": "token"}


def warned_job(tmp: Path, name: str, **extra: object) -> tuple:
    """A 1-2 worker elastic job, each step held to ~0.1 s per micro-batch until `hold` is removed
    (the job must still train when the node returns); a periodic checkpoint only every 100 steps, so
    that a save at another step is the emergency one. `extra`: more of the spec, and `env` more of the
    workers' environment."""
    hold, trace = tmp / "hold", tmp / "loss.trace"
    hold.touch()
    env = dict(extra.pop("env", {}))  # type: ignore[arg-type]
    spec = tiny_spec(tmp, name=name, **{
        "train.steps": 300, "checkpoint.every_steps": 100, "scaling.min_workers": 1, "scaling.max_workers": 2,
        "scaling.elastic_check_s": 2, "train.step_fn": "tests.slow_step:step", **extra,
    }, worker_env={**slow_env(0.05, hold), "TIDAL_LOSS_TRACE": str(trace), **env})
    return spec, hold, trace


def shrank_since(trace: Path, warned_at: int) -> bool:
    """Whether a group at 1 worker trained after the warning (`warned_at`: how many records the trace held
    then). An elastic job may start at 1 worker, before Ray sees the second node's CPU, and grow to 2:
    that early group is not the shrink the warning brings."""
    return any(r["world"] == 1 for r in records(trace)[warned_at:])


def assert_saved_at_the_step_reached_and_resumed_there(out: str, trace: Path, warned_at: int) -> int:
    """The emergency checkpoint's step N; the group at 2 trained up to N and no further, and the
    group at 1 started at N + 1: no step lost, none trained twice (records since the warning)."""
    said = re.findall(r"preemption warning: saving an emergency checkpoint at step (\d+)", out)
    assert len(said) == 1, f"one emergency checkpoint, not {said}"
    n = int(said[0])
    recs = records(trace)[warned_at:]
    first_small = next(i for i, r in enumerate(recs) if r["world"] == 1)
    assert max(r["step"] for r in recs[:first_small]) == n, "no step trained past the save on the warned group"
    assert recs[first_small]["step"] == n + 1, f"resumed at {recs[first_small]['step']}, saved at {n}"
    assert n % 100, "the save was the emergency one, not a periodic checkpoint"
    return n


def warned_run(cluster, tmp: Path, capfd, cloud: str, warn: Callable[[MetadataState], None],
               advice: Callable[[MetadataState], None] | None = None, warn_at: int = 20,
               **job: object) -> tuple[str, int]:
    """The job on two nodes; `advice` (a notice that announces no interruption) after 20 steps, then
    `warn` (the cloud's interruption notice) after `warn_at` on the first node's metadata service; that
    node goes once the job trains at 1 worker, and capacity returns. Returns the watcher's log and the
    emergency checkpoint's step. `job`: more of warned_job's spec."""
    a, _b = add_worker_node(cluster), add_worker_node(cluster)
    spec, hold, trace = warned_job(tmp, f"noticed-{cloud}", **job)
    with metadata_server(cloud) as md:
        watcher = start_in_session(
            [sys.executable, "-m", "tidal", "cluster", "watch-notices", "--cloud", cloud, "--endpoint", md.url,
             "--poll-s", "0.5", "--address", cluster.gcs_address, "--node-id", a.node_id], tmp / "watcher.log",
            env=node_env())
        try:
            t, out = run_in_background(spec)
            wait_for("20 steps at 2 workers",
                     lambda: any(r["step"] >= 20 and r["world"] == 2 for r in records(trace)), timeout=300)
            if advice is not None:  # said by the watcher, and nothing drained: the group trains on at 2
                advice(md)
                wait_for("the watcher to read the advice", lambda: "advice" in (tmp / "watcher.log").read_text(),
                         timeout=30)
                reached = records(trace)[-1]["step"]
                wait_for("10 more steps", lambda: records(trace)[-1]["step"] >= reached + 10, timeout=120)
                assert {r["world"] for r in records(trace)} == {2}, "advice drains nothing"
            if warn_at > 20:
                wait_for(f"step {warn_at}", lambda: records(trace)[-1]["step"] >= warn_at, timeout=300)
            warned_at = len(records(trace))
            warn(md)
            wait_for("the group at 1 worker", lambda: shrank_since(trace, warned_at), timeout=180,
                     context=lambda: (tmp / "watcher.log").read_text())
            cluster.remove_node(a)  # the deadline passed: the cloud takes the instance
            add_worker_node(cluster)  # capacity returns
            wait_for("the group back at 2", lambda: records(trace)[-1]["world"] == 2, timeout=240)
            hold.unlink()
            finished(t, out)
        finally:
            stop_session(watcher, grace_s=5)
    log = (tmp / "watcher.log").read_text()
    assert "drained this Ray node" in log and log.count("drained this Ray node") == 1, log
    n = assert_saved_at_the_step_reached_and_resumed_there(capfd.readouterr().out, trace, warned_at)
    loss = metric_history(spec, out["result"].mlflow_run_id, "loss")
    assert sorted(loss) == list(range(1, 301)), "every step done, each logged once"
    sizes = [r["world"] for r in records(trace)]
    assert [s for i, s in enumerate(sizes) if i == 0 or s != sizes[i - 1]][-3:] == [2, 1, 2], sizes
    assert n >= warn_at
    return log, n


def test_aws_spot_notice_saves_at_the_step_reached_then_the_job_shrinks_and_grows_back(cluster, tmp_path, capfd):
    """A rebalance recommendation first (advice: no drain), then the spot interruption notice: one
    emergency checkpoint, at the step the interruption found."""
    log, _ = warned_run(cluster, tmp_path, capfd, "aws", lambda md: md.aws_interrupt(in_s=DEADLINE_S),
                        MetadataState.aws_rebalance)
    assert log.count("aws rebalance recommendation: advice") == 1, log


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): the order of saves is unit-tested (test_warnings)
def test_a_notice_during_a_periodic_save_lets_it_finish_then_saves_at_the_step_reached(cluster, tmp_path, capfd):
    """The spot notice arrives while step 100's periodic checkpoint is still being written in the
    background (its write held 6 s, as a slow store holds it): that save completes (it stays a resume
    point, not a partial folder) and the emergency one follows at the step reached, inside the notice's
    12 s; the job resumes there at 1 worker, nothing lost, nothing twice."""
    _, n = warned_run(cluster, tmp_path, capfd, "aws", lambda md: md.aws_interrupt(in_s=DEADLINE_S), warn_at=100,
                      env={WRITE_DELAY_ENV: "6:100"})  # tiny_spec keeps 10 checkpoints: step 100 stays
    assert n > 100, "the emergency save came after the periodic one it found being written"
    run = RunDir(str(tmp_path / "runs"), "noticed-aws")
    for step in (100, n):
        assert check_complete(run.fs, f"{run.path}/{checkpoint_dir_name(step)}")[0] is None, step


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): the AWS test above runs the same path
@pytest.mark.parametrize("cloud", ["gcp", "azure"])
def test_gce_and_azure_notices_save_at_the_step_reached_then_the_job_shrinks_and_grows_back(cluster, tmp_path, capfd,
                                                                                          cloud):
    warn = {"gcp": MetadataState.gce_preempt, "azure": lambda md: md.azure_preempt(in_s=DEADLINE_S)}[cloud]
    log, _ = warned_run(cluster, tmp_path, capfd, cloud, warn)
    assert {"gcp": "gce preempted", "azure": "azure Preempt"}[cloud] in log, log


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): the same drain as the test above, from the pod's command (its form: tests/test_prestop.py)
def test_kubernetes_prestop_run_as_the_pod_runs_it_saves_at_the_step_reached(cluster, tmp_path, capfd):
    """The first worker group's preStop from cluster_configs/kuberay/raycluster.yaml, run as the
    kubelet runs it (exec, the container's environment: KubeRay's RAY_ADDRESS and MY_POD_IP, token
    auth) on the raylet of a simulated pod at its own address; only its deadline is shortened (105 s
    there). Kubernetes then stops the pod: the raylet goes."""
    pod = cluster.add_node(num_cpus=1, node_ip_address=POD_IP)
    add_worker_node(cluster)
    spec, hold, trace = warned_job(tmp_path, "evicted")
    command = prestop_command()
    command[command.index("--deadline-s") + 1] = str(DEADLINE_S)
    env = {**node_env(), "RAY_ADDRESS": cluster.gcs_address, "MY_POD_IP": POD_IP}
    t, out = run_in_background(spec)
    wait_for("20 steps at 2 workers",
             lambda: any(r["step"] >= 20 and r["world"] == 2 for r in records(trace)), timeout=300)
    warned_at = len(records(trace))
    stop = subprocess.run(command, env=env, capture_output=True, text=True, timeout=DEADLINE_S + 60)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert f"drained node {pod.node_id}" in stop.stdout, stop.stdout
    cluster.remove_node(pod)  # the preStop returned: Kubernetes stops the pod
    wait_for("the group at 1 worker", lambda: shrank_since(trace, warned_at), timeout=180)
    add_worker_node(cluster)  # the pod's replacement
    wait_for("the group back at 2", lambda: records(trace)[-1]["world"] == 2, timeout=240)
    hold.unlink()
    finished(t, out)
    assert_saved_at_the_step_reached_and_resumed_there(capfd.readouterr().out, trace, warned_at)
    assert sorted(metric_history(spec, out["result"].mlflow_run_id, "loss")) == list(range(1, 301))
