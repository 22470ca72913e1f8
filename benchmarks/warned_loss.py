"""Steps lost per preemption: warned (a cloud's notice read by `tidal cluster watch-notices`, a
Kubernetes pod's preStop `tidal cluster drain-node`) against a node lost without warning.

    python -m benchmarks.warned_loss [--rounds 4] [--deadline-s 10]    # writes a section of docs/benchmarks.md

One elastic job (1-2 workers, tiny GPT, ZeRO-2, a checkpoint every 20 steps, no step throttle) on a
local multi-node cluster (`ray.cluster_utils.Cluster`: a head and two 1-CPU worker nodes). Each round
takes a worker node away three ways, in turn, and lets the job grow back on a fresh node after each:
- notice: the node's metadata service (AWS IMDSv2, served on 127.0.0.1 by tidal.testing.metadata)
  announces a spot interruption `--deadline-s` ahead; the watcher (the code the CLI runs, in a
  thread) drains the node; the node is removed once the group has restarted without it;
- prestop: `drain_and_wait`, what the pod's preStop runs, with the same deadline; the node is removed
  when it returns, as the kubelet then stops the pod;
- unwarned: the node is removed at once (a node loss).
Each event comes a seeded random number of steps into a checkpoint interval, at least one interval
after the group grew back. Steps lost per event, from the loss trace of every life of the job: the last
step trained before the group shrank less the step it resumed from. Also the seconds from the event to the first step at the
smaller size (a warned group trains no further from its save until the deadline: that wait, not a
replay, is what a warning costs).
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")  # see benchmarks/node_loss.py

import argparse
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import tidal
from benchmarks.common import read_trace, update_doc
from tidal.cluster.notice_watch import run_watcher
from tidal.cluster.self_drain import drain_and_wait
from tidal.spec.job import JobSpec
from tidal.testing.clusters import add_worker_node, raylet_cluster
from tidal.testing.metadata import metadata_server
from tidal.testing.processes import wait_for

SECTION = "Warned preemption: steps lost with a cloud notice or a pod's preStop, against a node lost without warning"
KINDS = ("notice", "prestop", "unwarned")
EVERY = 20


def spec_for(tmp: Path) -> JobSpec:
    return JobSpec(
        name="warned",
        model={"n_layer": 2, "n_head": 2, "d_model": 64, "vocab_size": 64, "seq_len": 16},
        train={"steps": 1_000_000, "micro_batch": 4, "global_batch": 16, "lr": 1e-2, "log_every": 1},
        scaling={"min_workers": 1, "max_workers": 2, "elastic_check_s": 2},
        checkpoint={"every_steps": EVERY, "keep": 2, "storage": str(tmp / "runs")},
        tracking={"uri": f"sqlite:///{tmp}/mlflow.db", "experiment": "bench"},
        # Every unwarned loss is a failure restart: 4 rounds of them must not end the job.
        failure={"max_restarts": -1},
        worker_env={"TIDAL_LOSS_TRACE": str(tmp / "loss.trace")},
    )


def event_step(records: list[dict[str, Any]], phase: int) -> int:
    """The step at which the next event comes: `phase` steps into a checkpoint interval, at least one
    whole interval after the last step trained (a group that just grew back resumed from a fresh
    checkpoint: an event at once would lose nothing, warned or not)."""
    start = max(r["step"] for r in records) + EVERY
    return (start // EVERY + 1) * EVERY + phase


def lost_at(records: list[dict[str, Any]], since: float) -> tuple[int, float]:
    """(steps lost, seconds to the first step at size 1) for the shrink after time `since`."""
    i = next(i for i, r in enumerate(records) if r["ts"] > since and r["world"] == 1)
    before = [r["step"] for r in records[:i] if r["world"] == 2]
    return max(before) - (records[i]["step"] - 1), records[i]["ts"] - since


def event(kind: str, cluster: Any, node: Any, trace: Path, deadline_s: float) -> None:
    """Take `node` away as `kind` does; return once the job trains at size 1 and the node is gone."""
    smaller = lambda: any(r["world"] == 1 and r["ts"] > t0 for r in read_trace(trace))  # noqa: E731
    say = lambda line: print(f"  [{kind}] {line}", flush=True)  # noqa: E731
    t0 = time.time()
    if kind == "unwarned":
        cluster.remove_node(node)
        wait_for("the group at 1 worker", smaller, timeout=300)
        return
    if kind == "prestop":
        drain_and_wait(cluster.gcs_address, node.node_id, deadline_s, "benchmark: the pod is stopping", say)
        cluster.remove_node(node)  # the preStop returned: the kubelet stops the pod
        wait_for("the group at 1 worker", smaller, timeout=300)
        return
    with metadata_server("aws") as md:
        stop = threading.Event()
        watcher = threading.Thread(target=run_watcher, args=(cluster.gcs_address, node.node_id, "aws", md.url,
                                                             0.5, say, stop), daemon=True)
        watcher.start()
        md.aws_interrupt(in_s=deadline_s)
        wait_for("the group at 1 worker", smaller, timeout=300)
        stop.set()
        watcher.join(10)
    cluster.remove_node(node)  # past the deadline: the cloud takes the instance


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--deadline-s", type=float, default=10.0)
    args = ap.parse_args()
    results: dict[str, list[tuple[int, float]]] = {k: [] for k in KINDS}
    rng = random.Random(0)  # where in the checkpoint interval each event lands: the same draws for every path
    with raylet_cluster(workers=2) as cluster, tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        spec = spec_for(tmp)
        trace = tmp / "loss.trace"
        threading.Thread(target=tidal.run, args=(spec,), daemon=True).start()
        wait_for("40 steps at 2 workers", lambda: any(r["world"] == 2 and r["step"] >= 40 for r in read_trace(trace)),
                 timeout=600)
        for rnd in range(args.rounds):
            kinds = KINDS if rnd % 2 == 0 else tuple(reversed(KINDS))  # alternate the order
            for kind in kinds:
                at = event_step(read_trace(trace), rng.randrange(EVERY))
                wait_for(f"step {at} at 2 workers", lambda at=at: any(r["world"] == 2 and r["step"] >= at
                                                                      for r in read_trace(trace)), timeout=600)
                node = next(n for n in cluster.worker_nodes)
                t0 = time.time()
                event(kind, cluster, node, trace, args.deadline_s)
                lost, seconds = lost_at(read_trace(trace), t0)
                results[kind].append((lost, seconds))
                print(f"round {rnd + 1} {kind}: {lost} step(s) lost, {seconds:.1f} s to the first step at 1 worker",
                      flush=True)
                add_worker_node(cluster)
                back = time.time()
                wait_for("the group back at 2", lambda back=back: any(r["world"] == 2 and r["ts"] > back
                                                                      for r in read_trace(trace)), timeout=300)
            write_doc(results, args.rounds, args.deadline_s)
    print(write_doc(results, args.rounds, args.deadline_s))


def write_doc(results: dict[str, list[tuple[int, float]]], rounds: int, deadline_s: float) -> str:
    """The section of docs/benchmarks.md for the rounds done so far (written after each round: a
    run stopped early keeps what it measured)."""
    done = min(len(v) for v in results.values())
    rows = "\n".join(
        f"| {kind} | {', '.join(str(n) for n, _ in results[kind])} | {statistics.mean(n for n, _ in results[kind]):.1f} | "
        f"{', '.join(f'{s:.0f}' for _, s in results[kind])} |" for kind in KINDS)
    body = f"""Command: `python -m benchmarks.warned_loss --rounds {rounds} --deadline-s {deadline_s:g}` ({time.strftime('%Y-%m-%d')}, 2-core CPU machine shared with other jobs: the seconds are loose, the steps are not)

One elastic job (1-2 workers, tiny GPT, ZeRO-2, a checkpoint every {EVERY} steps)
on a head and two 1-CPU simulated nodes; each round takes a worker node away three ways, in alternating
order, each a seeded random number of steps into a checkpoint interval, and the job grows back on a
fresh node after each. notice: an AWS spot interruption in the node's
metadata service (served on 127.0.0.1), {deadline_s:g} s ahead, read by the notice watcher, which drains the
node; prestop: what a KubeRay worker pod's preStop runs (`tidal cluster drain-node`), the same deadline;
unwarned: the node removed at once.

| path | steps lost, per round | mean | seconds to the first step at 1 worker, per round |
|---|---|---|---|
{rows}

Goal: at most 1 step lost per warned preemption. A warned group saves at the step reached and then trains
no further until Ray restarts it at the deadline, so its seconds include the rest of the deadline; an unwarned
group replays the steps since its last periodic checkpoint (up to {EVERY - 1} here) and its seconds are Ray's restart.
"""
    if done < rounds:
        body += f"\nStopped after {done} of {rounds} rounds.\n"
    update_doc(SECTION, body)
    return body


if __name__ == "__main__":
    main()
