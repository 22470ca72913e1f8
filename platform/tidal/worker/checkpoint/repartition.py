"""A ZeRO-1/2 resize without a universal conversion: each new rank reads, by byte range, the
parts of the old ranks' optimizer partitions that make up its new one, and nothing else.

Why by hand: DeepSpeed resizes a ZeRO checkpoint either through its universal format (a
conversion that reads, cuts and writes the whole state, then a load that reads it again: about
half a resize's time at 1.5 GB here, `docs/benchmarks.md`) or through `elastic_checkpoint`,
where every rank loads every old partition whole. Neither keeps a rank's reads to its share.

What makes it exact (DeepSpeed's `stage_1_and_2.py`, checked against 0.19.8): a param group is
flattened in the same order at every world size (`round_robin_gradients` off), each parameter
padded by an alignment that does not depend on the world, and only the group's end padded, to a
multiple of 2 x world; rank r holds `[r*P, (r+1)*P)` of that flat vector (P = padded length /
world). So a new partition is a concatenation of slices of old ones (`pieces`, pure). Each slice
of the fp32 master weights and of every optimizer state shaped like them (Adam's moments, SGD's
momentum) is one byte range of an old rank's file: torch.save archives are stored uncompressed
(tidal.worker.checkpoint.share). A rank copies those ranges and the archive's small records into a sparse
local file of the original's layout, loads it weights-only (never trusting storage), cuts its
slices, and hands DeepSpeed's own loader the state DeepSpeed would have saved at the new size.

The model states file (the module, the LR scheduler, the step counters) does not depend on the
world size for ZeRO-1/2 and is loaded by DeepSpeed as at any resume, from the node's copy.
ZeRO-3 resizes the same way, parameter by parameter (tidal.worker.checkpoint.repartition_zero3),
through the same skeleton (`restore`, fetching and copying; each family's `Cut` says what to
cut and how DeepSpeed loads it). Checkpoints
this does not cover (pipeline or tensor parallel files, bf16 with ZeRO-1, which uses DeepSpeed's
BF16 optimizer, NVMe offload, round-robin gradients, elastic checkpoints, ZeRO-3 with frozen
parameters) resize through the universal conversion (tidal.worker.checkpoint.universal_spread) as before.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs
import torch

from tidal import fs
from tidal.errors import CheckpointError
from tidal.storage import Found
from tidal.worker.checkpoint import fetch, safe_load
from tidal.worker.checkpoint.route import MODEL_STATES, OPTIM
from tidal.worker.checkpoint.share import Edges, _data_start, meta_tree, write_sparse

log = logging.getLogger("tidal")
COPIES = ".repartition-"  # a new rank's sparse copies, in the node cache: `{COPIES}{world}-{rank}/`

ALIGNMENT = 2  # DeepSpeed's nccl_start_alignment_factor: a group's end is padded to 2 x world elements
OPTIMIZER_STATE = "optimizer_state_dict"  # the key DeepSpeed saves a ZeRO optimizer's state under
FP32 = "single_partition_of_fp32_groups"
BASE = "base_optimizer_state"


@dataclass(frozen=True)
class Piece:
    """Elements `[lo, hi)` of old rank `old`'s partition go to element `at` of the new one."""

    old: int
    lo: int
    hi: int
    at: int


def partition_size(numel: int, world: int) -> int:
    """A rank's partition of a group of `numel` elements (parameter paddings included) at `world`."""
    aligned = math.ceil(numel / (ALIGNMENT * world)) * ALIGNMENT * world
    return aligned // world


