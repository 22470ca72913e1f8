"""Tidal vs bare Ray Train vs plain DeepSpeed on the same work, in one invocation, runs in
rotating order: (a) a bare DeepSpeed loop under torchrun, (b) the same loop in a bare Ray Train
`TorchTrainer` and (c) `tidal run`, same model, data, DeepSpeed config, world size and steps. Also: checkpoint blocked time vs a synchronous torch.save of the same
state, and DeepSpeed universal-checkpoint conversion time per GB (the cost of a resize).

    python -m benchmarks.throughput [--repeats 4] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import os
import platform as pyplatform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import (
    ROOT,
    history,
    latest_run_id,
    median,
    settle,
    tidal_run,
    update_doc,
    write_spec,
)
from tidal.spec.job import JobSpec

WARMUP = 10


def bench_spec(tmp: Path, steps: int) -> JobSpec:
    return JobSpec(
        name="bench-throughput",
        model={"n_layer": 4, "n_head": 4, "d_model": 256, "vocab_size": 256, "seq_len": 64},
        train={"steps": steps, "micro_batch": 8, "global_batch": 32, "lr": 3e-4, "warmup_steps": 5, "log_every": 10},
        parallelism={"zero_stage": 2, "precision": "fp32"},
        scaling={"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1},
        checkpoint={"every_steps": steps, "keep": 1, "storage": str(tmp / "runs")},
        tracking={"uri": f"sqlite:///{tmp}/mlflow.db", "experiment": "bench"},
    )


def _json_run(cmd: list[str]) -> dict:
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
           "PYTHONPATH": f"{ROOT / 'platform'}:{ROOT}"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    if out.returncode:
        raise RuntimeError(out.stdout[-2000:] + out.stderr[-2000:])
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])


def plain(spec_path: Path) -> dict:
    t0 = time.time()
    r = _json_run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29533",
                   "-m", "benchmarks.plain_deepspeed", str(spec_path)])
    return {**r, "launch_s": r["warm_at"] - t0}


def bare_ray(spec_path: Path) -> dict:
    t0 = time.time()
    r = _json_run([sys.executable, "-m", "benchmarks.bare_ray", str(spec_path)])
    return {**r, "launch_s": r["warm_at"] - t0}


def tidal(spec: JobSpec, spec_path: Path, env_extra: dict[str, str] | None = None) -> dict:
    t0 = time.time()
    tidal_run(spec_path, "--restart", env_extra=env_extra)
    run_id = latest_run_id(spec)
    loss = history(spec, run_id, "loss")
    # Rank 0's wall clock between logging step WARMUP and step N-10: everything Tidal adds
    # (reporting, preemption checks, tracking) is inside; the final checkpoint is not.
    last = spec.train.steps - 10
    seconds = (loss[last][1] - loss[WARMUP][1]) / 1000
    blocked = history(spec, run_id, "checkpoint_blocked_s")[spec.train.steps][0]
    size = history(spec, run_id, "checkpoint_bytes")[spec.train.steps][0]
    return {"step_s": seconds / (last - WARMUP), "blocked_s": blocked, "ckpt_bytes": size, "run_id": run_id,
            "launch_s": loss[WARMUP][1] / 1000 - t0}  # the step's time as rank 0 logged it


def conversion(spec: JobSpec) -> tuple[float, float]:
    """Seconds and bytes to convert the last checkpoint to universal form (what a resize costs)."""
    ckpt = Path(spec.checkpoint.storage) / spec.name / f"checkpoint_{spec.train.steps:09d}"
    src = ckpt / f"global_step{spec.train.steps}"
    size = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(src),
                        "--output_folder", f"{out}/u", "--num_extract_workers", "1", "--num_merge_workers", "1"],
                       check=True, capture_output=True)
        return time.perf_counter() - t0, size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    kinds = ("plain", "bare", "tidal")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        spec = bench_spec(tmp, args.steps)
        path = write_spec(spec, tmp / "bench.yaml")
        run = {"plain": lambda: plain(path), "bare": lambda: bare_ray(path), "tidal": lambda: tidal(spec, path)}
        rounds: list[dict[str, dict]] = []
        for i in range(args.repeats):  # rotate the order, so drift in the machine hits all alike
            order = kinds[i % 3:] + kinds[:i % 3]
            rounds.append({})
            for k in order:
                settle()  # the previous run's Ray instance gone
                rounds[-1][k] = run[k]()
            r = rounds[-1]
            print(f"round {i + 1} ({' -> '.join(order)}): plain {r['plain']['step_s'] * 1000:.1f} ms/step, "
                  f"bare Ray Train {r['bare']['step_s'] * 1000:.1f}, tidal {r['tidal']['step_s'] * 1000:.1f}; "
                  f"tidal/bare {r['bare']['step_s'] / r['tidal']['step_s']:.3f}, "
                  f"tidal/plain {r['plain']['step_s'] / r['tidal']['step_s']:.3f}", flush=True)
        conv_s, conv_bytes = conversion(spec)
    step = {k: median([r[k]["step_s"] for r in rounds]) for k in kinds}
    blocked = median([r["tidal"]["blocked_s"] for r in rounds])
    ckpt_mb = rounds[-1]["tidal"]["ckpt_bytes"] / 1e6
    torch_save = median([r["plain"]["torch_save_s"] for r in rounds])
    tokens = spec.train.global_batch * spec.model.seq_len
    launch = {k: median([r[k]["launch_s"] for r in rounds]) for k in kinds}
    launch_rows = "\n".join(f"| {i + 1} | {r['plain']['launch_s']:.1f} s | {r['bare']['launch_s']:.1f} s | {r['tidal']['launch_s']:.1f} s |"
                             for i, r in enumerate(rounds))
    rows = "\n".join(
        f"| {i + 1} | {r['plain']['step_s'] * 1000:.1f} | {r['bare']['step_s'] * 1000:.1f} | {r['tidal']['step_s'] * 1000:.1f} "
        f"| {r['bare']['step_s'] / r['tidal']['step_s']:.3f} | {r['plain']['step_s'] / r['tidal']['step_s']:.3f} "
        f"| {r['plain']['step_s'] / r['bare']['step_s']:.3f} |" for i, r in enumerate(rounds))
    body = f"""Command: `python -m benchmarks.throughput --repeats {args.repeats} --steps {args.steps}` ({time.strftime('%Y-%m-%d')}, {pyplatform.machine()}, {torch.get_num_threads()} threads, CPU only)

