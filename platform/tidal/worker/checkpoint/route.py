"""Which way a checkpoint loads into a worker group: one pure decision of the checkpoint's layout and the spec.

A checkpoint loads one of six ways, and `decide` picks it once, on rank 0, before the engine is
built (`restore.agree_on_resume_point` hands the `Route` to every rank with the checkpoint):
- as saved: DeepSpeed's own load of each rank's files, at the world size that wrote them (or a
  ZeRO stage 0 checkpoint, whole on every rank, at any size);
- by byte range, ZeRO-1/2 (tidal.worker.checkpoint.repartition) or ZeRO-3
  (tidal.worker.checkpoint.repartition_zero3): each new rank reads the slices of the old
  partitions that make up its new one, nothing converted;
- through DeepSpeed's universal format, for what a by-range load does not cover, converted once
  and published: spread over every rank (tidal.worker.checkpoint.universal_spread) for a plain
  data-parallel checkpoint, else on rank 0 alone (tidal.worker.checkpoint.universal); a ZeRO-3
  engine then reads only its slice of each universal file (tidal.worker.checkpoint.share).

Before any of those, `from_memory` decides whether the group resumes from the memory tier's newest
complete snapshot (tidal.worker.checkpoint.memory) rather than storage: the newest of the two wins.
A snapshot holds the very files a checkpoint of its step holds, so it loads the ways those files
load without a conversion: as saved at the world size that wrote it (each rank its own shard,
served from the keepers), or by byte range at another size (the shards a new rank's partition
comes from, fetched from the keepers). What only a universal conversion loads reads storage.

| the newest complete copy | the world size | how it loads |
|---|---|---|
| a memory snapshot, newer than (or as new as) storage's checkpoint | unchanged | as saved, from the keepers |
| a memory snapshot | changed, `by_range` | by byte range, from the keepers |
| a memory snapshot | changed, otherwise | not from memory: storage's checkpoint, by `decide` |
| storage's checkpoint | unchanged / changed | `decide`: as saved / by range / universal |

A ZeRO-3 checkpoint whose partitions were cut at another `sub_group_size` than the spec's (`recut`)
loads only through the universal conversion, at any world size, and never from memory.

Nothing here reads storage, imports torch or asks the engine: the layout is what rank 0 read in
the checkpoint's state file and listing, the rest is the spec and the new world size.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Any

from tidal.spec.deepspeed import ds_config, sub_group_size
from tidal.spec.job import JobSpec

# File names in a DeepSpeed tag folder, relative to it (checked against 0.19.8).
MODEL_STATES = "mp_rank_00_model_states.pt"  # ZeRO-1/2's, one for every rank
ZERO3_MODEL_STATES = re.compile(r"zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt")
OPTIM = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt")
# Any model-parallel rank: a tensor-parallel checkpoint's files carry mp_rank 01 and up.
ANY_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
ANY_MODEL = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")


class Load(enum.Enum):
    AS_SAVED = "as saved"
    RANGE_ZERO12 = "by byte range (ZeRO-1/2)"
    RANGE_ZERO3 = "by byte range (ZeRO-3)"
    UNIVERSAL = "universal"
    UNIVERSAL_ZERO3 = "universal, each rank its slice of each file"


class Convert(enum.Enum):
    SPREAD = "spread over the ranks"
    RANK0 = "on rank 0"


@dataclass(frozen=True)
class Layout:
    """What rank 0 knows of a checkpoint before loading it: who wrote it (its state file) and the
    names its manifests list in its tag folder (None: no listing was read)."""

    world_size: int
    zero_stage: int
    frozen_params: int | None
    names: frozenset[str] | None
    sub_group_size: int | None = None  # ZeRO-3's, as the writer recorded it (None: not recorded)

    @classmethod
    def of(cls, state: dict[str, Any], files: dict[str, int] | None, step_tag: str) -> Layout:
        """From a checkpoint's saved state and its listing (paths relative to the run folder)."""
        prefix = f"{step_tag}/"
        names = None if files is None else frozenset(rel[len(prefix):] for rel in files if rel.startswith(prefix))
        frozen, cut = state.get("frozen_params"), state.get("sub_group_size")
        return cls(int(state["world_size"]), int(state["zero_stage"]), None if frozen is None else int(frozen), names,
                   None if cut is None else int(cut))