def pieces(numel: int, old_world: int, new_world: int, rank: int) -> list[Piece]:
    """What rank `rank` of `new_world` holds of a group of `numel` elements, as slices of the
    partitions of `old_world`; the rest of its partition is padding (zeros)."""
    old_p, new_p = partition_size(numel, old_world), partition_size(numel, new_world)
    lo, hi = min(rank * new_p, numel), min((rank + 1) * new_p, numel)
    out = []
    for d in range(lo // old_p, math.ceil(hi / old_p)) if hi > lo else ():
        start, end = max(lo, d * old_p), min(hi, (d + 1) * old_p)
        out.append(Piece(d, start - d * old_p, end - d * old_p, start - rank * new_p))
    return out


def optim_name(names: dict[str, int], old: int) -> str:
    """The file name (relative to the tag folder) of old rank `old`'s optimizer partition."""
    for rel in names:
        if (m := OPTIM.fullmatch(rel)) and int(m.group(2)) == old:
            return rel
    raise CheckpointError(f"the checkpoint lists no optimizer partition of rank {old}")


# What of a saved optimizer state's tree (meta tensors) a sparse copy holds: each partitioned
# tensor with the element ranges of it wanted; every other tensor is copied whole.
Find = Callable[[Any], list[tuple[torch.Tensor, list[tuple[int, int]]]]]


@dataclass(frozen=True)
class Cut:
    """One ZeRO family's part of a resize by byte range, for one new rank (`zero12` here,
    `repartition_zero3.cut`): what `restore`, the skeleton both share, fetches and how it loads."""

    world: int
    rank: int
    model_states: str  # the old model states file every new rank reads whole (tag-relative)
    olds: list[int]  # the old ranks whose partitions hold this rank's slices
    wanted: Callable[[int], Find]  # old rank d -> what of its saved state's partitioned tensors to copy
    # (engine, the node copy's folder, step tag, old rank -> its saved state): the state assembled
    # for this rank and handed to DeepSpeed's own loader
    load: Callable[[Any, str, str, dict[int, dict[str, Any]]], None]


def reads(cut: Cut, listed: dict[str, int]) -> dict[str, int]:
    """The files of `listed` (the tag folder's) a rank of `cut` reads: the model states and its old partitions."""
    names = [cut.model_states, *(optim_name(listed, d) for d in cut.olds or [0])]
    return {rel: listed[rel] for rel in names}


def restore(engine: Any, found: Found, step_tag: str, listed: dict[str, int], identity: str, cut: Cut,
            keep: bool = True) -> fetch.Fetched:
    """Load `found` (its tag folder's files: `listed`) into `engine` at this group's size, as `cut`
    says (`zero12(engine, old world)`, or `repartition_zero3.cut`); returns what this rank took
    from storage (bytes read, for its sparse copies). `keep`: leave the node's copies for a later
    restore (False for a source that is itself a copy, the memory tier's staged snapshot)."""
    old_world = int(found.state["world_size"])
    with fetch.NodeCache(f"{found.path}/{step_tag}#{identity}", name=f"{found.name}-{step_tag}", keep=keep) as cache:
        got = cache.fetch(found.fs, found.path, {f"{step_tag}/{cut.model_states}": listed[cut.model_states]})
        here = cache.path(f"{COPIES}{cut.world}-{cut.rank}")
        saved = {}
        for d in cut.olds or [0]:  # a rank that holds only padding still needs the optimizer's settings
            rel = optim_name(listed, d)
            saved[d] = sparse_copy(found, step_tag, rel, listed[rel], here, got, cut.wanted(d))
        log.info("Restore: %s/%s (pid %d), resized %d -> %d by byte range: %s",
                 found.name, step_tag, os.getpid(), old_world, cut.world, got.line())
        cut.load(engine, cache.dir, step_tag, saved)
    return got


def zero12(engine: Any, old_world: int) -> Cut:
    """ZeRO-1/2's cut: each param group's flat partition, `pieces` of the old ones. DeepSpeed
    loads the model states from the node's copy, and the optimizer the state assembled here."""
    opt = _zero_optimizer(engine)
    group = opt.dp_process_group
    world, rank = torch.distributed.get_world_size(group=group), torch.distributed.get_rank(group=group)
    numels = [group_numel(opt, i) for i in range(len(opt.single_partition_of_fp32_groups))]
    plan = [pieces(n, old_world, world, rank) for n in numels]

    def wanted(d: int) -> Find:
        ranges = {i: (p.lo, p.hi) for i, group_pieces in enumerate(plan) for p in group_pieces if p.old == d}
        return lambda tree: [(t, [ranges.get(i, (0, 0))]) for i, t in _partitioned_tensors(tree, numels, old_world)]

    def load(engine: Any, folder: str, step_tag: str, saved: dict[int, dict[str, Any]]) -> None:
        state = _assemble(opt, saved, plan, numels, old_world, world, rank)
        safe_load.check_files(fs.join_local(folder, step_tag), [MODEL_STATES])
        with safe_load.safe_loading(engine):  # the model states: weights-only
            load_path, _ = engine.load_checkpoint(folder, tag=step_tag, load_optimizer_states=False,
                                                  load_lr_scheduler_states=True)
        if load_path is None:
            raise CheckpointError(f"DeepSpeed found nothing to load under tag {step_tag}")
        # What DeepSpeed's `_load_zero_checkpoint` does with the list it reads, a rank reading its own entry only.
        opt.load_state_dict([state if r == rank else None for r in range(world)], load_optimizer_states=True,
                            load_from_fp32_weights=engine.zero_load_from_fp32_weights())

    olds = sorted({p.old for group_pieces in plan for p in group_pieces})
    return Cut(world, rank, MODEL_STATES, olds, wanted, load)


def group_numel(opt: Any, i: int) -> int:
    """The flat length of param group `i` before its end padding, the same at every world size."""
    return sum(m.numel() for m in opt.round_robin_bit16_meta[i]) + sum(opt.round_robin_bit16_padding[i])


def _zero_optimizer(engine: Any) -> Any:
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    opt = engine.optimizer
    if not isinstance(opt, DeepSpeedZeroOptimizer) or opt.round_robin_gradients or opt.elastic_checkpoint:
        raise CheckpointError(f"a direct ZeRO-1/2 resize needs DeepSpeed's ZeRO optimizer without round-robin "
                              f"gradients or elastic checkpoints; this engine has {type(opt).__name__}")
    return opt


def shaped(t: Any, n: int) -> bool:
    """A flat tensor of `n` elements: a partition, or optimizer state shaped like one."""
    return isinstance(t, torch.Tensor) and t.dim() == 1 and t.numel() == n


def sparse_copy(found: Found, step_tag: str, rel: str, size: int, here: str, got: fetch.Fetched,
                find: Find) -> dict[str, Any]:
    """An old rank's saved optimizer state, from a sparse local copy of its file `rel` that holds
    of each partitioned tensor only the elements `find` wants; loaded weights-only and
    memory-mapped, so the holes are never read.

    The copy stays on the node for the next restart at this size and rank, beside what it holds
    (`<copy>.wanted`: the element ranges `find` asked for). It is taken again only when the
    restart's `find` asks for the same, its layout checks run on it as on a new copy: a plan that
    reads other slices (another `sub_group_size`) would read the earlier copy's holes as zeros."""
    key = f"{step_tag}/{rel}"
    dst, where = fs.join_local(here, key), fs.join_in(found.fs, found.path, key)
    mark = f"{dst}.wanted"
    for _ in range(2):
        read = fetch.write_once(dst, size, where, lambda part: _copy_ranges(found.fs, where, part, size, find))
        loaded = safe_load.safe_load(dst, mmap=True)
        if not isinstance(loaded, dict) or not isinstance(loaded.get(OPTIMIZER_STATE), dict):
            raise CheckpointError(f"{rel} holds no ZeRO optimizer state")
        wanted = json.dumps([ranges for _, ranges in find(loaded)])  # the layout checks, on every load
        if read is not None:
            with open(mark, "w") as f:
                f.write(wanted)
        elif _read_text(mark) != wanted:  # this node's copy, cut for another plan: made again
            for stale in (mark, dst):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(stale)
            continue
        got.took(key, size, read)  # None: this node's copy, from an earlier attempt at this size and rank
        return loaded[OPTIMIZER_STATE]
    raise CheckpointError(f"the sparse copy of {rel} was cut for another plan twice in a row")


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


def _copy_ranges(storage: pafs.FileSystem, src: str, dst: str, size: int, find: Find) -> int:
    """Write `dst`: the archive `src` with every record whole but the partitioned tensors', of
    which only the wanted elements; returns the bytes read from storage."""
    with storage.open_input_file(src) as f:
        if f.size() != size:
            raise CheckpointError(f"{src} is {f.size():,} bytes in storage, its manifest says {size:,}")
        edges = Edges(f, size)
        ranges = _ranges(edges, size, find)
        need, free = sum(end - start for start, end in ranges), shutil.disk_usage(os.path.dirname(dst)).free
        if need > free:
            raise fetch.LocalDiskFull(f"resizing {src} needs {need:,} bytes of local disk in {os.path.dirname(dst)} "
                                      f"and {free:,} are free. Free space there, or point {fetch.CACHE_ENV} at a "
                                      "larger node-local folder; the checkpoint itself is sound and is kept.")
        write_sparse(edges, dst, size, ranges)
    return edges.fetched


def _ranges(f: Any, size: int, find: Find) -> list[tuple[int, int]]:
    """Byte ranges of the archive `f` to copy: every entry whole (headers, the pickle, small
    records), but of each partitioned tensor's record only its wanted elements."""
    archive = zipfile.ZipFile(f)
    infos = archive.infolist()
    if any(i.compress_type != zipfile.ZIP_STORED for i in infos):
        raise CheckpointError("a compressed optimizer partition: not a torch.save archive")
    pkl = [i for i in infos if i.filename.endswith("/data.pkl")]
    if len(pkl) != 1:
        raise CheckpointError("an optimizer partition without one pickle: not a torch.save archive")
    # Read by offset, not `archive.read`: Tidal's saves write no CRC (tidal.worker.checkpoint.snapshot), which zipfile would reject.
    f.seek(_data_start(f, pkl[0]))
    tree, keys = _meta_tree(f.read(pkl[0].compress_size))
    prefix = pkl[0].filename[:-len("data.pkl")]
    # A record may hold several tensors: Tidal's saves into an object store put every tensor of a
    # file in one host block (tidal.worker.checkpoint.snapshot). Of a record holding a partitioned tensor, each
    # tensor's bytes are copied (a partitioned one's wanted slices, any other whole), nothing else.
    partitioned = {id(t): wanted for t, wanted in find(tree)}
    parts: dict[str, list[tuple[int, int]]] = {}  # record name -> the byte ranges of it to copy
    sliced: set[str] = set()  # records holding a partitioned tensor
    for tensor in _tensors(tree):
        name = f"{prefix}data/{keys[tensor.untyped_storage()._cdata]}"
        item, first = tensor.element_size(), tensor.storage_offset()
        if id(tensor) in partitioned:
            sliced.add(name)
            elements = partitioned[id(tensor)]
        else:
            elements = [(0, _extent(tensor))]
        parts.setdefault(name, []).extend(((first + lo) * item, (first + hi) * item) for lo, hi in elements)
    out = [(archive.start_dir, size)]
    for info in infos:
        start = _data_start(f, info)
        if info.filename not in sliced:
            out.append((info.header_offset, start + info.compress_size))
        else:
            out += [(info.header_offset, start), *((start + lo, start + hi) for lo, hi in parts[info.filename])]
    return merged(out)


def merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """`ranges` sorted, those that touch or overlap joined: one read each from storage (a shrink's
    slices of consecutive parameters are end to end in the old partition)."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _extent(t: torch.Tensor) -> int:
    """Elements of its storage a tensor spans from its offset (a view: up to its last element)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))


