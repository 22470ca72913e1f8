"""Save a real DeepSpeed ZeRO checkpoint from a small data-parallel group, one process per rank:
`python -m tests.zero_checkpoint OUT STAGE RANK WORLD PORT [WIDTH]`. The model's parameters are sized so
the flat partitions cut through them (a parameter's fragments come from several ranks), and one
parameter never gets a gradient (ZeRO-1/2 keep no optimizer state for it). Under ZeRO-3 its
sub-groups are small, so they change with the world size as a large model's do."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import nn


class Small(nn.Module):
    def __init__(self, width: int = 13) -> None:
        super().__init__()
        self.a = nn.Linear(7, width)
        self.b = nn.Linear(width, 5)
        self.idle = nn.Parameter(torch.ones(3))  # unused in forward: no gradient, ever

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def join_group(rank: int, world: int, port: int) -> None:
    """This process as rank `rank` of a gloo group of `world` on 127.0.0.1:`port`."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import deepspeed

    from tidal.worker.device import skip_cpu_shm_allreduce

    skip_cpu_shm_allreduce()  # as Tidal's engine does: no op compiled on a CPU
    deepspeed.init_distributed("gloo", auto_mpi_discovery=False)


def engine(stage: int, load_universal: bool = False, width: int = 13) -> Any:
    """A DeepSpeed engine over `Small`, the same initial weights on every rank."""
    import deepspeed

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              # ZeRO-3: sub-groups small enough that they are cut differently at 1 and 2 ranks
              "zero_optimization": {"stage": stage, **({"sub_group_size": 4 * width} if stage == 3 else {})},
              "steps_per_print": 10**9,
              "checkpoint": {"load_universal": load_universal}}
    return deepspeed.initialize(model=Small(width), config=config)[0]


def train(engine: Any, rank: int, steps: int = 2) -> list[float]:
    """`steps` steps on this rank's own batches; the losses."""
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(steps):
        loss = engine(torch.randn(2, 7, generator=g)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def main(out: str, stage: int, rank: int, world: int, port: int, width: int = 13) -> None:
    join_group(rank, world, port)
    saver = engine(stage, width=width)
    train(saver, rank)
    # what Tidal saves beside the state (tidal.worker.checkpoint.save): DeepSpeed converts nothing without it
    saver.save_checkpoint(out, tag="global_step2",
                           client_state={"universal_checkpoint_info": {"universal_checkpoint_version": 0.4}})
    # End the group before the interpreter does: a gloo thread still joinable at exit aborted a rank
    # ("terminate called without an active exception", exit -6) once in the extended run of 2026-12-06.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:]))
