"""What the fsync in `fs.write_json` costs: the time of one write, with and without it.

    PYTHONPATH=platform python -m benchmarks.fsync_cost [--pairs 4] [--writes 200] [--dir PATH]

Each pair times `--writes` writes of a mark-sized document with fsync and without, alternating
which goes first; every pair is printed, then the medians. Run it on the filesystem a job's
storage lives on (`--dir`): a local SSD, an NFS mount and tmpfs differ by orders of magnitude.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import pyarrow.fs as pafs

from tidal import fs

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--writes", type=int, default=200)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    a = ap.parse_args()
    synced, plain = [], []
    with tempfile.TemporaryDirectory(dir=a.dir) as folder:
        for pair in range(a.pairs):
            order = (True, False) if pair % 2 == 0 else (False, True)
            got = {durable: per_write_ms(folder, a.writes, durable) for durable in order}
            synced.append(got[True])
            plain.append(got[False])
            print(f"pair {pair + 1}: fsync {got[True]:.3f} ms/write, none {got[False]:.3f} ms/write")
    fs.DURABLE = True
    print(f"median: fsync {statistics.median(synced):.3f} ms/write, none {statistics.median(plain):.3f} ms/write, "
          f"cost {statistics.median(synced) - statistics.median(plain):.3f} ms/write")


if __name__ == "__main__":
    main()
