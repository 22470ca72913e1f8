"""What the goodput account costs in throughput: `tidal run` with it (the default) and with
TIDAL_GOODPUT=0 (the job's tracker keeps no account: it folds no event into it and sends no
`goodput*` metric), same work, runs alternating, which one goes first alternating too; every pair
is reported. The workers' share of the account (one `group_started` event a group, a first step's
time in the next log step's metrics) is there in both: it is part of the events Tidal writes anyway.

    python -m benchmarks.goodput_overhead [--pairs 4] [--steps 80]
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from benchmarks.common import median, pair_args, paired_rounds, settle, update_doc, write_spec
from benchmarks.throughput import bench_spec
from benchmarks.throughput import tidal as timed_tidal_run
from tidal.goodput.account import OFF_VAR

KINDS = ("on", "off")


def main() -> None:
    args = pair_args(__doc__)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        # log every step: the account's per-step work (folding each metrics event, the goodput so far
        # on each step sent to MLflow) at its most
        spec = bench_spec(tmp, args.steps).with_overrides({"name": "bench-goodput", "train.log_every": 1})
        path = write_spec(spec, tmp / "job.yaml")

        def step_s(i: int, kind: str) -> float:
            settle()
            return timed_tidal_run(spec, path, {OFF_VAR: "0"} if kind == "off" else None)["step_s"]

        pairs = paired_rounds(
            args.pairs, KINDS, step_s, lambda p: {"ratio": p["off"] / p["on"]},
            lambda i, p: (f"pair {i + 1}: account on {p['on'] * 1000:.1f} ms/step, off {p['off'] * 1000:.1f} ms/step, "
                          f"throughput on/off {p['ratio']:.3f}"))
    ratios = [p["ratio"] for p in pairs]
    rows = "\n".join(f"| {i + 1} | {p['on'] * 1000:.1f} | {p['off'] * 1000:.1f} | {r:.3f} |"
                     for i, (p, r) in enumerate(zip(pairs, ratios, strict=True)))
    body = f"""Command: `python -m benchmarks.goodput_overhead --pairs {args.pairs} --steps {args.steps}` ({time.strftime('%Y-%m-%d')}, 2-core CPU machine, CPU only)

Work: the throughput benchmark's job (GPT 4 layers x d256, ZeRO-2, fp32, 2 workers) for {args.steps} steps, logging every
step (the account's work at its most: each step's event folded, its goodput so far sent to MLflow); `tidal run`
with the account (the default) against `TIDAL_GOODPUT=0` in its environment, alternating, which one goes first
alternating too. Seconds a step: rank 0's wall clock from step 11 to step N-10, as in the throughput benchmark.

| pair | on (ms/step) | off (ms/step) | throughput on / off |
|---|---|---|---|
{rows}

Median throughput ratio on / off: **{median(ratios):.3f}** (the claim: within the noise; the pairs spread
{min(ratios):.3f}-{max(ratios):.3f}).
"""
    update_doc("Overhead of the goodput account", body)
    print(body)


if __name__ == "__main__":
    main()
