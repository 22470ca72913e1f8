"""One GPU, no Ray: MFU, tokens/s and peak memory of a ~1B-parameter built-in GPT in bf16 with
ZeRO-2, and how long a checkpoint through Tidal's save path blocks training, against a
synchronous `torch.save` + fsync of the same state.

    python -m benchmarks.gpu                  # on a GPU machine (benchmarks/device_setup.sh)
    python -m benchmarks.gpu --small          # a tiny model: a smoke test that also runs on CPU
    python -m benchmarks.gpu --doc RESULT.json   # here: put a result into docs/benchmarks.md

The result goes to $OUT/gpu_benchmark.json when OUT is set, else to stdout as one JSON line.
Goals: MFU >= 45%; training blocked by a checkpoint <= 1/20 of the synchronous save.

The engine, data, step, FLOPs per token (6N + 12*L*d*T), peak table and save path are Tidal's
own (build_engine, Batches, flops_per_token, worker_peak_flops, checkpoint.save); the process
group of one is brought up as Ray Train would (`dist_backend`), and `ray.train.report` inside
`checkpoint.save` is replaced by what Ray does with a local storage path: run Tidal's
`checkpoint_upload_fn` in one background thread (ASYNC) and delete the local folder. Timed steps come in windows,
each reported; checkpoint measurements alternate Tidal / torch.save in pairs, each reported.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform as pyplatform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import engine_state, in_turn, torch_save_fsync
from tidal.spec.job import JobSpec

GOAL_MFU = 0.45
GOAL_STALL_RATIO = 1 / 20
RESULT_FILE = "gpu_benchmark.json"
SECTION = "GPU: MFU and checkpoint stall on one GPU"

# ~1.01B parameters: 18 blocks x 12 d^2 (906M) + a 50,304-token embedding, tied to the head (103M).
FULL = {"n_layer": 18, "n_head": 16, "d_model": 2048, "vocab_size": 50304, "seq_len": 2048}
SMALL = {"n_layer": 2, "n_head": 4, "d_model": 128, "vocab_size": 256, "seq_len": 64}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="a tiny model and few steps: a smoke test, CPU allowed")
    ap.add_argument("--layers", type=int, help=f"default {FULL['n_layer']}")
    ap.add_argument("--micro-batch", type=int, help="sequences per forward pass (default 8; halved on out-of-memory)")
    ap.add_argument("--global-batch", type=int, help="sequences per optimizer step (default 32)")
    ap.add_argument("--warmup", type=int, help="untimed steps first (default 3)")
    ap.add_argument("--steps", type=int, help="steps per timed window (default 10)")
    ap.add_argument("--windows", type=int, default=2, help="timed windows, each reported")
    ap.add_argument("--pairs", type=int, default=4, help="checkpoint pairs (Tidal save, torch.save), order alternating")
    ap.add_argument("--after-steps", type=int, default=3, help="steps timed after each save, for work it left running")
    ap.add_argument("--ckpt-dir", default=None, help="where checkpoints are written (default: the temp folder)")
    ap.add_argument("--no-checkpoint", action="store_true", help="measure training only")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the model through DeepSpeed's engine.compile() before the warm-up steps")
    ap.add_argument("--torch-adam", action="store_true",
                    help="torch's AdamW instead of DeepSpeed's FusedAdam (if FusedAdam cannot be JIT-built there)")
    ap.add_argument("--doc", metavar="RESULT.json", help="write this result into docs/benchmarks.md and exit")
    args = ap.parse_args(argv)
    small = args.small
    for name, full, tiny in (("micro_batch", 8, 4), ("global_batch", 32, 8), ("warmup", 3, 2), ("steps", 10, 4)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if small else full)
    return args


def bench_spec(args: argparse.Namespace, micro_batch: int, storage: Path, cuda: bool) -> JobSpec:
    model = dict(SMALL if args.small else FULL)
    if args.layers:
        model["n_layer"] = args.layers
    return JobSpec(
        name="bench-gpu",
        model=model,
        train={"steps": 10**6, "micro_batch": micro_batch, "global_batch": args.global_batch, "lr": 3e-4,
               "warmup_steps": 2, "schedule": "constant"},
        parallelism={"zero_stage": 2, "precision": "bf16"},
        scaling={"min_workers": 1, "max_workers": 1, "gpus_per_worker": 1 if cuda else 0},
        checkpoint={"storage": str(storage)},
        tracking={"uri": f"sqlite:///{storage}/mlflow.db"},
    )


# --- a process group of one, as one Ray Train worker has -----------------------------------
def init_process_group() -> torch.device:
    import torch.distributed as dist

    from tidal.worker.device import dist_backend, torch_device

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "LOCAL_RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})
    device = torch_device()
    dist.init_process_group(backend=dist_backend(1) if device.type == "cuda" else "gloo", rank=0, world_size=1)
    return device


def use_torch_adam() -> None:
    """Tidal's DeepSpeed config with `torch_adam` on, as it is on CPU (the engine reads ds_config at build)."""
    from tidal.worker import engine

    base = engine.ds_config

    def ds_config(*args: Any, **kwargs: Any) -> dict[str, Any]:
        config = base(*args, **kwargs)
        config["optimizer"]["params"]["torch_adam"] = True
        return config

    engine.ds_config = ds_config


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Trainer:
    """Tidal's engine and data for `spec`, stepped as the worker loop steps it."""

    def __init__(self, spec: JobSpec, device: torch.device, compile_model: bool = False) -> None:
        from tidal.worker.data import Batches
        from tidal.worker.engine import build_engine

        self.spec, self.device = spec, device
        self.engine = build_engine(spec, 1, device)
        if compile_model:
            self.engine.compile()  # DeepSpeed's wrapper of torch.compile; the first steps compile
        self.batches = Batches(spec, 0, 1, device)
        self.step = 0

    def run(self, steps: int) -> float:
        """Train `steps` steps; returns the wall time, device work included."""
        sync(self.device)
        t0 = time.perf_counter()
        saves = sys.modules.get("tidal.worker.checkpoint.save")  # once saves began: the loop's wait for a live write (CPU)
        for _ in range(steps):
            self.step += 1
            for tokens, targets in self.batches.for_step(self.step):
                loss = self.engine(tokens, targets)
                self.engine.backward(loss)
                if saves is not None:
                    saves.before_update(self.engine)
                self.engine.step()
        self.last_loss = loss.detach().float().item()  # waits for the device
        return time.perf_counter() - t0

    def close(self) -> None:
        self.engine.destroy()
        del self.engine


