"""What sizing ZeRO's gradient bucket to the model gains (tidal.spec.deepspeed._reduce_bucket):
the throughput benchmark's job as a plain DeepSpeed loop under torchrun, with the bucket Tidal
derives and with DeepSpeed's default of 5e8 elements (set through `parallelism.deepspeed`), runs
alternating; every pair is reported, with the page faults of the run's processes.

    python -m benchmarks.reduce_bucket [--pairs 4] [--steps 80]
"""

from __future__ import annotations

import platform as pyplatform
import resource
import tempfile
import time
from pathlib import Path

from benchmarks.common import in_turn, median, pair_args, update_doc, write_spec
from benchmarks.throughput import bench_spec, plain
from tidal.spec.deepspeed import DEEPSPEED_REDUCE_BUCKET


def run(path: Path) -> tuple[float, int]:
    """(ms per step, minor page faults of the whole run: both ranks, start-up included)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
    step_s = plain(path)["step_s"]
    return step_s * 1000, resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - before


def main() -> None:
    args = pair_args(__doc__)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        sized = bench_spec(tmp, args.steps)
        default = sized.model_copy(update={"parallelism": sized.parallelism.model_copy(
            update={"deepspeed": {"zero_optimization": {"reduce_bucket_size": DEEPSPEED_REDUCE_BUCKET}}})})
        paths = {"sized": write_spec(sized, tmp / "sized.yaml"), "default": write_spec(default, tmp / "default.yaml")}
        pairs = []
        for i in range(args.pairs):
            order = in_turn(i, "default", "sized")
            pairs.append({k: run(paths[k]) for k in order})
            p = pairs[-1]
            print(f"pair {i + 1}: DeepSpeed's bucket {p['default'][0]:.1f} ms/step ({p['default'][1]:,} faults), "
                  f"sized to the model {p['sized'][0]:.1f} ms/step ({p['sized'][1]:,} faults), "
                  f"speed-up {p['default'][0] / p['sized'][0]:.3f}", flush=True)
    rows = "\n".join(f"| {i + 1} | {p['default'][0]:.1f} ms | {p['sized'][0]:.1f} ms | {p['default'][0] / p['sized'][0]:.3f} "
                     f"| {p['default'][1]:,} | {p['sized'][1]:,} |" for i, p in enumerate(pairs))
    speedup = median([p["default"][0] / p["sized"][0] for p in pairs])
    body = f"""Command: `python -m benchmarks.reduce_bucket --pairs {args.pairs} --steps {args.steps}` ({time.strftime('%Y-%m-%d')}, {pyplatform.machine()}, 2 cores, CPU only)

Work: the throughput benchmark's job (GPT 4 layers x d256, 3.3M parameters, ZeRO-2, fp32, 2 ranks) as a plain
DeepSpeed loop under torchrun, timed over steps 11-{args.steps - 10}; pairs alternate which goes first.
ZeRO-1/2 allocate a new gradient bucket of `reduce_bucket_size` elements every step; DeepSpeed's default is 5e8
(2 GB in fp32), Tidal sizes it to the model's trainable parameters.

| pair | DeepSpeed's bucket (5e8) | sized to the model | speed-up | page faults, DeepSpeed's | page faults, sized |
|---|---|---|---|---|---|
{rows}

Median speed-up: **{speedup:.3f}**. Page faults count both ranks' whole run, start-up included."""
    update_doc("ZeRO gradient bucket sized to the model", body)
    print(body)


if __name__ == "__main__":
    main()