Work: GPT 4 layers x d256 (3.3M params), ZeRO-2, fp32, 2 workers x 1 CPU, micro batch 8, global batch 32, seq 64,
{args.steps} steps; every kind is timed over the same steps, {WARMUP + 1} to {args.steps - 10} (the first {WARMUP} warm up, the
last 10 hold Tidal's final checkpoint).
Each round runs the three in a rotating order; throughput ratios are step-time ratios within the round.

| round | plain DeepSpeed (torchrun), ms/step | same loop, bare Ray Train | `tidal run` | Tidal / bare Ray | Tidal / plain | bare Ray / plain |
|---|---|---|---|---|---|---|
{rows}

Medians: plain {step['plain'] * 1000:.1f} ms, bare Ray Train {step['bare'] * 1000:.1f} ms, Tidal {step['tidal'] * 1000:.1f} ms
({tokens / step['tidal']:,.0f} tokens/s); Tidal / bare Ray **{step['bare'] / step['tidal']:.3f}**, Tidal / plain **{step['plain'] / step['tidal']:.3f}**.

Fixed cost, the same runs: seconds from the command's start to step {WARMUP} done (the first {WARMUP} steps take
about {WARMUP * step['plain']:.1f} s of it), process start, imports, Ray and the engines included:

| round | plain DeepSpeed (torchrun) | bare Ray Train (starts a local Ray instance) | `tidal run` (the same, and the tracker and MLflow run) |
|---|---|---|---|
{launch_rows}

Medians: plain {launch['plain']:.1f} s, bare Ray Train {launch['bare']:.1f} s, Tidal {launch['tidal']:.1f} s.

Checkpoint at the last step: training blocked {blocked:.3f} s for {ckpt_mb:.1f} MB on rank 0; a synchronous `torch.save` +
fsync of rank 0's state in the plain runs took {torch_save:.3f} s. Resize: universal conversion {conv_s:.1f} s for
{conv_bytes / 1e6:.1f} MB (dominated by process start and DeepSpeed import at this size).
"""
    update_doc("Throughput: Tidal vs bare Ray Train vs plain DeepSpeed", body)
    print(body)


if __name__ == "__main__":
    main()