def build(args: argparse.Namespace, storage: Path, device: torch.device) -> tuple[Trainer, JobSpec]:
    """The trainer at the largest micro batch (from --micro-batch, halving) that fits in memory."""
    mb = args.micro_batch
    while True:
        spec = bench_spec(args, mb, storage, device.type == "cuda")
        trainer = None
        try:
            trainer = Trainer(spec, device, args.compile)
            t0 = time.perf_counter()
            trainer.run(args.warmup)
            log(f"{args.warmup} warm-up steps in {time.perf_counter() - t0:.1f} s")
            return trainer, spec
        except torch.cuda.OutOfMemoryError:
            if trainer is not None:
                trainer.close()
            trainer = None
            gc.collect()
            torch.cuda.empty_cache()
            if mb == 1 or args.global_batch % (mb // 2):
                raise
            log(f"out of memory at micro batch {mb}; trying {mb // 2}")
            mb //= 2


# --- checkpoints ----------------------------------------------------------------------------
def tidal_checkpoint_module(storage: Path, name: str) -> Any:
    """`tidal.worker.checkpoint.save` with `ray.train` standing in as Ray Train does for a local storage
    path: `report` runs the `checkpoint_upload_fn` (in one background thread for ASYNC, as Ray's
    upload thread pool does; inline for SYNC) and then deletes the reported local folder."""
    import enum
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow.fs as pafs

    uploads = ThreadPoolExecutor(max_workers=1)

    class Mode(enum.Enum):
        ASYNC = "ASYNC"
        SYNC = "SYNC"

    class Checkpoint:
        def __init__(self, path: str, filesystem: Any = None) -> None:
            self.path, self.filesystem = path, filesystem

        @staticmethod
        def from_directory(path: str) -> Checkpoint:
            return Checkpoint(path, pafs.LocalFileSystem())

    def report(metrics: dict[str, Any], checkpoint: Checkpoint, checkpoint_dir_name: str, checkpoint_upload_mode: Mode,
               checkpoint_upload_fn: Any, delete_local_checkpoint_after_upload: bool = False) -> None:
        def upload() -> None:
            checkpoint_upload_fn(checkpoint, checkpoint_dir_name)
            if delete_local_checkpoint_after_upload:
                shutil.rmtree(checkpoint.path, ignore_errors=True)

        if checkpoint_upload_mode == Mode.ASYNC:
            uploads.submit(upload)
        else:
            upload()

    where = types.SimpleNamespace(storage_filesystem=pafs.LocalFileSystem(), experiment_fs_path=str(storage / name))
    train = types.SimpleNamespace(report=report, Checkpoint=Checkpoint, CheckpointUploadMode=Mode,
                                  get_context=lambda: types.SimpleNamespace(get_storage=lambda: where))
    try:
        import ray.train  # noqa: F401 - checkpoint/save.py imports it; without Ray, a stand-in module
    except ImportError:
        stub = types.ModuleType("ray")
        stub.train = types.ModuleType("ray.train")  # type: ignore[attr-defined]
        sys.modules.setdefault("ray", stub)
        sys.modules.setdefault("ray.train", stub.train)  # type: ignore[attr-defined]
    from tidal.worker.checkpoint import save

    save.ray = types.SimpleNamespace(train=train)
    save.flush = lambda: uploads.submit(lambda: None).result()  # wait for the writes in flight
    return save


def check_written(run: Path, weights: dict[str, torch.Tensor]) -> None:
    """The weights in storage are those at the save, bit for bit, not the ones training went on to."""
    (path,) = run.glob("checkpoint_*/global_step*/mp_rank_00_model_states.pt")
    saved = torch.load(path, map_location="cpu", weights_only=False)["module"]
    differ = [k for k, v in weights.items() if not torch.equal(saved[k], v)]
    if differ or set(saved) != set(weights):
        sys.exit(f"benchmarks.gpu: the checkpoint in storage differs from the state at the save: {differ[:5]}")
    log(f"the written checkpoint holds the weights as they were at the save ({len(weights)} tensors, equal)")


def checkpoint_pairs(args: argparse.Namespace, trainer: Trainer, spec: JobSpec, storage: Path,
                     step_s: float) -> dict[str, Any]:
    """Alternate a save through Tidal's path and a torch.save + fsync; after each, time a few
    steps, so work a save leaves running in the background is counted as blocked time too."""
    checkpoint = tidal_checkpoint_module(storage, spec.name)
    state = checkpoint.TrainState()
    written_by = checkpoint.Provenance(1, spec.parallelism.zero_stage, spec.resume_fingerprint())
    # The first save of a run allocates the host buffers (pinned, on a GPU) that later saves
    # reuse: timed on its own, not as a pair.
    state.step = trainer.step
    t0 = time.perf_counter()
    checkpoint.save(trainer.engine, state, written_by, {"loss": trainer.last_loss})
    first_s = time.perf_counter() - t0
    log(f"first save (allocates the host buffers): training blocked {first_s:.2f} s")
    weights = {k: v.detach().cpu().clone() for k, v in trainer.engine.module.state_dict().items()}
    trainer.run(args.after_steps)  # changes the weights while the write runs
    checkpoint.flush()
    check_written(storage / spec.name, weights)
    shutil.rmtree(storage / spec.name, ignore_errors=True)
    pairs = []
    for i in range(args.pairs):
        pair: dict[str, Any] = {}
        for kind in in_turn(i, "tidal", "torch"):
            checkpoint.flush()  # a background write still running would slow whatever is timed next
            shutil.rmtree(storage / spec.name, ignore_errors=True)  # the previous checkpoint: keep one
            t0 = time.perf_counter()
            if kind == "tidal":
                state.step = trainer.step
                saved = checkpoint.save(trainer.engine, state, written_by, {"loss": trainer.last_loss})
                call_s = time.perf_counter() - t0
            else:
                call_s, size = torch_save_fsync(engine_state(trainer.engine), storage / "torch-save.pt")
            after_s = trainer.run(args.after_steps) - args.after_steps * step_s
            if kind == "tidal":
                pair.update(tidal_call_s=call_s, tidal_after_s=after_s, tidal_blocked_s=call_s + max(0.0, after_s),
                            tidal_save_s=saved["checkpoint_save_s"], tidal_bytes=saved["checkpoint_bytes"])
            else:
                pair.update(torch_save_s=call_s, torch_after_s=after_s, torch_bytes=size)
        pair["ratio"] = pair["tidal_blocked_s"] / pair["torch_save_s"]
        pairs.append(pair)
        log(f"checkpoint pair {i + 1}: Tidal blocked {pair['tidal_blocked_s']:.2f} s "
            f"({pair['tidal_bytes'] / 1e9:.2f} GB), torch.save + fsync {pair['torch_save_s']:.2f} s "
            f"({pair['torch_bytes'] / 1e9:.2f} GB): ratio {pair['ratio']:.3f}")
    checkpoint.flush()
    shutil.rmtree(storage / spec.name, ignore_errors=True)
    ratio = statistics.median(p["ratio"] for p in pairs)
    return {"first_save_s": first_s, "pairs": pairs, "median_ratio": ratio, "goal_ratio": GOAL_STALL_RATIO, "meets_goal": ratio <= GOAL_STALL_RATIO}


# --- the run --------------------------------------------------------------------------------
def describe_device(device: torch.device) -> dict[str, Any]:
    import deepspeed

    info: dict[str, Any] = {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
                            "python": pyplatform.python_version(), "cpus": os.cpu_count(),
                            "date": time.strftime("%Y-%m-%d")}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                    gpu_memory_gb=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count)
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30).stdout.strip()
            info["nvidia_smi"] = out.splitlines()[0] if out else None
        except (OSError, subprocess.SubprocessError):
            info["nvidia_smi"] = None
    else:
        info.update(device=f"CPU ({pyplatform.machine()}, {torch.get_num_threads()} threads)")
    return info


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from tidal.spec.memory import estimate
    from tidal.worker.engine import param_count
    from tidal.worker.metrics import flops_per_token, worker_peak_flops

    device = init_process_group()
    if args.torch_adam:
        use_torch_adam()
    root = Path(args.ckpt_dir or tempfile.gettempdir()) / f"tidal-bench-gpu-{os.getpid()}"
    root.mkdir(parents=True, exist_ok=True)
    tempfile.tempdir = str(root)  # checkpoint.save's local folder goes beside the storage, on one disk
    try:
        trainer, spec = build(args, root / "storage", device)
        m, t = spec.model, spec.train
        n_params = param_count(trainer.engine, spec)
        fpt = flops_per_token(n_params, m)
        peak = worker_peak_flops(device, "bf16", torch.get_num_threads(), None)
        tokens_per_step = t.global_batch * m.seq_len
        about = describe_device(device)
        log(f"{about['device']}: GPT {m.n_layer}x{m.d_model}, {n_params / 1e9:.3f}B params, "
            f"micro batch {t.micro_batch}, global batch {t.global_batch} x {m.seq_len} tokens")

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        windows = []
        for w in range(args.windows):
            seconds = trainer.run(args.steps)
            step_s = seconds / args.steps
            windows.append({"step_s": step_s, "tokens_per_s": tokens_per_step / step_s,
                            "mfu": fpt * tokens_per_step / step_s / peak, "loss": trainer.last_loss})
            log(f"window {w + 1}: {step_s * 1000:.1f} ms/step, {windows[-1]['tokens_per_s']:,.0f} tokens/s, "
                f"MFU {100 * windows[-1]['mfu']:.1f}%, loss {trainer.last_loss:.3f}")
        step_s = statistics.median(w["step_s"] for w in windows)
        mfu = fpt * tokens_per_step / step_s / peak
        result: dict[str, Any] = {
            "benchmark": "benchmarks.gpu", "argv": sys.argv[1:], **about,
            "model": {**m.model_dump(include={"n_layer", "n_head", "d_model", "vocab_size", "seq_len"}),
                      "params": n_params, "flops_per_token": fpt},
            "train": {"zero_stage": 2, "precision": "bf16", "optimizer": type(trainer.engine.basic_optimizer).__name__,
                      "compiled": args.compile,
                      "micro_batch": t.micro_batch, "global_batch": t.global_batch,
                      "tokens_per_step": tokens_per_step, "warmup_steps": args.warmup, "steps_per_window": args.steps},
            "peak_flops": peak, "windows": windows, "step_s": step_s, "tokens_per_s": tokens_per_step / step_s,
            "mfu": mfu, "goal_mfu": GOAL_MFU, "meets_mfu_goal": mfu >= GOAL_MFU,
        }
        if device.type == "cuda":
            result["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
            result["peak_memory_reserved_gb"] = torch.cuda.max_memory_reserved(device) / 1e9
        # What `tidal validate --deepspeed` predicts for this job, beside the measured peak above.
        result["memory_estimate"] = estimate(spec, world=1).record()
        if not args.no_checkpoint:
            # bf16 weights + fp32 master weights + Adam moments: 14 B/param, written to a local
            # folder and copied into storage before the local one goes.
            need = 2.2 * 14 * n_params
            free = shutil.disk_usage(root).free
            if free < need:
                result["checkpoint"] = {"skipped": f"{free / 1e9:.0f} GB free under {root}, about {need / 1e9:.0f} GB "
                                                   "needed: give --ckpt-dir on a larger disk (or /dev/shm, which "
                                                   "leaves the disk out of both sides)"}
            else:
                result["checkpoint"] = checkpoint_pairs(args, trainer, spec, root / "storage", step_s)
        trainer.close()
        return result
    finally:
        shutil.rmtree(root, ignore_errors=True)


def log(message: str) -> None:
    print(f"[bench-gpu] {message}", file=sys.stderr, flush=True)


def write_result(result: dict[str, Any]) -> None:
    text = json.dumps(result, indent=2, default=float)
    out = os.environ.get("OUT")
    if out:
        path = Path(out) / RESULT_FILE
        path.write_text(text + "\n")
        log(f"result written to {path}")
        print(text)
    else:
        print(json.dumps(result, default=float))


# --- the doc --------------------------------------------------------------------------------
def doc_section(r: dict[str, Any]) -> str:
    m, t = r["model"], r["train"]
    win = ", ".join(f"{w['step_s'] * 1000:.0f} ms ({100 * w['mfu']:.1f}%)" for w in r["windows"])
    device = r["device"] + (f" (nvidia-smi: {r['nvidia_smi']})" if r.get("nvidia_smi") else "")
    command = " ".join(["python -m benchmarks.gpu", *r["argv"]])
    cuda = r.get("cuda")
    group = "NCCL" if cuda else "gloo"
    body = f"""Command: `{command}` ({r['date']}, {device}, {r['cpus']} CPUs, torch {r['torch']}{f' (CUDA {cuda})' if cuda else ''},
DeepSpeed {r['deepspeed']}; no Ray: one process group of one over {group}, as a single Ray Train worker has)

Work: the built-in GPT, {m['n_layer']} layers x d{m['d_model']}, {m['n_head']} heads, vocabulary {m['vocab_size']},
sequence {m['seq_len']}: {m['params'] / 1e9:.3f}B parameters, {m['flops_per_token'] / 1e9:.2f} GFLOP/token (6N + 12·L·d·T).
ZeRO-{t['zero_stage']}, {t['precision']}, {t.get('optimizer', 'AdamW')}, micro batch {t['micro_batch']}, global batch {t['global_batch']} ({t['tokens_per_step']:,} tokens/step);
{t['warmup_steps']} warm-up steps, then {len(r['windows'])} windows of {t['steps_per_window']} timed steps. MFU is
against {r['peak_flops'] / 1e12:.4g} TFLOP/s, the dense bf16 peak from Tidal's table (`worker_peak_flops`).

| measure | result | goal |
|---|---|---|
| MFU | **{100 * r['mfu']:.1f}%** | >= {100 * r['goal_mfu']:.0f}% ({'met' if r['meets_mfu_goal'] else 'not met'}) |
| tokens/s | {r['tokens_per_s']:,.0f} | |
| step time | {r['step_s'] * 1000:.0f} ms | |
| peak memory (allocated / reserved) | {r.get('peak_memory_gb', float('nan')):.1f} / {r.get('peak_memory_reserved_gb', float('nan')):.1f} GB | |
| estimated before the run (`tidal validate --deepspeed`) | {r.get('memory_estimate', {}).get('device_total_gb', float('nan')):.1f} GB | |
"""
    c = r.get("checkpoint", {})
    if "pairs" in c:
        tb, ts = (statistics.median(p[k] for p in c["pairs"]) for k in ("tidal_blocked_s", "torch_save_s"))
        body += (f"| checkpoint: training blocked, Tidal's save path | {tb:.2f} s for "
                 f"{c['pairs'][0]['tidal_bytes'] / 1e9:.1f} GB | |\n"
                 f"| checkpoint: synchronous `torch.save` + fsync of the same state | {ts:.2f} s for "
                 f"{c['pairs'][0]['torch_bytes'] / 1e9:.1f} GB | |\n"
                 f"| stall ratio (blocked / synchronous save) | **{c['median_ratio']:.3f}** | <= 1/20 = 0.05 "
                 f"({'met' if c['meets_goal'] else 'not met'}) |\n")
        if "first_save_s" in c:
            body += (f"| checkpoint: the first save of a worker process (allocates and page-locks the host block) "
                     f"| {c['first_save_s']:.2f} s | |\n")
    body += f"\nPer-window step times (MFU): {win}.\n"
    if "pairs" in c:
        body += "Checkpoint pairs (alternating order): " + "; ".join(
            f"Tidal {p['tidal_blocked_s']:.2f} s (call {p['tidal_call_s']:.2f} s, after {p['tidal_after_s']:+.2f} s) vs "
            f"torch.save {p['torch_save_s']:.2f} s" for p in c["pairs"]) + ".\n"
        body += ("Tidal's blocked time is the `checkpoint.save` call (DeepSpeed's `save_checkpoint` into Tidal's snapshot "
                 "engine: one DMA copy of every tensor into a reused page-locked host block) plus any slowdown of the "
                 "next steps while the background write into storage (fsynced, manifest last) runs. After the first "
                 "save the benchmark loads the written weights and checks them against a copy taken at the save.\n")
    elif c:
        body += f"Checkpoint stall not measured: {c.get('skipped')}.\n"
    return body


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.doc:
        from benchmarks.common import update_doc  # imports mlflow: here, not on the GPU machine

        body = doc_section(json.loads(Path(args.doc).read_text()))
        update_doc(SECTION, body)
        print(body)
        return
    if not torch.cuda.is_available() and not args.small:
        sys.exit("benchmarks.gpu: no CUDA device here (torch.cuda.is_available() is false). Run it on a GPU "
                 "machine (see benchmarks/device_setup.sh), or add --small for a CPU smoke test of the script.")
    write_result(measure(args))


if __name__ == "__main__":
    main()
