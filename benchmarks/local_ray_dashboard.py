"""What starting the local Ray instance without its dashboard gains (tidal.launch.connect's
local_ray_options): the throughput benchmark's `tidal run`, with TIDAL_RAY_DASHBOARD=1 (Ray's
dashboard, as a bare `ray.init()` starts it) and without (Tidal's default), runs alternating;
every pair is reported, with the launch time to step 10.

    python -m benchmarks.local_ray_dashboard [--pairs 4] [--steps 80]
"""

from __future__ import annotations

import os
import platform as pyplatform
import tempfile
import time
from pathlib import Path

from benchmarks.common import in_turn, median, pair_args, settle, update_doc, write_spec
from benchmarks.throughput import bench_spec, tidal
from tidal.launch.connect import DASHBOARD_ENV
from tidal.spec.job import JobSpec


def run(spec: JobSpec, path: Path, dashboard: bool) -> tuple[float, float]:
    """(ms per step over steps 11 to N-10, seconds from the command's start to step 10)."""
    settle()
    os.environ[DASHBOARD_ENV] = "1" if dashboard else "0"
    try:
        r = tidal(spec, path)
    finally:
        os.environ.pop(DASHBOARD_ENV)
    return r["step_s"] * 1000, r["launch_s"]


def main() -> None:
    args = pair_args(__doc__)
    with tempfile.TemporaryDirectory() as d:
        spec = bench_spec(Path(d), args.steps)
        path = write_spec(spec, Path(d) / "bench.yaml")
        pairs = []
        for i in range(args.pairs):
            order = in_turn(i, True, False)
            pairs.append({dash: run(spec, path, dash) for dash in order})
            p = pairs[-1]
            print(f"pair {i + 1}: with the dashboard {p[True][0]:.1f} ms/step (step 10 at {p[True][1]:.1f} s), "
                  f"without {p[False][0]:.1f} ms/step ({p[False][1]:.1f} s), speed-up {p[True][0] / p[False][0]:.3f}",
                  flush=True)
    rows = "\n".join(f"| {i + 1} | {p[True][0]:.1f} ms | {p[False][0]:.1f} ms | {p[True][0] / p[False][0]:.3f} "
                     f"| {p[True][1]:.1f} s | {p[False][1]:.1f} s |" for i, p in enumerate(pairs))
    speedup = median([p[True][0] / p[False][0] for p in pairs])
    body = f"""Command: `python -m benchmarks.local_ray_dashboard --pairs {args.pairs} --steps {args.steps}` ({time.strftime('%Y-%m-%d')}, {pyplatform.machine()}, 2 cores, CPU only)

Work: the throughput benchmark's `tidal run` (GPT 4 layers x d256, ZeRO-2, fp32, 2 workers x 1 CPU, a local
Ray instance), timed over steps 11-{args.steps - 10}; pairs alternate which goes first. With the dashboard
(`{DASHBOARD_ENV}=1`, what a bare `ray.init()` starts) and without it (Tidal's default since this change).

| pair | with Ray's dashboard | without (Tidal's default) | speed-up | to step 10, with | to step 10, without |
|---|---|---|---|---|---|
{rows}

Median speed-up: **{speedup:.3f}**."""
    update_doc("Ray's dashboard on a local instance", body)
    print(body)


if __name__ == "__main__":
    main()
