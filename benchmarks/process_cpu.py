"""Where the CPU goes during a run: CPU seconds per process over a window in the middle of a
`tidal run` and of the same loop in bare Ray Train (benchmarks/bare_ray.py), to see what Tidal
adds beside the workers (its tracker actor) and what Ray runs in both.

    python -m benchmarks.process_cpu [--steps 250] [--warm 35] [--window 30]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from benchmarks.common import ROOT, settle, write_spec
from benchmarks.throughput import bench_spec


def cpu_seconds() -> dict[int, tuple[str, float]]:
    out = {}
    for p in psutil.process_iter(["pid", "cmdline", "cpu_times"]):
        try:
            ct = p.info["cpu_times"]
            out[p.info["pid"]] = (" ".join(p.info["cmdline"] or [])[:90], ct.user + ct.system)
        except (psutil.Error, TypeError):
            continue
    return out


def measure(label: str, cmd: list[str], warm: float, window: float) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'platform'}:{ROOT}"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    time.sleep(warm)  # past start-up, into steady training
    before, t0 = cpu_seconds(), time.time()
    time.sleep(window)
    after, seconds = cpu_seconds(), time.time() - t0
    proc.wait()
    rows = sorted(((after[k][1] - before[k][1], after[k][0]) for k in after if k in before), reverse=True)
    print(f"--- {label}: {sum(r[0] for r in rows):.1f} CPU-s in {seconds:.1f} s")
    for used, name in rows[:16]:
        if used > 0.05:
            print(f"{used:6.2f}  {name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=250, help="long enough to outlast --warm + --window")
    ap.add_argument("--warm", type=float, default=35)
    ap.add_argument("--window", type=float, default=30)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = write_spec(bench_spec(Path(d), args.steps), Path(d) / "bench.yaml")
        settle()
        measure("tidal run", [sys.executable, "-m", "tidal", "run", str(path), "--restart"], args.warm, args.window)
        settle()
        measure("bare Ray Train", [sys.executable, "-m", "benchmarks.bare_ray", str(path)], args.warm, args.window)


if __name__ == "__main__":
    main()
