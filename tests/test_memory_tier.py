"""The memory tier's decisions, without Ray: when a restart resumes from memory rather than storage
(route.from_memory, a table), which snapshot counts as complete (memory.newest: never a partial,
never two attempts mixed, a peer's copy counts), and what a keeper keeps (prune, limit)."""

from __future__ import annotations

import os
import threading
import time

import pyarrow.fs as pafs
import pytest
import torch

from tests.memory_jobs import packed
from tidal.spec.job import JobSpec
from tidal.worker.checkpoint import flat_state, held_files, keeper, segment
from tidal.worker.checkpoint.keeper import Keeper
from tidal.worker.checkpoint.route import Held, Layout, Load, from_memory, newest

SPEC = JobSpec().with_overrides({"parallelism.zero_stage": 2, "checkpoint.memory.every_steps": 3})


def held(step: int, world: int = 2, stage: int = 2, same_job: bool = True, cut: int | None = None) -> Held:
    """A snapshot of `world` ranks of a plain data-parallel ZeRO job: the files its checkpoint would list
    (`cut`: the ZeRO-3 sub_group_size it recorded)."""
    names = {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)}
    names |= ({f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)} if stage == 3
              else {"mp_rank_00_model_states.pt"})
    return Held(step, Layout(world, stage, 0 if stage == 3 else None, frozenset(names), cut), same_job)


@pytest.mark.parametrize(("stored", "snapshot", "world", "spec", "load"), [
    (None, None, 2, SPEC, None),                          # nothing anywhere
    (None, held(6), 2, SPEC, Load.AS_SAVED),              # no checkpoint yet: the snapshot
    (20, held(27), 2, SPEC, Load.AS_SAVED),               # newer than storage's
    (20, held(20), 2, SPEC, Load.AS_SAVED),               # the same step: the nearer copy
    (20, held(18), 2, SPEC, None),                        # older than storage's: storage
    (20, held(27), 1, SPEC, Load.RANGE_ZERO12),           # another world size: by byte range, from the keepers
    (20, held(27), 4, SPEC, Load.RANGE_ZERO12),           # and growing
    (20, held(27, stage=3), 1, SPEC.with_overrides({"parallelism.zero_stage": 3}), Load.RANGE_ZERO3),
    (20, held(27), 1, SPEC.with_overrides({"checkpoint.resize": "universal"}), None),  # a conversion: storage
    (20, held(27, stage=3), 2, SPEC, None),               # another ZeRO stage
    (20, held(27, same_job=False), 2, SPEC, None),        # written by another job (fingerprint)
    # ZeRO-3 partitions cut at another sub_group_size: only storage's conversion reads them, at any size
    (20, held(27, stage=3, cut=4096), 2, SPEC.with_overrides({"parallelism.zero_stage": 3}), None),
    (20, held(27, stage=3, cut=1_000_000_000), 2, SPEC.with_overrides({"parallelism.zero_stage": 3}), Load.AS_SAVED),
])
def test_where_a_restart_resumes_from(stored, snapshot, world, spec, load):
    assert from_memory(stored, snapshot, spec, world) is load


def shard(attempt: str, step: int, rank: int, world: int = 2, node: str = "n0", held_on: str = "n0",
          fingerprint: str = "fp") -> dict:
    return {"attempt": attempt, "step": step, "rank": rank, "world_size": world, "zero_stage": 2,
            "fingerprint": fingerprint, "node": node, "held_on": held_on,
            "state": {"step": step, "world_size": world} if rank == 0 else None,
            "sizes": {f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt": 10, **(
                {"mp_rank_00_model_states.pt": 5} if rank == 0 else {})}}


def test_the_newest_complete_snapshot_skips_a_partial_one():
    listings = {"k0": [shard("a", 9, 0), shard("a", 12, 0)], "k1": [shard("a", 9, 1, node="n1", held_on="n1")]}
    found, plan = newest(listings, "fp")
    assert found == held(9) and plan.step == 9 and plan.attempt == "a"
    assert plan.holders == {0: {"k0": "n0"}, 1: {"k1": "n1"}}