@dataclass(frozen=True)
class Route:
    """How this group loads the checkpoint: `load`, after a universal conversion made `convert`'s way (or none)."""

    load: Load
    convert: Convert | None = None
    # From a snapshot the memory tier holds (`Plan`, below), not from storage.
    memory: Plan | None = field(default=None, compare=False)

    @property
    def resized(self) -> bool:
        """Not loaded as saved: at another world size than the one that wrote it (or a ZeRO-3 cut changed)."""
        return self.load is not Load.AS_SAVED

    @property
    def universal(self) -> bool:
        """Loaded from a universal conversion (DeepSpeed's `checkpoint.load_universal`)."""
        return self.convert is not None


def decide(layout: Layout, spec: JobSpec, world: int) -> Route:
    """The one way `layout` loads into a group of `world` ranks running `spec`."""
    if layout.zero_stage == 0 or (layout.world_size == world and not recut(layout, spec)):
        return Route(Load.AS_SAVED)  # ZeRO 1-3 partition by rank; stage 0 keeps the state whole
    if by_range(layout, spec, world):
        return Route(Load.RANGE_ZERO3 if layout.zero_stage == 3 else Load.RANGE_ZERO12)
    load = Load.UNIVERSAL_ZERO3 if spec.parallelism.zero_stage == 3 else Load.UNIVERSAL
    spread = layout.names is not None and plain_data_parallel(layout.names)
    return Route(load, Convert.SPREAD if spread else Convert.RANK0)


@dataclass(frozen=True)
class Held:
    """The newest complete snapshot the job's memory tier holds, as rank 0 found it in the keepers
    (tidal.worker.checkpoint.memory): its step, its layout (who wrote it and its files' names, as
    a checkpoint of that step would list them), and whether a job of this spec's resume
    fingerprint wrote it."""

    step: int
    layout: Layout
    same_job: bool


def from_memory(stored_step: int | None, held: Held | None, spec: JobSpec, world: int) -> Load | None:
    """How a group of `world` ranks loads the memory tier's snapshot `held`, or None: it resumes from
    the newest complete checkpoint in storage (at `stored_step`; None: none) instead.

    The newest wins; at the same step memory, the nearer copy (the same state: snapshots and
    checkpoints are taken after the same optimizer step). Memory loads as saved at the world size
    that wrote it and by byte range at another (`by_range`); a checkpoint that needs a universal
    conversion is converted from storage, where the conversion is published for every rank."""
    if held is None or not held.same_job or held.layout.zero_stage != spec.parallelism.zero_stage:
        return None
    if stored_step is not None and held.step < stored_step:
        return None
    if recut(held.layout, spec):
        return None
    if held.layout.world_size == world:
        return Load.AS_SAVED
    if by_range(held.layout, spec, world):
        return Load.RANGE_ZERO3 if held.layout.zero_stage == 3 else Load.RANGE_ZERO12
    return None


def by_range(layout: Layout, spec: JobSpec, world: int) -> bool:
    """Whether a checkpoint written at another world size loads by byte range: a plain
    data-parallel ZeRO checkpoint of this job's stage, loaded by DeepSpeed's ZeRO optimizer in
    the layout `repartition.pieces` (ZeRO-1/2) or `repartition_zero3.pieces` assumes; for ZeRO-3,
    written by a save that recorded no frozen parameters (their fragments are per rank, in the
    model states). `checkpoint.resize: universal` asks for the conversion instead."""
    stage, p = layout.zero_stage, spec.parallelism
    if spec.checkpoint.resize == "universal" or layout.names is None or stage not in (1, 2, 3):
        return False
    if p.zero_stage != stage or p.pipeline_stages > 1:
        return False
    if stage == 1 and p.precision == "bf16":
        return False  # DeepSpeed's BF16 optimizer, another checkpoint layout
    if stage == 3 and (layout.frozen_params != 0 or recut(layout, spec)):
        return False  # frozen parameters, or a checkpoint from before Tidal recorded them; another cut
    zero = ds_config(spec, world, on_gpu=False)["zero_optimization"]
    if zero.get("round_robin_gradients") or zero.get("elastic_checkpoint"):
        return False
    if "nvme" in ((zero.get("offload_optimizer") or {}).get("device"), (zero.get("offload_param") or {}).get("device")):
        return False
    names, old = layout.names, layout.world_size
    optim = {m.group(2) for n in names if (m := OPTIM.fullmatch(n))}
    ranks = {str(d) for d in range(old)}
    if stage == 3:
        models = {m.group(1) for n in names if (m := ZERO3_MODEL_STATES.fullmatch(n))}
        return optim == ranks and models == ranks and len(names) == 2 * old
    return MODEL_STATES in names and optim == ranks and len(names) == old + 1