def _meta_tree(pkl: bytes) -> tuple[Any, dict[int, str]]:
    """The archive's object with its tensors on the meta device and its storages' record keys
    (tidal.worker.checkpoint.share.meta_tree), the pickle read weights-only under Tidal's allow-list."""
    with safe_load.allowed():
        try:
            return meta_tree(pkl)
        except Exception as e:  # noqa: BLE001 - a pickle the weights-only reader refuses or cannot read
            raise safe_load.UnsafeCheckpointFile(f"an optimizer partition's pickle does not load weights-only: "
                                                 f"{type(e).__name__}: {str(e)[:200]}") from e


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v)]
    return []


def _partitioned_tensors(tree: Any, numels: list[int], old_world: int) -> list[tuple[int, torch.Tensor]]:
    """(group, tensor) for the fp32 partition and each partition-shaped optimizer state of each
    group in a saved ZeRO-1/2 optimizer state (`tree`, meta tensors)."""
    sd = tree.get(OPTIMIZER_STATE) if isinstance(tree, dict) else None
    if not isinstance(sd, dict) or not isinstance(sd.get(FP32), list) or not isinstance(sd.get(BASE), dict):
        raise CheckpointError("the file holds no ZeRO-1/2 optimizer state")
    if len(sd[FP32]) != len(numels):
        raise CheckpointError(f"the checkpoint has {len(sd[FP32])} param group(s), this model {len(numels)}")
    out = []
    for i, fp32 in enumerate(sd[FP32]):
        out.append((i, fp32))
        old_p = partition_size(numels[i], old_world)
        out += [(i, t) for t in sd[BASE].get("state", {}).get(i, {}).values() if shaped(t, old_p)]
    return out


