"""A ZeRO-3 resize without a universal conversion: each new rank reads, by byte range, the slices
of the old ranks' parameter partitions that make up its new ones, and nothing else.

Why by hand: as for ZeRO-1/2 (tidal.worker.checkpoint.repartition), DeepSpeed resizes ZeRO-3 only through
its universal format, a conversion that reads and writes the whole state (spread over the ranks
here, tidal.worker.checkpoint.universal_spread, with several times a node's share on its disk at once).

What makes it exact (DeepSpeed's `stage3.py` and `partition_parameters.py`, checked against
0.19.8): every parameter is partitioned alone, padded to a multiple of the world: rank r holds its
elements `[r*P, (r+1)*P)`, P = ceil(numel / world). A param group's parameters are cut, in order,
into sub-groups that close once their partitions reach `sub_group_size` elements
(`_create_fp16_sub_groups`), and a rank's fp32 master weights and every optimizer state shaped
like them (Adam's moments) are, per sub-group, its partitions of the sub-group's parameters end to
end (`layout`). Partitions shrink as ranks are added, so the sub-groups themselves change with the
world: a new sub-group is built parameter by parameter, each new partition a concatenation of
slices of old ones (`pieces`, pure), each slice one byte range of an old rank's file.

The fetching and copying are ZeRO-1/2's (`repartition.restore`, the skeleton both share; `cut`
is ZeRO-3's part). DeepSpeed's own loader then takes the state it would have saved at the new size:
`engine.load_checkpoint` reads the model and optimizer states through the engine's checkpoint
engine, which here serves this rank's, assembled in memory (`safe_load.safe_loading`'s `served`),
so nothing is written twice. The model states are old rank 0's with the new world size: under ZeRO-3 they hold no
weights (placeholders; the parameters are restored from the fp32 partitions), only the steps,
the LR scheduler and the client state, the same on every rank. Frozen parameters are saved as
per-rank fragments of the model states; a checkpoint that may hold some (its `frozen_params` not
0) resizes through the universal conversion (`route.by_range`).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tidal import fs
from tidal.errors import CheckpointError
from tidal.worker.checkpoint import safe_load
from tidal.worker.checkpoint.repartition import COPIES, Cut, Find, shaped

log = logging.getLogger("tidal")

ZERO_STATE = "optimizer_state_dict"  # in a saved ZeRO-3 state: the torch optimizer's state dict
FP32 = "fp32_flat_groups"  # and the fp32 master partition of each sub-group


def model_states(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


@dataclass(frozen=True)
class Slot:
    """Where a parameter's partition sits at one world size: sub-group `group`, element `offset`."""

    group: int
    offset: int


@dataclass(frozen=True)
class Piece:
    """Elements `[lo, hi)` of old rank `old`'s sub-group `group` go to element `at` of this rank's
    new sub-group `to`."""

    old: int
    group: int
    lo: int
    hi: int
    to: int
    at: int


def layout(groups: list[list[int]], world: int, sub_group_size: int | None) -> tuple[list[Slot], list[int]]:
    """Each parameter's slot (in order across the param groups, whose parameters' element counts
    are `groups`) and each sub-group's partition length at `world`, as DeepSpeed cuts them."""
    slots: list[Slot] = []
    sizes: list[int] = []
    for numels in groups:
        parts = [math.ceil(n / world) for n in numels]
        whole = sub_group_size is None or sub_group_size >= sum(parts)
        filled = 0
        for i, part in enumerate(parts):
            slots.append(Slot(len(sizes), filled))
            filled += part
            if i == len(parts) - 1 or (not whole and filled >= sub_group_size):
                sizes.append(filled)
                filled = 0
    return slots, sizes


