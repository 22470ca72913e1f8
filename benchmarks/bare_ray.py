"""The middle baseline: plain_deepspeed.py's loop, unchanged, inside a bare Ray Train V2
`TorchTrainer` (2 workers x 1 CPU, gloo, a local Ray instance), with none of Tidal: no tracker,
no reports, no checkpoints. Prints one JSON line with rank 0's timings.

    python -m benchmarks.bare_ray SPEC.yaml
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
from pathlib import Path

import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

ROOT = Path(__file__).resolve().parents[1]


def worker(config: dict[str, str]) -> None:
    from benchmarks.plain_deepspeed import train

    result = train(config["spec"])
    if result is not None:
        Path(config["out"]).write_text(json.dumps(result))


def main(spec_path: str) -> None:
    ray.init(address="local", logging_level=logging.WARNING, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT / "platform") + ":" + str(ROOT)}})
    try:
        with tempfile.TemporaryDirectory() as d:
            out = Path(d) / "result.json"
            TorchTrainer(
                worker,
                train_loop_config={"spec": str(Path(spec_path).resolve()), "out": str(out)},
                scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
                torch_config=TorchConfig(backend="gloo"),
                run_config=RunConfig(name="bare", storage_path=d),
            ).fit()
            print(out.read_text(), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
