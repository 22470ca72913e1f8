"""Time from losing a node to training again at the smaller world size (elastic 1-2 workers),
and from the node's return to training again at the full size, on a local multi-node cluster
(`ray.cluster_utils.Cluster`, one raylet per simulated node), with Ray's default timeouts unless
they are set in the environment.

    python -m benchmarks.node_loss [--repeats 3]     # adds two sections to docs/benchmarks.md
"""

from __future__ import annotations

import os

# Each round leaves its job's thread running when it tears its cluster down; the thread's next
# Ray call must fail, not auto-connect a new driver that blocks `Cluster.shutdown` (it did). Ray
# reads the switch when it is imported.
os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

from mlflow.tracking import MlflowClient

import tidal
from benchmarks.common import update_doc
from tidal.spec.job import JobSpec
from tidal.testing.clusters import raylet_cluster
from tidal.testing.processes import wait_for

ELASTIC_CHECK_S = 10.0  # how often the job looks for room to grow (the spec's default is 60 s)


def measure(name: str) -> tuple[float, float]:
    """One node loss and return on a fresh local cluster: seconds from the removal to the first
    step at size 1, and from the returned node's registration to the first step at size 2."""
    with raylet_cluster(workers=2) as cluster:
        nodes = [n for n in cluster.list_all_nodes() if not n.head]
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            spec = JobSpec(
                name=name,
                model={"n_layer": 2, "n_head": 2, "d_model": 64, "vocab_size": 64, "seq_len": 16},
                train={"steps": 3000, "micro_batch": 4, "global_batch": 64, "lr": 1e-2, "log_every": 1},
                scaling={"min_workers": 1, "max_workers": 2, "elastic_check_s": ELASTIC_CHECK_S},
                checkpoint={"every_steps": 20, "storage": str(tmp / "runs")},
                tracking={"uri": f"sqlite:///{tmp}/mlflow.db", "experiment": "bench"},
            )
            threading.Thread(target=tidal.run, args=(spec,), daemon=True).start()
            client = MlflowClient(spec.tracking.uri)
            run_id = _wait_run(client)
            wait_for("30 steps at the full size", lambda: _last(client, run_id, "world_size") is not None
                     and _last(client, run_id, "loss")[0] >= 30, 300, every=0.3)
            t_loss = time.time()
            cluster.remove_node(nodes[1])
            shrink = wait_for("a step at 1 worker", lambda: _first_at_size(client, run_id, 1, t_loss), 600, every=0.3) - t_loss
            cluster.add_node(num_cpus=1)  # returns once the node is registered
            t_back = time.time()
            grow = wait_for("a step at 2 workers", lambda: _first_at_size(client, run_id, 2, t_back), 600, every=0.3) - t_back
    return shrink, grow


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    times, grows = [], []
    for i in range(args.repeats):
        shrink, grow = measure(f"node-loss-{i}")
        times.append(shrink)
        grows.append(grow)
        print(f"round {i + 1}: {shrink:.1f} s from the node's removal to the first step at world size 1, "
              f"{grow:.1f} s from its return to the first step at world size 2", flush=True)
    seconds = statistics.median(times)
    timeout = os.environ.get("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "5, Tidal's default for an elastic job (tidal/launch/recovery.py)")
    body = f"""Command: `python -m benchmarks.node_loss --repeats {args.repeats}` ({time.strftime('%Y-%m-%d')}, 2-core CPU machine)

An elastic job (1-2 workers, tiny GPT, ZeRO-2, checkpoint every 20 steps) on two simulated 1-CPU nodes; one node
is removed mid-run, on a fresh cluster each round. Time from the removal to the first new step logged at world
size 1, per round: {", ".join(f"{t:.1f} s" for t in times)}; median **{seconds:.1f} s** (goal <= 20 s)
(`RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S` = {timeout}).

Train V2 sizes the new group from Ray's autoscaling coordinator, which looks at the cluster's nodes every
20 s; at the failure Tidal has it look again at once (`ClusterView`, tidal/launch/callbacks.py), so the group
restarts at the size that fits instead of retrying the old size until a start timeout (5 s for an elastic job,
tidal/launch/recovery.py; Ray's default is 60 s) ends each try. What is left: the workers' start, the checkpoint's
universal conversion (a subprocess, about 3 s here) and the reload.
"""
    update_doc("Node loss: time to train again at the smaller size", body)
    print(body)
    regrow = f"""Command: `python -m benchmarks.node_loss --repeats {args.repeats}` ({time.strftime('%Y-%m-%d')}, 2-core CPU machine; the same rounds)

After the node loss above, a node joins again (`Cluster.add_node`, timed from its registration) and the job,
with `scaling.elastic_check_s: {ELASTIC_CHECK_S:g}`, grows back. Time to the first step logged at world size 2, per round:
{", ".join(f"{t:.1f} s" for t in grows)}; median **{statistics.median(grows):.1f} s** (no goal in the issue).

Growing is Ray Train's elastic resize: while the group is healthy its controller checks every
`elastic_check_s` whether the autoscaling coordinator has room for more workers, and if so restarts the
group at the larger size from the newest checkpoint (the steps since it are replayed: at most one checkpoint
interval). The coordinator itself looks at the cluster's nodes only every 20 s.
"""
    update_doc("Regrowth: time to train again at the full size after a node returns", regrow)
    print(regrow)


def _wait_run(client: MlflowClient, timeout: float = 300) -> str:
    def run_id() -> str | None:
        exp = client.get_experiment_by_name("bench")
        runs = client.search_runs([exp.experiment_id]) if exp else []
        return runs[0].info.run_id if runs else None

    return wait_for("the job's MLflow run", run_id, timeout, every=0.5)


def _last(client: MlflowClient, run_id: str, key: str) -> tuple[int, float] | None:
    hist = client.get_metric_history(run_id, key)
    if not hist:
        return None
    m = max(hist, key=lambda m: m.step)
    return m.step, m.value


def _first_at_size(client: MlflowClient, run_id: str, size: int, after: float) -> float | None:
    times = [m.timestamp / 1000 for m in client.get_metric_history(run_id, "world_size")
             if m.value == size and m.timestamp / 1000 > after]
    return min(times) if times else None




if __name__ == "__main__":
    main()
