"""What the fsync in `fs.write_json` costs: the time of one write, with and without it.

    PYTHONPATH=platform python -m benchmarks.fsync_cost [--pairs 4] [--writes 200] [--dir PATH] [--job]

Each pair times `--writes` writes of a mark-sized document with fsync and without, alternating
which goes first; every pair is printed, then the medians. Run it on the filesystem a job's
storage lives on (`--dir`): a local SSD, an NFS mount and tmpfs differ by orders of magnitude.

`--job` also runs jobs/quickstart.yaml (storage in `--dir`) in alternating pairs with fsync and
without, and reports rank 0's ms/step between logged steps 10 and 110 (two checkpoints inside).
The runs without fsync turn it off in every process of the job (Ray's workers and the tracker
included) through a `sitecustomize` module on their PYTHONPATH, so the product has no such switch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.fs as pafs

from benchmarks.common import ROOT, history, in_turn, latest_run_id, settle, write_spec
from tidal import fs
from tidal.spec.job import JobSpec

# About the size of the ledger's mark and a manifest: a few counters and latest values.
DOC = {"run_id": "0" * 32, "step": 1234, "counters": {f"c{i}": float(i) for i in range(8)},
       "latest": {f"metric_{i}": i / 3 for i in range(40)}}


def per_write_ms(folder: str, writes: int, durable: bool) -> float:
    fs.DURABLE = durable
    local = pafs.LocalFileSystem()
    t = time.perf_counter()
    for i in range(writes):
        fs.write_json(local, f"{folder}/doc{i % 4}.json", DOC)
    return (time.perf_counter() - t) / writes * 1000


NO_FSYNC = "import tidal.fs\ntidal.fs.DURABLE = False  # benchmarks/fsync_cost.py: the runs without fsync\n"


def job_ms_per_step(folder: Path, durable: bool, tag: str) -> float:
    spec = JobSpec.model_validate(__import__("yaml").safe_load((ROOT / "jobs" / "quickstart.yaml").read_text()))
    spec = spec.with_overrides({"name": f"fsync-{tag}", "checkpoint.storage": str(folder / "runs"),
                                "tracking.uri": f"sqlite:///{folder}/mlflow.db", "tracking.experiment": "fsync"})
    hook = folder / ("on" if durable else "off")
    hook.mkdir(exist_ok=True)
    if not durable:
        (hook / "sitecustomize.py").write_text(NO_FSYNC)
    old = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(hook), str(ROOT / "platform"), str(ROOT), old])
    try:
        settle()
        # A Ray instance of its own (RAY_ADDRESS=local): never a `ray start` cluster found on the machine.
        env = {**os.environ, "RAY_ADDRESS": "local"}
        subprocess.run([sys.executable, "-m", "tidal", "run", str(write_spec(spec, folder / f"{tag}.yaml")),
                        "--restart"], check=True, capture_output=True, timeout=900, env=env)
    finally:
        os.environ["PYTHONPATH"] = old
    loss = history(spec, latest_run_id(spec), "loss")
    return (loss[110][1] - loss[10][1]) / 100


def job_pairs(pairs: int, where: str | None) -> None:
    synced, plain = [], []
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        for pair in range(pairs):
            order = in_turn(pair, True, False)
            got = {d: job_ms_per_step(Path(tmp), d, f"{pair}-{'on' if d else 'off'}") for d in order}
            synced.append(got[True])
            plain.append(got[False])
            print(f"job pair {pair + 1}: fsync {got[True]:.1f} ms/step, none {got[False]:.1f} ms/step", flush=True)
    print(f"job median: fsync {statistics.median(synced):.1f} ms/step, none {statistics.median(plain):.1f} ms/step, "
          f"ratio {statistics.median(synced) / statistics.median(plain):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--writes", type=int, default=200)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    ap.add_argument("--job", action="store_true", help="also time quickstart jobs with and without fsync")
    a = ap.parse_args()
    synced, plain = [], []
    with tempfile.TemporaryDirectory(dir=a.dir) as folder:
        for pair in range(a.pairs):
            order = in_turn(pair, True, False)
            got = {durable: per_write_ms(folder, a.writes, durable) for durable in order}
            synced.append(got[True])
            plain.append(got[False])
            print(f"pair {pair + 1}: fsync {got[True]:.3f} ms/write, none {got[False]:.3f} ms/write")
    fs.DURABLE = True
    print(f"median: fsync {statistics.median(synced):.3f} ms/write, none {statistics.median(plain):.3f} ms/write, "
          f"cost {statistics.median(synced) - statistics.median(plain):.3f} ms/write", flush=True)
    if a.job:
        job_pairs(a.pairs, a.dir)


if __name__ == "__main__":
    main()
