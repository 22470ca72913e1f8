"""The memory tier against persistent checkpoints alone: a worker SIGKILLed between two persistent
checkpoints, the same job with `checkpoint.memory` on and off, in alternating pairs. Measures steps
replayed (the step reached at the kill less the step resumed from), seconds from the kill to the
first step trained again (restart + restore), and to the first step past the one reached (the
replay too), from rank 0's loss trace of every life of the job; and whether the restart read a
checkpoint file from storage (the node's restore cache).

    python -m benchmarks.memory_tier [--pairs 4] [--kill-at 90] [--every 50] [--memory-every 5]
    python -m benchmarks.memory_tier --stall-probe [--memory-every 5]   # one run: a snapshot's stall and
        # the next step's time against the other steps' (prints; the reading goes in docs/benchmarks.md by hand)
    python -m benchmarks.memory_tier --stall-floor [--memory-every 5] [--large] [--zero 3]   # training blocked
        # per snapshot against one memory copy of the same state (rank 0's share) into a reused buffer, measured in
        # the same invocation (--large: a ~1.5 GB state; --zero: the ZeRO stage, 2 unless said)
    python -m benchmarks.memory_tier --stall-pairs --memory-every auto [--pairs 4] [--steps 110] [--every 50]
        # what the interval the tier chooses costs the quickstart-shaped job (its persistent checkpoints every
        # --every steps in both kinds, the bound of the chosen interval), against the tier off
    python -m benchmarks.memory_tier --stall-pairs [--pairs 4] [--memory-every 10] [--large]   # what the tier
        # costs training: the same job with snapshots and without, no fault, in alternating pairs (--large:
        # the node-loss rounds' ~1.5 GB state on two raylets, each snapshot copied to the peer's keeper too)
    python -m benchmarks.memory_tier --rollback [--pairs 4] [--rollback-mib 512]   # a survivor's read of its
        # shard at a rollback (failure.replace_in_place): from the slot it wrote and still maps, against through
        # its node's keeper as a new process reads it, alternating, one process and one keeper
    python -m benchmarks.memory_tier --node-loss [--pairs 4] [--kill-at 17] [--every 10] [--memory-every 3]
        # a node lost at a ~1.5 GB state (GPT d1024, 8 layers): the group resumes at one worker from the
        # peer's copy in memory, or from storage (one raylet per simulated node)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import ray

import tidal
from benchmarks.common import paired_rounds, read_trace, update_doc
from tidal.spec.job import JobSpec
from tidal.testing.processes import kill, our_processes, wait_for
from tidal.testing.runs import prepared_store
from tidal.worker.checkpoint import fetch
from tidal.worker.metrics import LOSS_TRACE_ENV

KINDS = ("memory", "storage")
# Each simulated node's object store at the ~1.5 GB state: a rank's shard (~0.77 GB) handed over, a peer's
# copy pulled in, a restore's shards fetched. Ray's test clusters give 150 MiB (a real node: 30% of its
# memory); past it Ray allocates objects on disk, which the invocations before 2026-12-06 15:30 measured.
NODE_STORE_BYTES = 3 * 2**30
# resize_cost's ~1.5 GB state (GPT d1024, 8 layers, ZeRO-2: fp32 weights, Adam's moments): --node-loss, --large
LARGE_MODEL = {"n_layer": 8, "n_head": 16, "d_model": 1024, "vocab_size": 256, "seq_len": 64}
LARGE_TRAIN = {"micro_batch": 2, "global_batch": 4, "lr": 1e-4, "warmup_steps": 1, "log_every": 1}


def spec_for(tmp: Path, kind: str, i: int, args: argparse.Namespace) -> JobSpec:
    large = args.large
    spec = JobSpec(
        name=f"memtier-{kind}-{i}",
        model=LARGE_MODEL if large else {"n_layer": 4, "n_head": 4, "d_model": 256, "vocab_size": 256, "seq_len": 64},
        train={"steps": args.steps, **(LARGE_TRAIN if large else {"micro_batch": 8, "global_batch": 32, "lr": 3e-4,
                                                                  "warmup_steps": 10, "log_every": 1})},
        parallelism={"zero_stage": args.zero},
        scaling={"min_workers": 2, "max_workers": 2},
        checkpoint={"every_steps": args.every, "keep": 2, "storage": str(tmp / "runs")},
        failure={"max_restarts": 3},
        tracking={"uri": prepared_store(tmp / "mlflow.db"), "experiment": "bench"},
        worker_env={LOSS_TRACE_ENV: str(tmp / "trace.jsonl"), fetch.CACHE_ENV: str(tmp / "cache")},
    )
    # The storage side turns the tier off: it is on by default.
    return spec.with_overrides({"checkpoint.memory.every_steps": args.memory_every} if kind == "memory" else
                               {"checkpoint.memory": None})


def measure(args: argparse.Namespace, i: int, kind: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        spec = spec_for(tmp, kind, i, args)
        trace = tmp / "trace.jsonl"
        killed: dict[str, float] = {}

        def killer() -> None:
            wait_for(f"step {args.kill_at}", lambda: any(r["step"] >= args.kill_at for r in read_trace(trace)), 600,
                     every=0.05)
            workers = our_processes("RayTrainWorker")
            killed["t"] = time.time()
            kill(workers[-1])

        t = threading.Thread(target=killer, daemon=True)
        t.start()
        result = tidal.run(spec)
        t.join(10)
        assert result.error is None, result.error
        records = read_trace(trace)
        before = [r for r in records if r["ts"] <= killed["t"]]
        after = [r for r in records if r["ts"] > killed["t"]]
        reached = max(r["step"] for r in before)
        first = after[0]
        past = next(r for r in after if r["step"] > reached)
        steps = sorted({r["step"] for r in records})
        assert steps == list(range(1, args.steps + 1)), "every step trained"
        # Mean, not median: a snapshot's stall falls on one step in `memory_every`.
        first_timed = next(r for r in before if r["step"] == 11)
        last = next(r for r in before if r["step"] == reached)
        step_s = (last["ts"] - first_timed["ts"]) / (reached - 11)
        return {f"{kind}_replayed": reached - (first["step"] - 1),
                f"{kind}_back_s": first["ts"] - killed["t"],
                f"{kind}_past_s": past["ts"] - killed["t"],
                f"{kind}_read_storage": bool(list((tmp / "cache").rglob("*.pt"))),
                f"{kind}_step_s": step_s}


def stall_probe(args: argparse.Namespace) -> dict[str, Any]:
    """One 60-step run with a snapshot every `memory_every` steps and no persistent checkpoint before
    the last: each snapshot's stall (`checkpoint_blocked_max_s` of the step after it) and the time of
    the step after it (the hand-over runs beside it) against the other steps', from MLflow."""
    from mlflow.tracking import MlflowClient

    every = args.memory_every
    with tempfile.TemporaryDirectory() as d:
        args.steps, args.every = 60, 1000
        spec = spec_for(Path(d), "memory", 0, args)
        result = tidal.run(spec)
        client = MlflowClient(spec.tracking.uri)
        blocked = {m.step: m.value for m in client.get_metric_history(result.mlflow_run_id, "checkpoint_blocked_max_s")}
        step_s = {m.step: m.value for m in client.get_metric_history(result.mlflow_run_id, "step_time_s")}
    snaps = range(2 * every, 60 - every + 1, every)  # past the first steps (warm-up, first copy)
    stall = statistics.median(blocked[s + 1] for s in snaps)
    after = statistics.median(step_s[s + 1] for s in snaps)
    plain = statistics.median(step_s[s] for s in range(2 * every + 1, 60) if s % every not in (0, 1))
    return {"stall_s": stall, "step_after_s": after, "plain_step_s": plain,
            "cost": (stall + after - plain) / (every * plain)}