def test_shards_of_two_attempts_never_make_one_snapshot():
    """Attempt a held rank 0's step 12 and died; attempt b held rank 1's: no complete step 12."""
    listings = {"k0": [shard("a", 9, 0), shard("a", 9, 1), shard("a", 12, 0), shard("b", 12, 1)]}
    found, plan = newest(listings, "fp")
    assert found.step == 9 and plan.attempt == "a"


def test_a_peers_copy_completes_a_snapshot_whose_node_is_gone():
    """Node n1 is lost with its keeper: rank 1's shard of step 12 survives on n0's keeper, its peer."""
    listings = {"k0": [shard("a", 12, 0), shard("a", 12, 1, node="n1", held_on="n0")]}
    found, plan = newest(listings, "fp")
    assert found.step == 12
    assert "a peer's copy" in plan.where() and "n0" in plan.where()


def test_no_snapshot_when_none_is_complete_or_the_world_disagrees():
    assert newest({}, "fp") == (None, None)
    assert newest({"k0": [shard("a", 12, 0)]}, "fp") == (None, None)
    mixed = {"k0": [shard("a", 12, 0, world=2), shard("a", 12, 1, world=3)]}
    assert newest(mixed, "fp") == (None, None)
    held, _ = newest({"k0": [shard("a", 12, 0, fingerprint="x"), shard("a", 12, 1, fingerprint="x")]}, "fp")
    assert held.same_job is False


def shard_files(value: float, n: int = 25) -> dict:
    return {"f": {"w": torch.full((n,), float(value))}}


def served(k: Keeper, attempt: str, step: int, rank: int, name: str = "f"):
    """What a rank on the keeper's node rebuilds of a held shard (None: not served)."""
    found = k.where(attempt, step, rank)
    if found is None:
        return None
    ref, record, _ = found
    _, block = segment.mapped(ref, populate=False)
    return flat_state.read(record, name, torch.from_numpy(block))


def test_a_keeper_keeps_the_complete_snapshot_and_the_one_being_written():
    k = Keeper("job", "n0", limit_bytes=10_000)
    for step in (3, 6):
        for rank in (0, 1):
            assert k.put("a", step, rank, {"world_size": 2}, *packed(shard_files(step))) is None
    # step 9's first shard arrives with step 6 agreed complete: 3 goes, 6 stays, 9 is being written
    assert k.put("a", 9, 0, {"world_size": 2}, *packed(shard_files(9)), prune_below=6) is None
    assert sorted({(e["step"], e["rank"]) for e in k.listing()}) == [(6, 0), (6, 1), (9, 0)]
    assert torch.equal(served(k, "a", 6, 0)["w"], torch.full((25,), 6.0)), "step 9 went into the other slot"
    assert torch.equal(served(k, "a", 9, 0)["w"], torch.full((25,), 9.0))
    assert served(k, "a", 3, 1) is None
    assert all(e["held_on"] == "n0" for e in k.listing())
    assert k.stats()["bytes"] == 4 * 128, "two slots per rank, each reused, not grown"


def test_a_rank_writes_its_slot_once_and_a_slot_being_rewritten_is_neither_listed_nor_served():
    """The one copy: the rank maps its slot (the keeper's segment) and copies its state in; the keeper
    holds it on commit. A crash mid-snapshot leaves a slot unstamped: the keeper lists only the other."""
    k = Keeper("job", "n0", limit_bytes=10_000)
    planned = flat_state.plan(shard_files(3.0))
    mm, block = segment.mapped(k.make(0, 0, planned.total))
    flat_state.write(planned, torch.from_numpy(block))
    assert "not found whole" in k.commit("a", 3, 0, 0, {"world_size": 1}, planned.record), "committed unstamped"
    segment.write_stamp(mm, segment.stamp("a", 3, 0))
    assert k.commit("a", 3, 0, 0, {"world_size": 1}, planned.record) is None
    assert [(e["step"], e["sizes"]) for e in k.listing()] == [(3, {"f": 128})]
    loaded = served(k, "a", 3, 0)
    block[:] = 0  # the next snapshot into this slot: what was loaded is a copy, not a view of it
    assert torch.equal(loaded["w"], torch.full((25,), 3.0))
    segment.write_stamp(mm, 0)  # a rank begins to rewrite the slot, then dies
    assert k.listing() == [] and served(k, "a", 3, 0) is None


