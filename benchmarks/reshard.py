"""How long a resize's universal conversion takes, and its peak local disk: DeepSpeed's
`ds_to_universal` with one extract and one merge worker (Tidal's conversion before issue #35)
against Tidal's conversion now (tidal.worker.checkpoint.universal: only the listed files, parallel workers
sized to the CPUs and memory), alternating, every pair reported.

    python -m benchmarks.reshard --pairs 4 --width 4096 --layers 8     # ~134M params, ~2.1 GB

The checkpoint: a stack of `layers` square Linear layers (fp32, Adam: 16 bytes per parameter)
trained one step by 2 real DeepSpeed ZeRO-2 engines on gloo and saved as Tidal saves it (the
universal-checkpoint info in the client state, a manifest per rank and `tidal-state.json`).
Peak disk is the most bytes the conversion's work folder held (sampled every 0.2 s): its private
copy of the input (made on every filesystem since issue #47: a file swapped in storage after the
check must not reach `ds_to_universal`), fragments and output.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from benchmarks.common import in_turn
from tidal.testing.processes import venv_tools_first

venv_tools_first()

TAG = "global_step1"


def _rank(rank: int, folder: str, width: int, layers: int, port: int) -> None:
    """One of the 2 ranks that write the checkpoint (run as a subprocess)."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)})
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    loss = engine(torch.randn(1, width)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(folder, tag=TAG, client_state={"universal_checkpoint_info": {
        "universal_checkpoint_version": 0.4}})
    torch.distributed.barrier()


def build(folder: Path, width: int, layers: int) -> int:
    """Write the checkpoint with 2 rank processes and Tidal's manifests; returns its bytes."""
    from tidal.storage import STATE_FILE, manifest_name
    from tidal.testing.processes import free_port

    port = free_port()
    code = f"from benchmarks.reshard import _rank; _rank({{r}}, {str(folder)!r}, {width}, {layers}, {port})"
    procs = [subprocess.Popen([sys.executable, "-c", code.format(r=r)]) for r in range(2)]
    if any(p.wait() for p in procs):
        raise RuntimeError("building the checkpoint failed")
    files = {str(p.relative_to(folder)): p.stat().st_size for p in (folder / TAG).iterdir()}
    for r in range(2):  # which rank wrote which file does not matter to the conversion: split them
        mine = {k: v for k, v in files.items() if (f"zero_pp_rank_{r}_" in k) or (r == 0 and "zero_pp" not in k)}
        (folder / manifest_name(r)).write_text(json.dumps({"step": 1, "files": mine}))
    (folder / STATE_FILE).write_text(json.dumps({"step": 1, "world_size": 2, "zero_stage": 2}))
    return sum(files.values())


def disk_bytes(st: os.stat_result) -> int:
    """What a file holds on disk: a sparse copy (tidal.worker.checkpoint.share, .repartition) only its data."""
    return min(st.st_size, st.st_blocks * 512)


class DiskPeak:
    """The most bytes on disk under `folder` (symlinks not followed), sampled while it runs."""

    def __init__(self, folder: str) -> None:
        self.folder, self.peak, self.stop = folder, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.2):
            total = 0
            for root, _, names in os.walk(self.folder):
                for n in names:
                    try:
                        st = os.lstat(os.path.join(root, n))
                        total += disk_bytes(st) if not os.path.islink(os.path.join(root, n)) else 0
                    except OSError:
                        pass
            self.peak = max(self.peak, total)

    def __enter__(self) -> DiskPeak:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def old_way(ckpt: Path, work: Path) -> tuple[float, int]:
    """ds_to_universal with 1 extract and 1 merge worker, as Tidal ran it before."""
    out = work / "old" / f"{TAG}_universal"
    out.parent.mkdir(parents=True)
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(ckpt / TAG),
           "--output_folder", str(out), "--num_extract_workers", "1", "--num_merge_workers", "1"]
    with DiskPeak(str(work / "old")) as disk:
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        took = time.perf_counter() - t0
    return took, disk.peak


def new_way(ckpt: Path, work: Path) -> tuple[float, int]:
    """Tidal's conversion (tidal.worker.checkpoint.universal._convert): listed files, parallel workers, published."""
    from tidal.storage import Found, check_complete
    from tidal.worker.checkpoint import fetch, universal

    os.environ[fetch.CACHE_ENV] = str(work / "cache")
    _, state = check_complete(pafs.LocalFileSystem(), str(ckpt))
    found = Found(str(ckpt), pafs.LocalFileSystem(), state)
    with DiskPeak(str(work / "cache")) as disk:
        t0 = time.perf_counter()
        universal._convert(found, TAG, f"{TAG}_universal")
        took = time.perf_counter() - t0
    shutil.rmtree(ckpt / f"{TAG}_universal")  # what it published: the next pair converts again
    (ckpt / universal.marker(TAG)).unlink()
    return took, disk.peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    args = ap.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="tidal-reshard-bench-"))
    ckpt = base / "checkpoint_000000001"
    t0 = time.perf_counter()
    size = build(ckpt, args.width, args.layers)
    print(f"checkpoint: {size / 1e9:.2f} GB ({args.layers} x Linear({args.width})), built in "
          f"{time.perf_counter() - t0:.0f} s; {len(os.sched_getaffinity(0))} CPUs", flush=True)
    rows: list[dict[str, Any]] = []
    try:
        for i in range(args.pairs):
            order = in_turn(i, ("old", old_way), ("new", new_way))
            row: dict[str, Any] = {"pair": i + 1}
            for name, fn in order:
                work = base / f"work-{i}-{name}"
                work.mkdir()
                row[name], row[f"{name}_disk"] = fn(ckpt, work)
                shutil.rmtree(work)
            rows.append(row)
            print(f"pair {i + 1}: old {row['old']:.1f} s (peak disk {row['old_disk'] / 1e9:.2f} GB), new "
                  f"{row['new']:.1f} s (peak disk {row['new_disk'] / 1e9:.2f} GB), ratio "
                  f"{row['old'] / row['new']:.2f}", flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    med = {k: statistics.median(r[k] for r in rows) for k in ("old", "new", "old_disk", "new_disk")}
    print(f"median: old {med['old']:.1f} s, new {med['new']:.1f} s (x{med['old'] / med['new']:.2f}); peak disk "
          f"old {med['old_disk'] / 1e9:.2f} GB, new {med['new_disk'] / 1e9:.2f} GB; checkpoint {size / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