def one_copy_s(nbytes: int, tries: int = 5) -> tuple[float, float]:
    """The floor of a snapshot: one memory copy of `nbytes` into a reused, pre-faulted buffer (the
    fastest of `tries`), on this machine, now: (wall seconds, this thread's CPU seconds)."""
    import numpy as np

    src, dst = np.ones(nbytes, dtype=np.uint8), np.empty(nbytes, dtype=np.uint8)
    np.copyto(dst, src)  # faults every page of the destination in: the floor reuses its buffer
    walls, cpus = [], []
    for _ in range(tries):
        t0, c0 = time.perf_counter(), time.thread_time()
        np.copyto(dst, src)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.thread_time() - c0)
    return min(walls), min(cpus)


def snapshot_costs(name: str, stop: threading.Event, costs: dict[tuple[int, int], tuple[float, float]]) -> None:
    """Collect each rank's cost of each snapshot from the job's keepers' listings while it runs:
    (step, rank) -> (wall, training thread's CPU) seconds, as the rank measured them."""
    from tidal.worker.checkpoint import keeper

    while not stop.wait(0.2):
        try:
            for k in keeper.named(name).values():
                for e in ray.get(k.listing.remote(), timeout=5):
                    if "stall_cpu_s" in e:
                        costs[(int(e["step"]), int(e["rank"]))] = (float(e["stall_s"]), float(e["stall_cpu_s"]))
        except Exception:  # noqa: BLE001 - a keeper starting or ending: the next poll reads it
            continue