def recut(layout: Layout, spec: JobSpec) -> bool:
    """Whether a ZeRO-3 checkpoint's partitions were cut into sub-groups at another size than this
    spec's (`zero_optimization.sub_group_size` changed since): neither DeepSpeed's own load nor a
    by-range one can read them, at any world size (each attempt failed on it, until the restarts
    ran out); the universal conversion is cut-free. Unknown for checkpoints that did not record it."""
    return (layout.zero_stage == 3 and layout.sub_group_size is not None
            and layout.sub_group_size != sub_group_size(spec))


def plain_data_parallel(names: frozenset[str]) -> bool:
    """Whether a tag folder's files are a plain data-parallel checkpoint's (one model-parallel rank,
    no pipeline layer files, model states and optimizer partitions): what a spread conversion splits."""
    model = optims = False
    for name in names:
        optim, states = ANY_OPTIM.match(name), ANY_MODEL.match(name)
        if "/" in name or name.startswith("layer_") or any(m and m[2] != "00" for m in (optim, states)):
            return False
        optims |= optim is not None
        model |= states is not None
    return model and optims


@dataclass
class Plan:
    """The snapshot a group loads from memory, as rank 0 found it: for each shard (old rank), its
    files (name -> size) and the keepers holding it (name -> node id)."""

    attempt: str
    step: int
    state: dict[str, Any]
    shards: dict[int, dict[str, int]]
    holders: dict[int, dict[str, str]]
    origin: dict[int, str] = field(default_factory=dict)  # the node each rank ran on when it was taken

    def files(self) -> dict[str, int]:
        """Every shard's files (name in the tag folder -> size): what a checkpoint of its step lists."""
        return {name: size for files in self.shards.values() for name, size in files.items()}

    def where(self) -> str:
        """Where its copies are, for the person watching: the nodes, and whether peers held any."""
        nodes = sorted({n for h in self.holders.values() for n in h.values()})
        peers = any(self.origin.get(r) not in h.values() for r, h in self.holders.items())
        shown = ", ".join(n[:8] for n in nodes)
        return f"held on node{'s' if len(nodes) > 1 else ''} {shown}" + (" (a peer's copy)" if peers else "")


def newest(listings: dict[str, list[dict[str, Any]]], fingerprint: str) -> tuple[Held, Plan] | tuple[None, None]:
    """Of the shards the keepers list (keeper name -> `Keeper.listing`), the newest complete
    snapshot: one attempt's shards of one step for every rank of the world size that wrote it,
    wherever each is held. A partial snapshot (a rank's shard missing: a crash mid-snapshot, or
    its node lost with no peer copy) is never one, nor are shards of different attempts."""
    shards: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
    holders: dict[tuple[str, int], dict[int, dict[str, str]]] = {}
    for name, listing in listings.items():
        for entry in listing:
            key = (entry["attempt"], int(entry["step"]))
            shards.setdefault(key, {})[int(entry["rank"])] = entry
            holders.setdefault(key, {}).setdefault(int(entry["rank"]), {})[name] = entry["held_on"]
    for (attempt, step) in sorted(shards, key=lambda k: k[1], reverse=True):
        got = shards[(attempt, step)]
        worlds = {int(e["world_size"]) for e in got.values()}
        if len(worlds) != 1 or sorted(got) != list(range(worlds.pop())) or got[0].get("state") is None:
            continue  # a partial snapshot: never a resume point
        first = got[0]
        plan = Plan(attempt, step, first["state"], {r: dict(e["sizes"]) for r, e in got.items()},
                    holders[(attempt, step)], {r: e["node"] for r, e in got.items()})
        frozen, cut = first["state"].get("frozen_params"), first["state"].get("sub_group_size")
        layout = Layout(len(got), int(first["zero_stage"]), None if frozen is None else int(frozen),
                        frozenset(plan.files()), None if cut is None else int(cut))
        return Held(step, layout, first["fingerprint"] == fingerprint), plan
    return None, None
