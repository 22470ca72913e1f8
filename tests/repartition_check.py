"""One rank of a resized ZeRO load (stage 1, 2 or 3), done both ways, for tests/test_repartition.py:
`python -m tests.repartition_check URI OLD_WORLD STAGE RANK WORLD PORT WIDTH`.

The checkpoint under URI (a folder or s3:// prefix holding `global_step2`, written by
tests.zero_checkpoint at OLD_WORLD ranks) is loaded into one engine by Tidal's direct repartition
(tidal.worker.checkpoint.repartition, ZeRO-3: repartition_zero3) and into another through DeepSpeed's universal path (Tidal's spread
conversion, then DeepSpeed's universal loader). Prints one JSON line: what differs between the
two engines' states (module, fp32 master partition, optimizer state), the losses of two more
steps of each and Adam's step count in every partition after them, the bytes the direct load
read from storage per file, and what a second direct load on this node (a restart whose node
lived) read."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from tests.zero_checkpoint import engine, join_group, train
from tidal import fs
from tidal.storage import Found
from tidal.worker.checkpoint import repartition, repartition_zero3, restore, universal
from tidal.worker.checkpoint.route import Convert, Load, Route

TAG = "global_step2"


def state_of(e) -> dict[str, torch.Tensor]:
    """The state a step reads: the module's weights (under ZeRO-3 this rank's partitions of them),
    the fp32 master partition, the optimizer's."""
    out = {f"module/{k}": v for k, v in e.module.state_dict().items()}
    opt = e.optimizer
    zero3 = e.zero_optimization_stage() == 3
    for i, part in enumerate(opt.fp16_partitioned_groups_flat if zero3 else []):
        out[f"module/partition/{i}"] = part.detach().clone()
    for i, part in enumerate(opt.fp32_partitioned_groups_flat if zero3 else opt.single_partition_of_fp32_groups):
        out[f"fp32/{i}"] = part.detach().clone()
        for key, value in opt.optimizer.state[part].items():
            out[f"state/{i}/{key}"] = torch.as_tensor(value).clone()
    return out


def main(uri: str, old_world: int, stage: int, rank: int, world: int, port: int, width: int) -> None:
    join_group(rank, world, port)
    store, base = fs.resolve(uri)
    files = {f"{TAG}/{rel}": size for rel, size in fs.files_under(store, f"{base}/{TAG}").items()}
    found = Found(base, store, {"step": 2, "world_size": old_world, "zero_stage": stage, "attempt": "a"}, files)
    listed = restore.tag_files(found, TAG)

    cut = repartition_zero3.cut if stage == 3 else repartition.zero12
    direct = engine(stage, width=width)
    got = repartition.restore(direct, found, TAG, listed, "check", cut(direct, old_world))
    dist.barrier()  # every rank's first load done: the node's copies are all there
    again_engine = engine(stage, width=width)
    again = repartition.restore(again_engine, found, TAG, listed, "check", cut(again_engine, old_world))

    if rank == 0:
        universal.prepare(found, TAG)
    dist.barrier()
    converted = engine(stage, load_universal=True, width=width)
    restore.restore(converted, found, Route(Load.UNIVERSAL_ZERO3 if stage == 3 else Load.UNIVERSAL, Convert.SPREAD))

    a, b = state_of(direct), state_of(converted)
    differ = sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))
    print(json.dumps({"differ": differ, "keys": sorted(a), "losses_direct": train(direct, rank),
                      "losses_universal": train(converted, rank), "read": got.downloaded,
                      "reread": again.downloaded, "steps_direct": adam_steps(direct),
                      "steps_universal": adam_steps(converted)}))


def adam_steps(e) -> list[float]:
    """Each partition's Adam step count (its bias correction), read after training."""
    return [float(s["step"]) for s in e.optimizer.optimizer.state.values() if "step" in s]


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:]))
