"""The baseline: the same model, data and DeepSpeed config as a Tidal job, trained by a bare loop
under torchrun, with no Ray and no Tidal. Prints one JSON line with its timings.

    torchrun --nproc-per-node 2 -m benchmarks.plain_deepspeed SPEC.yaml
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from benchmarks.common import engine_state, torch_save_fsync
from tidal.spec.deepspeed import ds_config
from tidal.spec.load import load_spec
from tidal.worker.data import Batches
from tidal.worker.models import build_model

WARMUP = 10  # steps left out of the timing: allocator, JIT and first-touch costs
TAIL = 10  # nor the last 10: a Tidal run's timing ends there, before its final checkpoint, and
# every kind of run must time the same steps (the later steps of a run are not the earlier's)


def train(path: str) -> dict[str, float] | None:
    """The loop, timed; rank 0 returns its timings. Brings up the process group unless the caller
    (Ray Train, in benchmarks/bare_ray.py) already has."""
    spec = load_spec(path)
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(spec.train.seed)
    model = build_model(spec.model)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params,  # as tidal.worker.engine does
                                      config=ds_config(spec, world, on_gpu=False, trainable_params=sum(p.numel() for p in params)))
    batches = Batches(spec, rank, world, torch.device("cpu"))
    last = spec.train.steps - TAIL
    t_start = warm_at = elapsed = 0.0
    for step in range(1, spec.train.steps + 1):
        if step == WARMUP + 1:
            dist.barrier()
            t_start, warm_at = time.perf_counter(), time.time()  # warm_at: step WARMUP done, wall clock
        for tokens, targets in batches.for_step(step):
            loss = engine(tokens, targets)
            engine.backward(loss)
            engine.step()
        if step == last:
            dist.barrier()
            elapsed = time.perf_counter() - t_start
    dist.barrier()
    save_s = torch_save_fsync(engine_state(engine), Path(f"/tmp/plain-ds-{os.getpid()}.pt"))[0] if rank == 0 else 0.0
    if rank != 0:
        return None
    steps = last - WARMUP
    return {"steps": steps, "seconds": elapsed, "step_s": elapsed / steps, "torch_save_s": save_s, "loss": loss.item(),
            "warm_at": warm_at}


if __name__ == "__main__":
    if (result := train(sys.argv[1])) is not None:
        print(json.dumps(result), flush=True)