def stall_floor(args: argparse.Namespace) -> None:
    """Training blocked per snapshot against one memory copy of the same state, in one invocation: a
    run with a snapshot every `memory_every` steps and no persistent checkpoint before the last (60
    steps; 24 at --large's ~1.5 GB state); each snapshot's stall (`checkpoint_blocked_max_s` of the
    step after it, the slowest rank's) and its training thread's CPU time (the slowest rank's, from
    the keepers' listings), and the copy of rank 0's share of the state (its files in the last
    step's checkpoint) measured right after, every snapshot against it."""
    from mlflow.tracking import MlflowClient

    every, steps = args.memory_every, (24 if args.large else 60)
    costs: dict[tuple[int, int], tuple[float, float]] = {}
    stop = threading.Event()
    with tempfile.TemporaryDirectory() as d:
        args.steps, args.every = steps, 1000
        spec = spec_for(Path(d), "memory", 0, args)
        watcher = threading.Thread(target=snapshot_costs, args=(spec.name, stop, costs), daemon=True)
        watcher.start()
        result = tidal.run(spec)
        stop.set()
        watcher.join(10)
        assert result.error is None, result.error
        client = MlflowClient(spec.tracking.uri)
        blocked = {m.step: m.value for m in client.get_metric_history(result.mlflow_run_id, "checkpoint_blocked_max_s")}
        rank0 = [p for p in Path(d, "runs").rglob(f"global_step{steps}/*.pt")  # ZeRO-2's or ZeRO-3's rank 0 files
                 if p.name == "mp_rank_00_model_states.pt" or p.name.startswith("zero_pp_rank_0_mp_rank_00_")]
        nbytes = sum(p.stat().st_size for p in rank0)
    floor, floor_cpu = one_copy_s(nbytes)
    snaps = [s for s in range(2 * every, steps - every + 1, every)  # past the first snapshots (segments made)
             if (s, 0) in costs and (s, 1) in costs]
    stalls = [blocked[s + 1] for s in snaps]
    cpus = [max(costs[(s, 0)][1], costs[(s, 1)][1]) for s in snaps]
    rows = "\n".join(f"| {s} | {b * 1000:.1f} | {b / floor:.2f} | {c * 1000:.1f} | {c / floor_cpu:.2f} |"
                     for s, b, c in zip(snaps, stalls, cpus, strict=True))
    shape = ("GPT d1024, 8 layers (about 1.5 GB of state)" if args.large else "the quickstart's shape (GPT d256, 4 layers)")
    command = (f"python -m benchmarks.memory_tier --stall-floor --memory-every {every}" + (" --large" if args.large else "")
               + (f" --zero {args.zero}" if args.zero != 2 else ""))
    body = f"""Command: `{command}` \
({time.strftime('%Y-%m-%d')}, 2-core CPU machine shared with other work running at the same time, one local Ray instance)

{shape[0].upper() + shape[1:]}, ZeRO-{args.zero}, 2 workers, {steps} steps, a snapshot every {every} steps:
the time training was blocked by each snapshot (the slowest rank's `checkpoint_blocked_max_s`, read at the step
after it) and the CPU time its training thread spent in it (the slowest rank's, as each rank put it in its
keeper's listing), against the floor measured in the same invocation right after the run: one copy of rank 0's
share of the state ({nbytes / 2**20:.1f} MiB: its files of the step-{steps} checkpoint) into a reused, pre-faulted
buffer, the fastest of 5: **{floor * 1000:.2f} ms** wall, {floor_cpu * 1000:.2f} ms CPU. On a machine whose other
work takes the cores, wall time holds the waits for a core; CPU time does not.

| snapshot at step | training blocked (ms) | against one copy | training thread's CPU (ms) | against one copy's CPU |
|---|---|---|---|---|
{rows}

Median: **{statistics.median(stalls) / floor:.2f}x** one copy in wall time, **{statistics.median(cpus) / floor_cpu:.2f}x**
in CPU time (goal: at most 1.5x). What the stall holds: DeepSpeed's own calls that build the state dicts of its
files (no collective, no file), the layout record (the structure pickled without its tensors), and the one
copy of every tensor straight into the rank's slot, a shared-memory segment its node's keeper owns. The
ranks' agreement on the previous snapshot, the commit to the keeper and the peer's copy run off the training
thread.
"""
    print(body)
    if not args.no_doc:
        title = "Memory tier: training blocked per snapshot against one memory copy"
        update_doc(title + (", at a 1.5 GB state" if args.large else "") + (f", ZeRO-{args.zero}" if args.zero != 2 else ""),
                   body)


