"""How long a checkpoint blocks training through `tidal run` (asynchronous checkpoints), against a
synchronous `torch.save` + fsync of the same bytes, in one invocation, alternating, every pair
reported; and what checkpoints every N steps cost in throughput against none.

    python -m benchmarks.checkpoint_stall --storage local --pairs 4
    python -m benchmarks.checkpoint_stall --storage s3 --pairs 4     # moto's S3 server on 127.0.0.1
    python -m benchmarks.checkpoint_stall --throughput --pairs 4     # every 2 steps, local storage
    python -m benchmarks.checkpoint_stall --throughput --storage s3 --every 5 --pairs 4

Stall: a GPT wide enough that rank 0 holds over 400 MB of checkpoint state (2 workers, ZeRO-2,
fp32, CPU). Blocked time is what each rank-0 save reported as `checkpoint_blocked_s` (the
snapshot, the wait for the previous write if any, and Ray's report) plus what the next step's
optimizer update waited for the write (`checkpoint_gate_s`: on CPU the write reads the live
tensors, so the first update after a save waits for it); the baseline loads rank 0's
files of the run's last checkpoint and saves them again with `torch.save` into a local file +
fsync (local) or an S3 object through pyarrow (s3). The first save of a run is reported apart (on a
GPU it also allocates the pinned buffers that later saves reuse).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform as pyplatform
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    history,
    in_turn,
    latest_run_id,
    median,
    settle,
    tidal_run,
    torch_save_fsync,
    update_doc,
    write_spec,
)
from benchmarks.throughput import bench_spec
from benchmarks.throughput import tidal as timed_tidal_run
from tidal import fs
from tidal.spec.job import JobSpec
from tidal.storage import RunDir
from tidal.testing.servers import moto_s3

WIDE = {"n_layer": 4, "n_head": 8, "d_model": 1024, "vocab_size": 256, "seq_len": 16}
EVERY, STEPS = 5, 20


def stall_spec(tmp: Path, storage: str, every: int = EVERY) -> JobSpec:
    return JobSpec(
        name="bench-stall",
        model=WIDE,
        # A few steps after the last timed save, so that its next update (and wait) is measured too.
        train={"steps": every * (STEPS // EVERY) + 2, "micro_batch": 1, "global_batch": 2, "lr": 1e-4, "warmup_steps": 2, "log_every": 1},
        parallelism={"zero_stage": 2, "precision": "fp32"},
        scaling={"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1},
        checkpoint={"every_steps": every, "keep": 1, "storage": storage},
        tracking={"uri": f"sqlite:///{tmp}/mlflow.db", "experiment": "bench"},
    )


def tidal_saves(spec: JobSpec, path: Path) -> dict[str, Any]:
    run = RunDir(spec.checkpoint.storage, spec.name)
    fs.delete_dir(run.fs, run.path)  # not --restart, which would keep (copy, on S3) every old run aside
    tidal_run(path)
    run_id = latest_run_id(spec)
    blocked = history(spec, run_id, "checkpoint_blocked_s")
    waited = history(spec, run_id, "checkpoint_wait_s")
    gate = history(spec, run_id, "checkpoint_gate_s")
    size = history(spec, run_id, "checkpoint_bytes")
    # Every rank's blocked seconds, the most of any rank, per log step (one collective carries them).
    worst = history(spec, run_id, "checkpoint_blocked_max_s")
    steps = [s for s in sorted(blocked) if s + 1 in gate]  # the final save has no next update
    total = {s: blocked[s][0] + gate[s + 1][0] for s in steps}
    # A save blocks at its step and the next update may wait for its write: the slowest rank's
    # figure is at most the sum of both steps' maxima (two ranks may be the slowest in turn).
    any_rank = {s: worst.get(s, [0.0])[0] + worst.get(s + 1, [0.0])[0] for s in steps}
    return {"first_s": total[steps[0]], "later_s": median([total[s] for s in steps[1:]]),
            "later_any_s": median([any_rank[s] for s in steps[1:]]),
            "later_wait_s": median([waited[s][0] for s in steps[1:]]),
            "later_gate_s": median([gate[s + 1][0] for s in steps[1:]]), "bytes": size[steps[-1]][0]}


def rank0_state(spec: JobSpec) -> dict[str, Any]:
    """Rank 0's files of the newest checkpoint, loaded: the very bytes Tidal saved."""
    run = RunDir(spec.checkpoint.storage, spec.name)
    newest = run.checkpoints()[0]
    state = {}
    with fs.local_copy(run.fs, f"{newest}/global_step{spec.train.steps}") as local:
        for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
            state[name] = torch.load(Path(local) / name, map_location="cpu", weights_only=False)
    return state