def test_a_snapshot_rebuilds_deepspeeds_state_and_its_structure_loads_weights_only():
    """Tied tensors stay one tensor, views come back compact, DeepSpeed's loss scaler and plain
    values come back as they were; a structure naming a type outside the allow-list is refused."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from tidal.worker.checkpoint.safe_load import allow

    allow([])
    w = torch.arange(10.0)
    state = {"module": {"w": w, "tied": w, "b": torch.ones(3, dtype=torch.bfloat16)}, "view": torch.arange(20.0)[5:9],
             "scaler": DynamicLossScaler(2.0**16, 1000, 1, 2, False), "step": 7, "name": "x", "t": (1, 2)}
    record, [block] = packed({"model.pt": state})
    back = flat_state.read(record, "model.pt", torch.from_numpy(block))
    assert back["module"]["w"] is back["module"]["tied"] and torch.equal(back["module"]["w"], w)
    assert back["module"]["b"].dtype == torch.bfloat16 and torch.equal(back["view"], torch.arange(5.0, 9.0))
    assert (back["scaler"].cur_scale, back["step"], back["name"], back["t"]) == (2.0**16, 7, "x", (1, 2))
    planted, [block] = packed({"model.pt": {"x": threading.Lock}})
    with pytest.raises(Exception, match="threading|Unsupported"):
        flat_state.read(planted, "model.pt", torch.from_numpy(block))


def test_a_keeper_refuses_a_segment_over_its_limit_naming_the_setting_and_keeps_the_rest():
    k = Keeper("job", "n0", limit_bytes=300)
    assert k.put("a", 3, 0, {}, *packed(shard_files(3))) is None  # 128 bytes
    why = k.put("a", 6, 0, {}, *packed(shard_files(6, n=50)))  # 256 more, in the other slot
    assert why is not None and "limit" in why and "checkpoint.memory.max_gb" in why
    assert [(e["step"], e["rank"]) for e in k.listing()] == [(3, 0)]


def test_a_keeper_bounds_its_segments_by_the_nodes_free_memory_naming_the_settings(monkeypatch):
    """Under its limit, a segment that would leave less than the reserve of the node's (or the pod's)
    memory free is refused, not allocated and left to the OOM killer."""
    k = Keeper("job", "n0", limit_bytes=None)
    assert k.limit == int(segment.total_memory() * keeper.DEFAULT_SHARE)
    monkeypatch.setattr(segment, "available", lambda: k.reserve + 1000)
    why = k.make(0, 0, 2000)
    assert isinstance(why, str) and "free" in why and "checkpoint.memory" in why
    assert k.make(0, 0, 500) == segment.Ref(os.getpid(), k.slots[0][0].fd, 500)


def test_keeper_names_carry_the_job_its_storage_its_drivers_generation_and_the_node():
    a = keeper.Owner.of(SPEC.with_overrides({"name": "job", "checkpoint.storage": "/runs/a"}), 3)
    b = keeper.Owner.of(SPEC.with_overrides({"name": "job", "checkpoint.storage": "/runs/b"}), 3)
    assert a != b and a.job == b.job == "job", "one name on two storages: two owners"
    assert keeper.owner_of(keeper.name(a, "abc123")) == a
    assert keeper.owner_of(keeper.name(keeper.Owner("my:job", "s", 0), "n")) == keeper.Owner("my:job", "s", 0)
    assert keeper.owner_of("tidal-tracker:x") is None and keeper.owner_of("tidal-keeper:job:n") is None


def test_two_azure_containers_or_accounts_are_two_owners():
    """The key-less abfs:// URI names its container and account in the user-info: a storage of its
    own each (found in review: the digest masked it, so two such jobs of one name shared keepers)."""
    owners = {keeper.Owner.of(SPEC.with_overrides({"checkpoint.storage": uri}), 1) for uri in (
        "abfs://runs-a@acct.dfs.core.windows.net/x", "abfs://runs-b@acct.dfs.core.windows.net/x",
        "abfs://runs-a@other.dfs.core.windows.net/x")}
    assert len(owners) == 3


def test_a_keepers_storage_digest_carries_no_credential():
    secret = SPEC.with_overrides({"checkpoint.storage": "s3://KEY:SECRET@bucket/runs"})
    other_secret = SPEC.with_overrides({"checkpoint.storage": "s3://KEY:OTHER@bucket/runs"})
    owner = keeper.Owner.of(secret, 1)
    assert "SECRET" not in keeper.name(owner, "n") and owner == keeper.Owner.of(other_secret, 1)


def test_a_snapshot_in_memory_reads_as_a_checkpoint_folder_and_refuses_writes(tmp_path):
    """What a by-range resize calls on storage, on a snapshot's files as `memory.staged` serves them
    (held_files): the tag folder's listing, sizes, byte ranges, a whole-file copy into the node's
    cache; and a write is refused, not half done."""
    record, [block] = packed({"zero_pp_rank_0_mp_rank_00_optim_states.pt": {"w": torch.arange(1000.0)}})
    data = flat_state.to_bytes(flat_state.read(record, "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                               torch.from_numpy(block)))
    held = held_files.filesystem({"memory-3/global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt": data})
    path = "memory-3/global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    [info] = held.get_file_info([path])
    assert (info.type, info.size) == (pafs.FileType.File, len(data))
    assert [i.path for i in held.get_file_info(pafs.FileSelector("memory-3/global_step3"))] == [path]
    assert held.get_file_info(["memory-3/global_step4"])[0].type == pafs.FileType.NotFound
    with held.open_input_file(path) as f:
        assert f.read_at(100, len(data) - 100) == data[-100:]
    pafs.copy_files(path, str(tmp_path / "copy.pt"), source_filesystem=held,
                    destination_filesystem=pafs.LocalFileSystem())
    assert torch.equal(torch.load(tmp_path / "copy.pt")["w"], torch.arange(1000.0))
    with pytest.raises(OSError, match="read-only"):
        held.delete_file(path)


def test_a_keeper_counts_the_groups_of_its_driver_that_opened_the_tier():
    """The faults the chosen interval allows for (checkpoint.memory.every_steps: auto): every group
    after the first is a restart; the first one's start is when the driver began training."""
    k = Keeper("job", "n0", limit_bytes=None)
    first, groups = k.group_started()
    assert groups == 1
    assert k.group_started() == (first, 2) and k.group_started() == (first, 3)


@pytest.mark.slow  # a real expiry on a real clock (about 0.7 s)
def test_a_wall_clock_stepped_forward_ends_no_live_keeper(monkeypatch):
    """The keeper's expiry runs on the monotonic clock: an NTP step or a VM's resume moving the wall
    clock past the expiry ended a live job's keeper, and its snapshots with it (found in review)."""
    from tidal.worker.checkpoint import keeper as module

    ended = []
    monkeypatch.setattr(module.os, "_exit", lambda code: ended.append(code))
    k = Keeper("job", "n0", limit_bytes=None)
    wall = time.time()
    monkeypatch.setattr(module.time, "time", lambda: wall + 3600.0)  # the wall clock jumps an hour
    expiring = threading.Thread(target=k._expire, args=(0.4,), daemon=True)
    expiring.start()
    for _ in range(3):
        time.sleep(0.1)
        k.touch()  # the driver's heartbeat keeps coming
    assert not ended, "a touched keeper ended itself"
    expiring.join(timeout=5)  # untouched now: it ends once the expiry has really passed
    assert ended == [0]