def rollback_pairs(args: argparse.Namespace) -> None:
    """A survivor's read of its shard (`memory._states`, what its rollback's load is served) from its own
    slot, against through its node's keeper (`where`, the segment mapped again), alternating; both copy
    every tensor out. One rank (a one-process gloo group) holding `rollback_mib` MiB in 64 tensors."""
    import socket

    import torch
    import torch.distributed as dist

    from tidal.worker.checkpoint import flat_state, keeper, memory
    from tidal.worker.checkpoint.memory import Pending

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    with tempfile.TemporaryDirectory() as d:
        spec = spec_for(Path(d), "memory", 0, args).resolved()
        tier = memory.Tier(spec, 0, 1)
        n = args.rollback_mib * 2**20 // 4 // 64
        files = {"mp_rank_00_model_states.pt": {"module": {f"w{i}": torch.rand(n) for i in range(32)}},
                 "zero_pp_rank_0_mp_rank_00_optim_states.pt": {"state": {i: torch.rand(n) for i in range(32)}}}
        planned = flat_state.plan(files)
        pending = Pending(3)
        assert tier._write(pending, planned) is None
        facts = {"world_size": 1, "zero_stage": 2, "fingerprint": spec.fingerprint_hash(), "node": tier.node,
                 "state": {"step": 3, "world_size": 1, "zero_stage": 2, "attempt": tier.attempt}}
        assert ray.get(tier.own.commit.remote(tier.attempt, 3, 0, pending.slot, facts, planned.record)) is None
        _, plan = memory.newest_complete(spec)
        own = dict(memory._own)

        def read(_: int, kind: str) -> float:
            memory._own.clear()
            memory._own.update(own if kind == "own" else {})
            t0 = time.perf_counter()
            memory._states(plan, list(files))
            took = time.perf_counter() - t0
            assert memory.restored_from() == ("its own copy" if kind == "own" else "this node's keeper")
            return took

        rounds = paired_rounds(args.pairs, ("own", "keeper"), read, lambda r: {"ratio": r["own"] / r["keeper"]},
                               lambda i, r: f"pair {i + 1}: own copy {r['own'] * 1000:.1f} ms, through the keeper "
                                            f"{r['keeper'] * 1000:.1f} ms ({r['ratio']:.2f})")
        keeper.remove(keeper.Owner.of(spec, 0))
    dist.destroy_process_group()
    rows = "\n".join(f"| {i + 1} | {r['own'] * 1000:.1f} | {r['keeper'] * 1000:.1f} | {r['ratio']:.2f} |"
                     for i, r in enumerate(rounds))
    median = statistics.median(r["ratio"] for r in rounds)
    body = f"""Command: `python -m benchmarks.memory_tier --rollback --pairs {args.pairs} --rollback-mib {args.rollback_mib}` \
({time.strftime('%Y-%m-%d')}, 2-core CPU machine shared with other work running at the same time, one local Ray instance)

A surviving rank's read of its shard at a rollback in place (failure.replace_in_place): {args.rollback_mib} MiB in 64
tensors, from the slot it wrote and still maps in its own process, against through its node's keeper (the
keeper asked where the shard is, the segment mapped again) as a replacement process reads it; alternating,
each pair in turn. Both copy every tensor out (a later snapshot reuses the slot).

| pair | own copy (ms) | through the keeper (ms) | own / keeper |
|---|---|---|---|
{rows}

Median own / keeper: **{median:.2f}**.
"""
    print(body)
    if not args.no_doc:
        update_doc("Memory tier: a survivor's rollback from its own copy", body)