def _assemble(opt: Any, saved: dict[int, dict[str, Any]], plan: list[list[Piece]], numels: list[int],
              old_world: int, world: int, rank: int) -> dict[str, Any]:
    """The state DeepSpeed would have saved for this rank at `world` (its rigid layout), from
    the old ranks' saved states: partitioned tensors rebuilt from their pieces, the rest copied
    from the first old rank read (equal on every rank)."""
    first = saved[min(saved)]
    base = first[BASE]
    state: dict[int, dict[str, Any]] = {}
    fp32: list[torch.Tensor] = []
    for i, numel in enumerate(numels):
        old_p, new_p = partition_size(numel, old_world), partition_size(numel, world)
        held = max(0, min(new_p, numel - rank * new_p))  # this rank's elements before the padding
        fp32.append(_gather(saved, plan[i], new_p, lambda sd, i=i: sd[FP32][i], old_p, numel)[:held].clone())
        group_state = {}
        for key, value in base["state"].get(i, {}).items():
            if shaped(value, old_p):
                group_state[key] = _gather(saved, plan[i], new_p, lambda sd, i=i, k=key: sd[BASE]["state"][i][k],
                                           old_p, numel)
            else:
                group_state[key] = value
        state[i] = group_state
    return {**{k: v for k, v in first.items() if k not in (BASE, FP32)},
            BASE: {"state": state, "param_groups": base["param_groups"]},
            FP32: fp32,
            "group_paddings": list(opt.groups_padding),
            "partition_count": opt.partition_count}


def _gather(saved: dict[int, dict[str, Any]], plan: list[Piece], new_p: int, get: Any, old_p: int,
            numel: int) -> torch.Tensor:
    """A new partition of `new_p` elements: each piece copied from its old rank's tensor, zeros elsewhere."""
    out: torch.Tensor | None = None
    for p in plan:
        src = get(saved[p.old])
        expected = old_p if src.numel() == old_p else max(0, min(old_p, numel - p.old * old_p))
        if src.dim() != 1 or src.numel() != expected or p.hi > src.numel():
            raise CheckpointError(f"old rank {p.old}'s partition holds {src.numel()} elements where "
                                  f"{expected} were expected: not the layout this model saves")
        if out is None:
            out = torch.zeros(new_p, dtype=src.dtype)
        out[p.at:p.at + p.hi - p.lo] = src[p.lo:p.hi]
    if out is None:  # this rank holds only padding
        out = torch.zeros(new_p, dtype=torch.float32)
    return out
