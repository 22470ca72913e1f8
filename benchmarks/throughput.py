"""Tidal vs plain DeepSpeed on the same work, in one invocation, alternating runs:
(a) a bare DeepSpeed loop under torchrun and (b) `tidal run`, same model, data, DeepSpeed config,
world size and steps. Also: checkpoint blocked time vs a synchronous torch.save of the same
state, and DeepSpeed universal-checkpoint conversion time per GB (the cost of a resize).

    python -m benchmarks.throughput [--repeats 2] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
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


def plain(spec_path: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29533",
                          str(ROOT / "benchmarks" / "plain_deepspeed.py"), str(spec_path)],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(out.stdout[-2000:] + out.stderr[-2000:])
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])


def tidal(spec: JobSpec, spec_path: Path) -> dict:
    tidal_run(spec_path, "--restart")
    run_id = latest_run_id(spec)
    loss = history(spec, run_id, "loss")
    # Wall clock between the tracker's receipt of step WARMUP and of step N-10: everything Tidal
    # adds (reporting, preemption checks, tracking) is inside; the final checkpoint is not.
    last = spec.train.steps - 10
    seconds = (loss[last][1] - loss[WARMUP][1]) / 1000
    blocked = history(spec, run_id, "checkpoint_blocked_s")[spec.train.steps][0]
    size = history(spec, run_id, "checkpoint_bytes")[spec.train.steps][0]
    return {"step_s": seconds / (last - WARMUP), "blocked_s": blocked, "ckpt_bytes": size, "run_id": run_id}


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
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        spec = bench_spec(tmp, args.steps)
        path = write_spec(spec, tmp / "bench.yaml")
        plain_runs, tidal_runs = [], []
        for i in range(args.repeats):  # alternate, so drift in the machine hits both alike
            plain_runs.append(plain(path))
            tidal_runs.append(tidal(spec, path))
            print(f"repeat {i + 1}: plain {plain_runs[-1]['step_s'] * 1000:.1f} ms/step, "
                  f"tidal {tidal_runs[-1]['step_s'] * 1000:.1f} ms/step", flush=True)
        conv_s, conv_bytes = conversion(spec)
    p_step, t_step = median([r["step_s"] for r in plain_runs]), median([r["step_s"] for r in tidal_runs])
    blocked = median([r["blocked_s"] for r in tidal_runs])
    ckpt_gb = tidal_runs[-1]["ckpt_bytes"] * 2 / 1e9  # rank 0's share x 2 ranks (ZeRO-2 splits evenly)
    torch_save = median([r["torch_save_s"] for r in plain_runs])
    tokens = spec.train.global_batch * spec.model.seq_len
    body = f"""Command: `python -m benchmarks.throughput --repeats {args.repeats} --steps {args.steps}` ({time.strftime('%Y-%m-%d')}, {pyplatform.machine()}, {torch.get_num_threads()} threads, CPU only)

Work: GPT 4 layers x d256 (3.3M params), ZeRO-2, fp32, 2 workers x 1 CPU, micro batch 8, global batch 32, seq 64,
{args.steps} steps, the first {WARMUP} (and, for Tidal, the last 10 with the final checkpoint) left out of the timing;
runs alternate plain/Tidal, medians of {args.repeats}.

| measure | plain DeepSpeed (torchrun) | Tidal (`tidal run`, Ray Train) | ratio |
|---|---|---|---|
| step time | {p_step * 1000:.1f} ms | {t_step * 1000:.1f} ms | **{p_step / t_step:.3f}** (throughput, Tidal / plain) |
| tokens/s | {tokens / p_step:,.0f} | {tokens / t_step:,.0f} | |
| checkpoint: training blocked | synchronous `torch.save` + fsync of rank 0's state: {torch_save:.3f} s | {blocked:.3f} s for {ckpt_gb * 1e3:.1f} MB ({blocked / ckpt_gb:.2f} s/GB) | |
| resize: universal conversion | | {conv_s:.1f} s for {conv_bytes / 1e6:.1f} MB ({conv_s / (conv_bytes / 1e9):.0f} s/GB) | |

Per-run step times (ms): plain {[round(r['step_s'] * 1000, 1) for r in plain_runs]}, Tidal {[round(r['step_s'] * 1000, 1) for r in tidal_runs]}.
The conversion time is dominated by fixed costs (process start, DeepSpeed import) at this size; per GB it falls for larger states.
"""
    update_doc("Throughput: Tidal vs plain DeepSpeed", body)
    print(body)


if __name__ == "__main__":
    main()