def first_timed(args: argparse.Namespace) -> int:
    """The first step a throughput round times: past the first snapshots' warm-up (fewer steps at 1.5 GB)."""
    return 6 if args.large else 21


def throughput(args: argparse.Namespace, i: int, kind: str) -> dict[str, Any]:
    """Seconds a step, from rank 0's loss trace between step `first_timed` (21; 6 with --large) and the last
    (past the first snapshots' warm-up and the first copy to the peer), of a run with no fault and no
    persistent checkpoint before its end: a snapshot's stall and the slowdown of the steps beside its
    hand-over are inside the wall-clock steps, whatever part of the step they fall in."""
    first = first_timed(args) - 1
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        spec = spec_for(tmp, kind, i, args)
        result = tidal.run(spec)
        assert result.error is None, result.error
        ts = {r["step"]: r["ts"] for r in read_trace(tmp / "trace.jsonl")}
    return {f"{kind}_step_s": (ts[args.steps] - ts[first]) / (args.steps - first)}


def stall_pairs(args: argparse.Namespace) -> None:
    auto = args.memory_every == "auto"
    if not auto:  # auto keeps the job's checkpoint interval: it bounds the interval the tier chooses
        args.every = 10 * args.steps  # no persistent checkpoint until the end, in both kinds
    rounds = paired_rounds(
        args.pairs, KINDS, lambda i, kind: throughput(args, i, kind),
        lambda r: {"ratio": r["storage_step_s"] / r["memory_step_s"]},
        lambda i, r: (f"pair {i + 1}: memory {r['memory_step_s'] * 1000:.1f} ms/step, without "
                      f"{r['storage_step_s'] * 1000:.1f} ms/step: throughput with / without {r['ratio']:.3f}"))
    rows = "\n".join(f"| {i + 1} | {r['memory_step_s'] * 1000:.1f} | {r['storage_step_s'] * 1000:.1f} | {r['ratio']:.3f} |"
                     for i, r in enumerate(rounds))
    ratio = statistics.median(r["ratio"] for r in rounds)
    where, job = ((f"a Ray cluster of two 1-CPU raylets with a {NODE_STORE_BYTES / 2**30:.0f} GiB object store each, so "
                   "each snapshot is also copied to the peer's keeper", "GPT d1024, 8 layers: about 1.5 GB of state")
                  if args.large else ("one local Ray instance", "GPT d256, 4 layers"))
    first = first_timed(args)
    if auto:
        auto_pairs_doc(args, rows, ratio, first, where)
        return
    body = f"""Command: `python -m benchmarks.memory_tier --stall-pairs --pairs {args.pairs} --steps {args.steps} \
--memory-every {args.memory_every}{' --large' if args.large else ''}` ({time.strftime('%Y-%m-%d')}, 2-core CPU machine, {where})

The same job as the {'node-loss rounds' if args.large else 'worker-kill rounds'} ({job}, ZeRO-2, 2 workers, {args.steps} steps, no fault, no
persistent checkpoint before the end) with `checkpoint.memory: {{every_steps: {args.memory_every}}}` and without,
alternating, which goes first alternating too. Seconds a step from rank 0's loss trace, steps {first} to {args.steps}:
wall clock, so a snapshot's stall and the slowdown beside its hand-over to the node's keeper and the copy to the
peer are inside it.

| pair | with snapshots (ms/step) | without (ms/step) | throughput with / without |
|---|---|---|---|
{rows}

Median throughput with / without: **{ratio:.3f}** (goal: at least 0.98, a cost under 2%).
"""
    print(body)
    if not args.no_doc:
        update_doc("Memory tier: what snapshots cost training" + (", at a 1.5 GB state" if args.large else ""), body)