def baseline_save(state: dict[str, Any], storage: str, tmp: Path) -> tuple[float, int]:
    """A synchronous torch.save of `state`, durable in the same kind of storage as Tidal's run."""
    if "://" not in storage:
        return torch_save_fsync(state, tmp / "baseline.pt")
    store, root = fs.resolve(storage)
    path = f"{root}/baseline-{uuid.uuid4().hex[:8]}.pt"
    t0 = time.perf_counter()
    with store.open_output_stream(path) as f:  # the object exists once the stream is closed
        torch.save(state, f)
    seconds = time.perf_counter() - t0
    size = store.get_file_info(path).size
    store.delete_file(path)
    return seconds, size


def stall(args: argparse.Namespace, tmp: Path) -> str:
    storage = str(tmp / "runs") if args.storage == "local" else f"{start_s3(tmp)}/runs"
    spec = stall_spec(tmp, storage, args.every)
    path = write_spec(spec, tmp / "stall.yaml")
    rounds = []
    state = None
    for i in range(args.pairs):
        r: dict[str, Any] = {}
        for kind in in_turn(i, "tidal", "torch"):
            settle()
            if kind == "tidal":
                r.update(tidal_saves(spec, path))
                state = None  # the newest checkpoint changed: load its bytes again
            else:
                if state is None and not RunDir(spec.checkpoint.storage, spec.name).checkpoints():
                    r.update(tidal_saves(spec, path))  # a first round that starts with the baseline needs a state
                state = state or rank0_state(spec)
                r["torch_s"], r["torch_bytes"] = baseline_save(state, storage, tmp)
        r["ratio"] = r["later_s"] / r["torch_s"]
        r["ratio_any"] = r["later_any_s"] / r["torch_s"]
        rounds.append(r)
        print(f"round {i + 1}: Tidal blocked {r['later_s']:.3f} s per save (first save {r['first_s']:.3f} s, "
              f"waiting for the previous write {r['later_wait_s']:.3f} s, the next update waiting for this "
              f"write {r['later_gate_s']:.3f} s; slowest rank {r['later_any_s']:.3f} s), torch.save + sync "
              f"{r['torch_s']:.3f} s for {r['torch_bytes'] / 1e6:.0f} MB: ratio {r['ratio']:.3f}", flush=True)
    rows = "\n".join(f"| {i + 1} | {r['later_s']:.3f} s | {r['later_wait_s']:.3f} s | {r['later_gate_s']:.3f} s | {r['later_any_s']:.3f} s | {r['first_s']:.3f} s | {r['torch_s']:.3f} s | {r['ratio']:.3f} | {r['ratio_any']:.3f} |"
                     for i, r in enumerate(rounds))
    where = "a local path (fsync)" if args.storage == "local" else "moto's S3 server on 127.0.0.1 (PUT)"
    return f"""Command: `python -m benchmarks.checkpoint_stall --storage {args.storage} --pairs {args.pairs} --every {args.every}` ({time.strftime('%Y-%m-%d')}, {pyplatform.machine()}, {os.cpu_count()} cores, CPU only)

Work: GPT {WIDE['n_layer']} layers x d{WIDE['d_model']}, ZeRO-2, fp32, 2 workers x 1 CPU, {spec.train.steps} steps, a checkpoint every {args.every}
into {where}; rank 0 holds {rounds[-1]['torch_bytes'] / 1e6:.0f} MB of it. Rounds alternate a `tidal run` and a synchronous
`torch.save` of rank 0's files of its last checkpoint into the same storage (fsynced locally).

| round | Tidal, rank 0: training blocked per save (median of saves 2-{STEPS // EVERY}) | of which waiting for the previous write | of which the next update waiting for this write | Tidal, the slowest rank (`checkpoint_blocked_max_s`) | Tidal: first save | torch.save + sync, same bytes | ratio (rank 0) | ratio (slowest rank) |
|---|---|---|---|---|---|---|---|---|
{rows}

Median ratio, the slowest rank: **{median([r['ratio_any'] for r in rounds]):.3f}** (rank 0: {median([r['ratio'] for r in rounds]):.3f}; goal <= 0.1).
"""


