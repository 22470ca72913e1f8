"""What the operator telemetry costs in throughput: `tidal run` with it (the default) and with
TIDAL_TELEMETRY=0 (no Prometheus gauges; since 2026-12-02 the straggler handling and its comms sampling
stay on, as failure handling: failure.straggler_*), same work, runs alternating so drift in the machine
hits both alike; every pair is reported.

    python -m benchmarks.telemetry_overhead [--pairs 4] [--steps 80]
"""

from __future__ import annotations

import platform as pyplatform
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import (
    median,
    pair_args,
    settle,
    update_doc,
    write_spec,
)
from benchmarks.throughput import bench_spec
from benchmarks.throughput import tidal as timed_tidal_run


def step_s(spec_path: Path, spec) -> float:  # noqa: ANN001 - a JobSpec
    """Seconds per step of one `tidal run`, timed as benchmarks/throughput.py times it."""
    settle()
    return timed_tidal_run(spec, spec_path)["step_s"]


def main() -> None:
    args = pair_args(__doc__)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        on = bench_spec(tmp, args.steps).with_overrides({"name": "bench-telemetry-on"})
        off = on.with_overrides({"name": "bench-telemetry-off", "worker_env": {"TIDAL_TELEMETRY": "0"}})
        on_path, off_path = write_spec(on, tmp / "on.yaml"), write_spec(off, tmp / "off.yaml")
        pairs = []
        for i in range(args.pairs):
            first_on = i % 2 == 0  # alternate which goes first, too
            a = step_s(on_path, on) if first_on else step_s(off_path, off)
            b = step_s(off_path, off) if first_on else step_s(on_path, on)
            pair = (a, b) if first_on else (b, a)
            pairs.append(pair)
            print(f"pair {i + 1}: telemetry on {pair[0] * 1000:.1f} ms/step, off {pair[1] * 1000:.1f} ms/step, "
                  f"throughput on/off {pair[1] / pair[0]:.3f}", flush=True)
    ratios = [b / a for a, b in pairs]
    rows = "\n".join(f"| {i + 1} | {a * 1000:.1f} | {b * 1000:.1f} | {r:.3f} |" for i, ((a, b), r) in
                     enumerate(zip(pairs, ratios, strict=True)))
    body = f"""Command: `python -m benchmarks.telemetry_overhead --pairs {args.pairs} --steps {args.steps}` ({time.strftime('%Y-%m-%d')}, {pyplatform.machine()}, {torch.get_num_threads()} threads, CPU only)

Work: as in the throughput benchmark (GPT 4 layers x d256, ZeRO-2, fp32, 2 workers, log every 10 steps), {args.steps} steps;
`tidal run` with the telemetry (Prometheus gauges, straggler all-gather, comms logger on one step per log interval)
against `env: {{TIDAL_TELEMETRY: "0"}}`, alternating, which one goes first alternating too.

| pair | on (ms/step) | off (ms/step) | throughput on / off |
|---|---|---|---|
{rows}

Median throughput ratio on / off: **{median(ratios):.3f}** (goal: above 0.99).
"""
    update_doc("Overhead of the operator telemetry", body)
    print(body)


if __name__ == "__main__":
    main()