def auto_pairs_doc(args: argparse.Namespace, rows: str, ratio: float, first: int, where: str) -> None:
    body = f"""Command: `python -m benchmarks.memory_tier --stall-pairs --memory-every auto --pairs {args.pairs} \
--steps {args.steps} --every {args.every}` ({time.strftime('%Y-%m-%d')}, 2-core CPU machine shared with other work \
running at the same time, {where})

The quickstart's shape (GPT d256, 4 layers, ZeRO-2, 2 workers, {args.steps} steps, persistent checkpoints every
{args.every} steps, no fault) with `checkpoint.memory: {{}}` (every_steps auto: snapshots at the group's first two
steps, then at the Young/Daly interval for the measured cost, at most {args.every} steps) and with the tier off,
alternating, which goes first alternating too. Seconds a step from rank 0's loss trace, steps {first} to {args.steps}.

| pair | tier on, interval chosen (ms/step) | tier off (ms/step) | throughput on / off |
|---|---|---|---|
{rows}

Median throughput on / off: **{ratio:.3f}** (goal: at least 0.98).
"""
    print(body)
    if not args.no_doc:
        update_doc("Memory tier: what the interval it chooses costs training", body)


def node_loss_spec(tmp: Path, kind: str, i: int, args: argparse.Namespace) -> JobSpec:
    """The ~1.5 GB state (LARGE_MODEL), elastic 1-2."""
    spec = JobSpec(
        name=f"memnode-{kind}-{i}",
        model=LARGE_MODEL,
        train={"steps": args.steps, **LARGE_TRAIN},
        parallelism={"zero_stage": 2},
        scaling={"min_workers": 1, "max_workers": 2, "elastic_check_s": 2},
        checkpoint={"every_steps": args.every, "keep": 2, "storage": str(tmp / "runs")},
        failure={"max_restarts": 3},
        tracking={"uri": prepared_store(tmp / "mlflow.db"), "experiment": "bench"},
        worker_env={LOSS_TRACE_ENV: str(tmp / "trace.jsonl"), fetch.CACHE_ENV: str(tmp / "cache")},
    )
    # The storage side turns the tier off: it is on by default.
    return spec.with_overrides({"checkpoint.memory.every_steps": args.memory_every} if kind == "memory" else
                               {"checkpoint.memory": None})


def node_loss(cluster: Any, args: argparse.Namespace, i: int, kind: str) -> dict[str, Any]:
    """One run: the node of one of the two workers removed once rank 0 logged step `kill_at`; the seconds
    from the removal to the first step at one worker and to the first past the step reached, the steps
    replayed, whether the restore copied a checkpoint file from storage. The node comes back after the run."""
    from tidal.testing.clusters import add_worker_node
    from tidal.testing.runs import finished, run_in_background

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        spec = node_loss_spec(tmp, kind, i, args)
        trace = tmp / "trace.jsonl"
        t, out = run_in_background(spec)  # the cluster changes here: Ray's add_node must run in the main thread
        wait_for(f"step {args.kill_at}", lambda: not t.is_alive() or any(r["step"] >= args.kill_at
                                                                        for r in read_trace(trace)), 1800, every=0.05)
        if not t.is_alive():
            finished(t, out)  # raises the job's error
        lost_at = time.time()
        cluster.remove_node(next(iter(cluster.worker_nodes)))
        result = finished(t, out, timeout=1800)
        assert result.error is None, result.error
        records = read_trace(trace)
        before = [r for r in records if r["ts"] <= lost_at]
        after = [r for r in records if r["ts"] > lost_at and r["world"] == 1]
        reached = max(r["step"] for r in before)
        past = next(r for r in after if r["step"] > reached)
        assert sorted({r["step"] for r in records}) == list(range(1, args.steps + 1)), "every step trained"
        read_storage = bool(list((tmp / "cache").rglob("*.pt")))
    add_worker_node(cluster, object_store_bytes=NODE_STORE_BYTES)  # for the next run
    return {f"{kind}_replayed": reached - (after[0]["step"] - 1), f"{kind}_back_s": after[0]["ts"] - lost_at,
            f"{kind}_past_s": past["ts"] - lost_at, f"{kind}_read_storage": read_storage}