def throughput(args: argparse.Namespace, tmp: Path) -> str:
    every = args.every
    none = bench_spec(tmp, args.steps)
    if args.storage == "s3":
        none = none.with_overrides({"checkpoint.storage": f"{start_s3(tmp)}/runs"})
    every_n = none.with_overrides({"name": f"bench-every{every}", "checkpoint.every_steps": every})
    paths = {"none": write_spec(none, tmp / "none.yaml"), "every": write_spec(every_n, tmp / "every.yaml")}
    specs = {"none": none, "every": every_n}
    rounds = []
    for i in range(args.pairs):
        r = {}
        for kind in in_turn(i, "none", "every"):
            settle()
            r[kind] = timed_tidal_run(specs[kind], paths[kind])["step_s"]
        r["ratio"] = r["none"] / r["every"]
        rounds.append(r)
        print(f"round {i + 1}: no checkpoints {r['none'] * 1000:.1f} ms/step, a checkpoint every {every} steps "
              f"{r['every'] * 1000:.1f} ms/step: throughput ratio {r['ratio']:.3f}", flush=True)
    rows = "\n".join(f"| {i + 1} | {r['none'] * 1000:.1f} ms | {r['every'] * 1000:.1f} ms | {r['ratio']:.3f} |"
                     for i, r in enumerate(rounds))
    where = "local storage" if args.storage == "local" else "moto's S3 server on 127.0.0.1, on the same cores"
    flags = "" if args.storage == "local" else f" --storage s3 --every {every}"
    return f"""Command: `python -m benchmarks.checkpoint_stall --throughput{flags} --pairs {args.pairs} --steps {args.steps}` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, CPU only)

Work: the throughput benchmark's job (GPT 4 layers x d256, ZeRO-2, fp32, 2 workers, {where}), {args.steps} steps,
timed from step 10 to step {args.steps - 10}; `tidal run` with a checkpoint every {every} steps vs none in that window,
alternating (the first of each pair alternates too).

| round | no checkpoint | a checkpoint every {every} steps | throughput ratio |
|---|---|---|---|
{rows}

Median ratio: **{median([r['ratio'] for r in rounds]):.3f}** (goal >= 0.95); each round's step times are printed so
that a machine whose speed drifts during the invocation can be seen.
"""


S3 = contextlib.ExitStack()  # moto's server once started; closed at the end of main


def start_s3(tmp: Path) -> str:
    """moto's S3 server with a bucket, in the environment `tidal run` and its Ray workers inherit."""
    S3.enter_context(moto_s3(tmp / "moto.log", buckets=("bench",)))
    return "s3://bench"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--storage", choices=("local", "s3"), default="local")
    ap.add_argument("--throughput", action="store_true",
                    help="throughput with checkpoints every --every steps (default 2) vs none, instead of the stall")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--every", type=int, default=None,
                    help=f"steps between checkpoints (stall: default {EVERY}, --throughput: 2); raise it for slow storage")
    ap.add_argument("--steps", type=int, default=60, help="steps per run (--throughput)")
    args = ap.parse_args()
    args.every = args.every or (2 if args.throughput else EVERY)
    try:
        with tempfile.TemporaryDirectory() as d:
            if args.throughput:
                where = "" if args.storage == "local" else f" ({args.storage})"
                update_doc(f"Checkpoints every {args.every} steps vs none: throughput{where}", throughput(args, Path(d)))
            else:
                section = f"Checkpoint stall: asynchronous checkpoints vs torch.save ({args.storage})"
                update_doc(section, stall(args, Path(d)))
    finally:
        S3.close()


if __name__ == "__main__":
    main()