def pieces(numels: list[int], old: list[Slot], new: list[Slot], old_world: int, world: int,
           rank: int) -> list[Piece]:
    """What rank `rank` of `world` holds of every parameter, as slices of the old ranks' sub-groups;
    the rest of its partitions is padding (zeros)."""
    out = []
    for n, was, now in zip(numels, old, new, strict=True):
        old_p, new_p = math.ceil(n / old_world), math.ceil(n / world)
        lo, hi = min(rank * new_p, n), min((rank + 1) * new_p, n)
        for d in range(lo // old_p, math.ceil(hi / old_p)) if hi > lo else ():
            start, end = max(lo, d * old_p), min(hi, (d + 1) * old_p)
            out.append(Piece(d, was.group, was.offset + start - d * old_p, was.offset + end - d * old_p,
                             now.group, now.offset + start - rank * new_p))
    return out


def cut(engine: Any, old_world: int) -> Cut:
    """ZeRO-3's cut for `repartition.restore`: every parameter's partition, `pieces` of the old
    ones, in sub-groups cut anew at this size. DeepSpeed's loader takes the states assembled here,
    served from memory (`safe_load.safe_loading`'s `served`)."""
    opt = _zero3_optimizer(engine)
    group = opt.dp_process_group
    world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
    groups, owners = _param_groups(opt)
    numels = [n for g in groups for n in g]
    old, old_sizes = layout(groups, old_world, opt.sub_group_size)
    new, new_sizes = layout(groups, world, opt.sub_group_size)
    if new_sizes != [int(n) for n in opt.fp16_partitioned_groups_flat_numel]:
        raise CheckpointError(f"DeepSpeed cut this engine's ZeRO-3 sub-groups as {opt.fp16_partitioned_groups_flat_numel}"
                              f", not as Tidal plans ({new_sizes}): not the layout a direct resize reads")
    plan = pieces(numels, old, new, old_world, world, rank)

    def wanted(d: int) -> Find:
        ranges: dict[int, list[tuple[int, int]]] = {}
        for p in plan:
            if p.old == d:
                ranges.setdefault(p.group, []).append((p.lo, p.hi))
        return lambda tree: _partitioned(tree, ranges, old_sizes)

    def load(engine: Any, folder: str, step_tag: str, saved: dict[int, dict[str, Any]]) -> None:
        state = _assemble(saved, plan, new_sizes, owners, world)
        served = _served_folder(fs.join_local(folder, f"{COPIES}{world}-{rank}"), step_tag, rank)
        states = {model_states(rank): _model_states(fs.join_local(folder, f"{step_tag}/{model_states(0)}"), world),
                  **{name: {ZERO_STATE: state} for name in _optim_names(rank)}}
        with safe_load.safe_loading(engine, served=states):
            load_path, _ = engine.load_checkpoint(served, tag=step_tag, load_optimizer_states=True,
                                                  load_lr_scheduler_states=True)
        if load_path is None:
            raise CheckpointError(f"DeepSpeed found nothing to load under tag {step_tag}")

    return Cut(world, rank, model_states(0), sorted({p.old for p in plan}), wanted, load)


def _zero3_optimizer(engine: Any) -> Any:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    opt = engine.optimizer
    if not isinstance(opt, DeepSpeedZeroOptimizer_Stage3) or opt.swap_optimizer or opt.params_in_nvme_and_cpu:
        raise CheckpointError(f"a direct ZeRO-3 resize needs DeepSpeed's ZeRO-3 optimizer without NVMe offload; "
                              f"this engine has {type(opt).__name__}")
    return opt


def _param_groups(opt: Any) -> tuple[list[list[int]], list[int]]:
    """Each param group's parameters' element counts, in DeepSpeed's order, and each of this
    engine's sub-groups' param group (`sub_group_to_group_id`)."""
    owners = [int(opt.sub_group_to_group_id[j]) for j in range(len(opt.fp16_groups))]
    groups: list[list[int]] = [[] for _ in range(max(owners) + 1)] if owners else []
    for j, sub_group in enumerate(opt.fp16_groups):
        if owners[j] < max(owners[:j], default=0):
            raise CheckpointError("DeepSpeed's ZeRO-3 sub-groups are not in param group order")
        groups[owners[j]] += [int(p.ds_numel) for p in sub_group]
    return groups, owners


def _partitioned(tree: Any, wanted: dict[int, list[tuple[int, int]]],
                 sizes: list[int]) -> list[tuple[torch.Tensor, list[tuple[int, int]]]]:
    """Of a saved ZeRO-3 state (`tree`, meta tensors), each sub-group's fp32 partition and each
    partition-shaped optimizer state, with the elements of it wanted."""
    sd = tree.get(ZERO_STATE) if isinstance(tree, dict) else None
    base = sd.get(ZERO_STATE) if isinstance(sd, dict) else None
    if not isinstance(base, dict) or not isinstance(sd.get(FP32), list):
        raise CheckpointError("the file holds no ZeRO-3 optimizer state")
    held = [t.numel() if isinstance(t, torch.Tensor) else None for t in sd[FP32]]
    if held != sizes:
        raise CheckpointError(f"the checkpoint's ZeRO-3 sub-groups hold {held} elements where this model cut at its "
                              f"world size holds {sizes}: saved with another model or sub_group_size")
    out = [(t, wanted.get(k, [])) for k, t in enumerate(sd[FP32])]
    for k, group_state in base.get("state", {}).items():
        out += [(t, wanted.get(k, [])) for t in group_state.values() if shaped(t, sizes[k])]
    return out


def _assemble(saved: dict[int, dict[str, Any]], plan: list[Piece], sizes: list[int], owners: list[int],
              world: int) -> dict[str, Any]:
    """The state DeepSpeed would have saved for this rank at `world` (`_rigid_state_dict`), from the
    old ranks' saved states: partitioned tensors rebuilt from their pieces, the rest copied from
    the old sub-group that gives a new one its first piece (equal on every rank and sub-group)."""
    first = saved[min(saved)]
    dtype = first[FP32][0].dtype
    fp32 = [torch.zeros(n, dtype=dtype) for n in sizes]
    source: dict[int, tuple[int, int]] = {}  # new sub-group -> (old rank, old sub-group) of its first piece
    for p in plan:
        fp32[p.to][p.at:p.at + p.hi - p.lo] = _part(saved[p.old][FP32][p.group], p)
        source.setdefault(p.to, (p.old, p.group))
    state: dict[int, dict[str, Any]] = {}
    for j, n in enumerate(sizes):
        # A sub-group this rank holds only padding of (parameters smaller than the world) takes
        # its state's keys and step from any old one; its partitioned tensors stay zeros.
        d, k = source.get(j, (min(saved), 0))
        old_state = saved[d][ZERO_STATE]["state"].get(k)
        if old_state is None:
            continue  # no optimizer state yet (saved before a first step)
        # Each sub-group its own tensors: torch's Adam adds 1 to `step` in place, per sub-group.
        state[j] = {key: torch.zeros(n, dtype=v.dtype) if shaped(v, len(saved[d][FP32][k]))
                    else v.clone() if isinstance(v, torch.Tensor) else v for key, v in old_state.items()}
    for p in plan:
        for key, value in state.get(p.to, {}).items():
            if shaped(value, sizes[p.to]):
                value[p.at:p.at + p.hi - p.lo] = _part(saved[p.old][ZERO_STATE]["state"][p.group][key], p)
    param_groups = [{**g, "params": [j for j, owner in enumerate(owners) if owner == i]}
                    for i, g in enumerate(first[ZERO_STATE]["param_groups"])]
    return {**{k: v for k, v in first.items() if k not in (ZERO_STATE, FP32)}, "partition_count": world,
            ZERO_STATE: {"state": state, "param_groups": param_groups}, FP32: fp32}


def _part(src: torch.Tensor, p: Piece) -> torch.Tensor:
    if src.dim() != 1 or p.hi > src.numel():
        raise CheckpointError(f"old rank {p.old}'s sub-group {p.group} holds {src.numel()} elements; a slice up to "
                              f"{p.hi} was planned: not the layout this model saves")
    return src[p.lo:p.hi]


def _model_states(path: str, world: int) -> dict[str, Any]:
    """Old rank 0's model states (weights-only), as DeepSpeed would have saved them at `world`."""
    states = safe_load.safe_load(path)
    if not isinstance(states, dict) or "dp_world_size" not in states:
        raise CheckpointError(f"{os.path.basename(path)} holds no DeepSpeed model states")
    if states.get("frozen_param_fragments"):
        raise CheckpointError("the checkpoint holds frozen parameters' ZeRO-3 fragments, which a direct resize "
                              "does not cut; set checkpoint.resize: universal to resize it through a conversion")
    return {**states, "dp_world_size": world}


def _optim_names(rank: int) -> list[str]:
    return [f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for prefix in ("", "bf16_")]


def _served_folder(here: str, step_tag: str, rank: int) -> str:
    """A folder whose tag folder holds an empty file named as this rank's model states: DeepSpeed
    finds its checkpoint by listing (`glob`) before it reads anything served."""
    folder = os.path.join(here, "served")
    os.makedirs(os.path.join(folder, step_tag), exist_ok=True)
    open(os.path.join(folder, step_tag, model_states(rank)), "wb").close()
    return folder