def node_loss_pairs(args: argparse.Namespace) -> None:
    from tidal.testing.clusters import raylet_cluster

    with raylet_cluster(workers=2, object_store_bytes=NODE_STORE_BYTES) as cluster:
        rounds = paired_rounds(
            args.pairs, KINDS, lambda i, kind: node_loss(cluster, args, i, kind),
            lambda r: {"saved_s": r["storage_past_s"] - r["memory_past_s"]},
            lambda i, r: (f"pair {i + 1}: memory replayed {r['memory_replayed']}, at one worker after "
                          f"{r['memory_back_s']:.1f} s, past the step reached after {r['memory_past_s']:.1f} s "
                          f"(storage read: {r['memory_read_storage']}); storage replayed {r['storage_replayed']}, "
                          f"{r['storage_back_s']:.1f} s, {r['storage_past_s']:.1f} s"))
    rows = "\n".join(
        f"| {i + 1} | {r['memory_replayed']} / {r['storage_replayed']} | {r['memory_back_s']:.1f} / "
        f"{r['storage_back_s']:.1f} | {r['memory_past_s']:.1f} / {r['storage_past_s']:.1f} | "
        f"{'yes' if r['memory_read_storage'] else 'no'} / {'yes' if r['storage_read_storage'] else 'no'} |"
        for i, r in enumerate(rounds))
    med = {k: statistics.median(r[k] for r in rounds) for k in ("memory_back_s", "storage_back_s", "memory_past_s",
                                                               "storage_past_s")}
    body = f"""Command: `python -m benchmarks.memory_tier --node-loss --pairs {args.pairs} --steps {args.steps} \
--kill-at {args.kill_at} --every {args.every} --memory-every {args.memory_every}` ({time.strftime('%Y-%m-%d')}, 2-core CPU
machine, a Ray cluster of one raylet per simulated node, 1 CPU and a {NODE_STORE_BYTES / 2**30:.0f} GiB object store each, storage
on the local disk)

A {args.steps}-step elastic job (1-2 workers) at about 1.5 GB of state (GPT d1024, 8 layers, ZeRO-2: fp32 weights
and Adam's moments), a persistent checkpoint every {args.every} steps, one worker's node removed once step
{args.kill_at} is logged; with `checkpoint.memory: {{every_steps: {args.memory_every}}}` (memory: the group resumes at one
worker from the copy the surviving node's keeper holds for its lost peer) and without (storage), alternating.

| pair | steps replayed, memory / storage | node lost to training at one worker (s) | to past the step reached (s) | a checkpoint file read from storage |
|---|---|---|---|---|
{rows}

Medians: training at one worker again after **{med['memory_back_s']:.1f} s** from memory, {med['storage_back_s']:.1f} s
from storage; past the step reached after **{med['memory_past_s']:.1f} s** / {med['storage_past_s']:.1f} s.
"""
    print(body)
    if not args.no_doc:
        update_doc("Memory tier: a node lost at a 1.5 GB state", body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=110)
    ap.add_argument("--kill-at", type=int, default=90)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--memory-every", type=lambda v: v if v == "auto" else int(v), default=5,
                    help="steps between snapshots, or auto (the interval the tier chooses)")
    ap.add_argument("--zero", type=int, choices=(2, 3), default=2, help="the jobs' ZeRO stage (--stall-floor)")
    ap.add_argument("--rollback", action="store_true", help="a survivor's read of its shard: own slot / keeper")
    ap.add_argument("--rollback-mib", type=int, default=512)
    ap.add_argument("--no-doc", action="store_true")
    ap.add_argument("--stall-probe", action="store_true")
    ap.add_argument("--stall-pairs", action="store_true", help="throughput with snapshots / without, no fault")
    ap.add_argument("--stall-floor", action="store_true", help="training blocked per snapshot / one memory copy")
    ap.add_argument("--node-loss", action="store_true", help="a node lost at a ~1.5 GB state, memory / storage")
    ap.add_argument("--large", action="store_true",
                    help="with --stall-pairs: a ~1.5 GB state on two raylets (a snapshot copied to the peer too); "
                         "with --stall-floor: that state on one node")
    args = ap.parse_args()
    if args.node_loss:
        node_loss_pairs(args)  # a cluster of raylets of its own
        return
    if args.stall_pairs and args.large:
        from tidal.testing.clusters import raylet_cluster

        with raylet_cluster(workers=2, object_store_bytes=NODE_STORE_BYTES):
            stall_pairs(args)
        return
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    if args.stall_pairs:
        stall_pairs(args)
        ray.shutdown()
        return
    if args.rollback:
        rollback_pairs(args)
        ray.shutdown()
        return
    if args.stall_floor:
        stall_floor(args)
        ray.shutdown()
        return
    if args.stall_probe:
        r = stall_probe(args)
        print(f"a snapshot every {args.memory_every} steps: stall {r['stall_s']:.3f} s, the step after it "
              f"{r['step_after_s']:.3f} s, other steps {r['plain_step_s']:.3f} s: {r['cost']:.1%} of throughput")
        ray.shutdown()
        return
    rounds = paired_rounds(
        args.pairs, KINDS, lambda i, kind: measure(args, i, kind),
        lambda r: {"saved_s": r["storage_past_s"] - r["memory_past_s"],
                   "step_ratio": r["memory_step_s"] / r["storage_step_s"]},
        lambda i, r: (f"pair {i + 1}: memory replayed {r['memory_replayed']} step(s), trained again after "
                      f"{r['memory_back_s']:.1f} s, past the kill's step after {r['memory_past_s']:.1f} s; storage "
                      f"replayed {r['storage_replayed']}, {r['storage_back_s']:.1f} s, {r['storage_past_s']:.1f} s"))
    ray.shutdown()
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0] if not k.endswith("read_storage")}
    rows = "\n".join(
        f"| {i + 1} | {r['memory_replayed']} / {r['storage_replayed']} | {r['memory_back_s']:.1f} / "
        f"{r['storage_back_s']:.1f} | {r['memory_past_s']:.1f} / {r['storage_past_s']:.1f} | "
        f"{'yes' if r['memory_read_storage'] else 'no'} / {'yes' if r['storage_read_storage'] else 'no'} | "
        f"{r['memory_step_s'] * 1000:.0f} / {r['storage_step_s'] * 1000:.0f} |"
        for i, r in enumerate(rounds))
    command = (f"python -m benchmarks.memory_tier --pairs {args.pairs} --kill-at {args.kill_at} --every {args.every} "
               f"--memory-every {args.memory_every}")
    body = f"""Command: `{command}` ({time.strftime('%Y-%m-%d')}, 2-core CPU machine, one local Ray instance)

A {args.steps}-step job (GPT d256, 4 layers, ZeRO-2, 2 workers, a persistent checkpoint every {args.every} steps,
mean step {med['storage_step_s'] * 1000:.0f} ms without the tier) whose worker is SIGKILLed at step {args.kill_at}: with
`checkpoint.memory: {{every_steps: {args.memory_every}}}` (memory) and without (storage), alternating, each pair
in turn. From rank 0's loss trace of every life of the job: steps replayed (the step reached at the kill less
the one resumed from), seconds from the kill to the first step trained again (restart and restore), and to the
first step past the one reached (the replay too); whether a checkpoint file was copied from storage (the
node's restore cache).

| pair | steps replayed, memory / storage | kill to training again, s | kill to past the step reached, s | read storage | mean step before the kill, ms |
|---|---|---|---|---|---|
{rows}

Medians: **{med['memory_replayed']:.0f} / {med['storage_replayed']:.0f}** steps replayed, training again after
{med['memory_back_s']:.1f} / {med['storage_back_s']:.1f} s, past the step reached after
**{med['memory_past_s']:.1f} / {med['storage_past_s']:.1f} s** (memory saves {med['saved_s']:.1f} s a fault here).
Mean step time from step 11 to the kill, memory / storage: {med['step_ratio']:.3f} (median of the pairs'
ratios; a snapshot every {args.memory_every} steps, one persistent checkpoint in both). Read it only on a quiet
machine: rounds whose step times spread more than the tier could cost say nothing of its stall.
"""
    print(body)
    if not args.no_doc:
        update_doc("Memory tier: a worker killed between persistent checkpoints", body)


if __name__ == "__main__":
    main()
