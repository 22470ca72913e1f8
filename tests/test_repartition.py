"""A ZeRO-1/2 resize without a universal conversion (tidal.worker.checkpoint.repartition): the plan alone
against DeepSpeed's own partitioning (which checkpoints it takes: tests/test_route.py), then real checkpoints saved by a
DeepSpeed group and loaded at another size by real ranks (processes on gloo), on a folder and on
the S3 test server, compared with DeepSpeed's universal path. No Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch

from tidal import fs
from tidal.errors import CheckpointError
from tidal.storage import Found
from tidal.testing.processes import free_port
from tidal.worker.checkpoint import fetch, share
from tidal.worker.checkpoint import repartition_zero3 as zero3
from tidal.worker.checkpoint.host_buffers import Buffers
from tidal.worker.checkpoint.repartition import merged, partition_size, pieces, sparse_copy

ROOT = Path(__file__).resolve().parents[1]
TAG = "global_step8"


def deepspeed_partitions(flat: torch.Tensor, world: int) -> list[torch.Tensor]:
    """What DeepSpeed's ZeRO-1/2 does with a group's flat vector: pad its end to a multiple of
    2 x world (`align_dense_tensors`), cut it in `world` equal parts (`get_data_parallel_partitions`)."""
    pad = (-flat.numel()) % (2 * world)
    return list(torch.cat([flat, torch.zeros(pad)]).chunk(world))


@pytest.mark.parametrize("numel", [1, 5, 177, 1000, 1003])
def test_each_new_partition_is_built_from_slices_of_the_old_ones_as_deepspeed_cuts_it(numel):
    flat = torch.arange(1, numel + 1, dtype=torch.float32)
    for old in range(1, 6):
        saved = deepspeed_partitions(flat, old)
        assert all(p.numel() == partition_size(numel, old) for p in saved)
        for new in range(1, 6):
            for rank, expected in enumerate(deepspeed_partitions(flat, new)):
                built = torch.zeros(partition_size(numel, new))
                for p in pieces(numel, old, new, rank):
                    built[p.at:p.at + p.hi - p.lo] = saved[p.old][p.lo:p.hi]
                assert torch.equal(built, expected), (numel, old, new, rank)
                assert all(saved[p.old][p.lo:p.hi].numel() == p.hi - p.lo for p in pieces(numel, old, new, rank))


def zero3_flats(params: list[torch.Tensor], world: int, sub_group_size: int) -> list[list[torch.Tensor]]:
    """Each rank's sub-group flats as ZeRO-3 holds them: every parameter padded to a multiple of the
    world and cut in `world` parts; a rank's parts of a sub-group's parameters end to end."""
    slots, sizes = zero3.layout([[p.numel() for p in params]], world, sub_group_size)
    flats = [[torch.zeros(n) for n in sizes] for _ in range(world)]
    for p, slot in zip(params, slots, strict=True):
        for rank, part in enumerate(torch.cat([p, torch.zeros((-p.numel()) % world)]).chunk(world)):
            flats[rank][slot.group][slot.offset:slot.offset + part.numel()] = part
    return flats


def test_zero3_cuts_sub_groups_as_deepspeed_does_at_each_size():
    # tests.zero_checkpoint's model, sub_group_size 52: a sub-group closes once its partitions reach 52
    numels = [3, 91, 13, 65, 5]
    assert zero3.layout([numels], 1, 52)[1] == [94, 78, 5]
    assert zero3.layout([numels], 2, 52)[1] == [55, 36]
    assert zero3.layout([numels], 2, None)[1] == zero3.layout([numels], 2, 10**9)[1] == [91]
    assert zero3.layout([[4, 4], [6]], 2, 10**9) == ([zero3.Slot(0, 0), zero3.Slot(0, 2), zero3.Slot(1, 0)], [4, 3])


@pytest.mark.parametrize("numels,sub_group_size", [([3, 91, 13, 65, 5], 52), ([1, 7, 1000, 3], 10**9),
                                                   ([17] * 9, 40)])
def test_each_new_zero3_partition_is_built_from_slices_of_the_old_ones(numels, sub_group_size):
    params = [torch.arange(1, n + 1, dtype=torch.float32) + 1000 * i for i, n in enumerate(numels)]
    for old in range(1, 6):
        saved = zero3_flats(params, old, sub_group_size)
        was = zero3.layout([numels], old, sub_group_size)[0]
        for new in range(1, 6):
            now, sizes = zero3.layout([numels], new, sub_group_size)
            for rank, expected in enumerate(zero3_flats(params, new, sub_group_size)):
                built = [torch.zeros(n) for n in sizes]
                for p in zero3.pieces(numels, was, now, old, new, rank):
                    built[p.to][p.at:p.at + p.hi - p.lo] = saved[p.old][p.group][p.lo:p.hi]
                assert all(torch.equal(b, e) for b, e in zip(built, expected, strict=True)), (numels, old, new, rank)


def test_a_zero3_rank_that_holds_only_padding_of_a_sub_group_gets_zeros_and_its_own_step():
    # 8 and 1 elements, one rank -> four, sub-groups closing at 2: at four ranks rank 3 holds elements
    # 6-8 of the first parameter and only padding of the second (its own sub-group).
    numels, size = [8, 1], 2
    was, _ = zero3.layout([numels], 1, size)
    now, sizes = zero3.layout([numels], 4, size)
    assert sizes == [2, 1]
    plan = zero3.pieces(numels, was, now, 1, 4, 3)
    assert {p.to for p in plan} == {0}
    step = torch.tensor(5.0)
    saved = {0: {"loss_scaler": None, zero3.FP32: [torch.arange(8.0), torch.tensor([9.0])],
                 zero3.ZERO_STATE: {"state": {k: {"step": step, "exp_avg": t * 2} for k, t in
                                              enumerate([torch.arange(8.0), torch.tensor([9.0])])},
                                    "param_groups": [{"lr": 0.1, "params": [0, 1]}]}}}
    state = zero3._assemble(saved, plan, sizes, [0, 0], 4)
    assert [t.tolist() for t in state[zero3.FP32]] == [[6.0, 7.0], [0.0]]
    groups = state[zero3.ZERO_STATE]["state"]
    assert groups[0]["exp_avg"].tolist() == [12.0, 14.0] and groups[1]["exp_avg"].tolist() == [0.0]
    assert groups[0]["step"] is not groups[1]["step"] and float(groups[1]["step"]) == 5.0
    assert state[zero3.ZERO_STATE]["param_groups"] == [{"lr": 0.1, "params": [0, 1]}]
    assert state["partition_count"] == 4


def test_byte_ranges_that_touch_are_read_as_one():
    assert merged([(5, 9), (0, 5), (12, 12), (11, 14), (13, 20), (30, 31)]) == [(0, 9), (11, 20), (30, 31)]


def test_a_reused_sparse_copy_is_checked_and_holds_what_this_plan_reads(tmp_path):
    """A rank's sparse copy of an old ZeRO-3 partition, kept on its node for the next restart, is
    taken again only for the plan it was cut for: a restart whose plan reads other slices (another
    sub_group_size: new sub-groups, the old layout unchanged) gets those bytes, not the holes of the
    earlier copy read as zeros; and a layout that does not match the file is refused on a reused
    copy as on a new one."""
    tag, rel = "global_step8", "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    fp32 = [torch.arange(8.0) + 1, torch.arange(8.0) + 101]
    torch.save({"optimizer_state_dict": {
        zero3.FP32: fp32,
        zero3.ZERO_STATE: {"state": {k: {"step": torch.tensor(5.0), "exp_avg": t * 2} for k, t in enumerate(fp32)},
                           "param_groups": [{"lr": 0.1, "params": [0, 1]}]}}}, tmp_path / "old.pt")
    run = tmp_path / "run"
    (run / tag).mkdir(parents=True)
    (tmp_path / "old.pt").rename(run / tag / rel)
    size = (run / tag / rel).stat().st_size
    found = Found(str(run), pafs.LocalFileSystem(), {"step": 8, "world_size": 1, "zero_stage": 3}, {f"{tag}/{rel}": size})
    here = str(tmp_path / "cache" / ".repartition-2-0")

    def copy(wanted: dict[int, list[tuple[int, int]]], sizes: list[int]) -> dict:
        return sparse_copy(found, tag, rel, size, here, fetch.Fetched(),
                           lambda tree: zero3._partitioned(tree, wanted, sizes))

    first = copy({0: [(0, 4)], 1: [(0, 4)]}, [8, 8])
    assert first[zero3.FP32][0][:4].tolist() == [1.0, 2.0, 3.0, 4.0]
    again = copy({0: [(4, 8)], 1: [(4, 8)]}, [8, 8])  # this node's copy, for another plan
    assert again[zero3.FP32][0][4:].tolist() == [5.0, 6.0, 7.0, 8.0], "the earlier copy's holes, read as zeros"
    assert again[zero3.ZERO_STATE]["state"][1]["exp_avg"][4:].tolist() == [210.0, 212.0, 214.0, 216.0]
    with pytest.raises(CheckpointError, match="sub_group_size"):
        copy({0: [(4, 8)], 1: [(4, 8)]}, [10, 6])  # the reused copy, read with a layout it was not saved in


def run_ranks(module: str, args: list[str], world: int, env: dict[str, str]) -> list[str]:
    """`python -m module *args RANK WORLD PORT ...` as `world` processes; their last output lines."""
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "platform"), str(ROOT)]), **env}
    procs = [subprocess.Popen([sys.executable, "-m", module, *args[:-1], str(r), str(world), port, args[-1]],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    out = []
    for p in procs:
        stdout, err = p.communicate(timeout=400)
        assert p.returncode == 0, err[-3000:]
        out.append(stdout.strip().splitlines()[-1])
    return out


WIDE = 1500  # a model whose optimizer state is large beside an archive's two ends (share.EDGE each)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Callable[[int, int], Path]:
    """A ZeRO checkpoint of tests.zero_checkpoint's model at a stage and world size: 2 ranks
    (narrow) or 1 rank (wide), each made when a test first asks (the suite's grows need the wide one only)."""
    made: dict[tuple[int, int], Path] = {}

    def at(stage: int, old: int) -> Path:
        if (stage, old) not in made:
            width, world = {2: ("13", 2), 1: (str(WIDE), 1)}[old]
            folder = tmp_path_factory.mktemp(f"saved{stage}") / f"w{old}"
            run_ranks("tests.zero_checkpoint", [str(folder), str(stage), width], world, {})
            (folder / "global_step2").is_dir() or pytest.fail(f"no checkpoint saved at {old} rank(s)")
            made[stage, old] = folder
        return made[stage, old]

    return at


@pytest.mark.slow
@pytest.mark.parametrize("stage,old,new,where", [
    # The suite runs the grows (each rank reads part of a partition); the shrinks are `extended`
    # (outside the suite's budget, pyproject.toml): in the suite they resize whole jobs against stored
    # losses (test_stream_resume: ZeRO-2 2 -> 1 -> 2; test_user_code_e2e: ZeRO-3 2 -> 1 -> 2).
    pytest.param(2, 2, 1, "local", marks=pytest.mark.extended), (2, 1, 2, "s3"),  # s3: one record a file
    # ZeRO-3: sub-groups cut differently at each size (3 at one rank, 2 at two), every parameter sliced
    pytest.param(3, 2, 1, "s3", marks=pytest.mark.extended), (3, 1, 2, "local"),
])
def test_a_direct_resize_loads_what_deepspeeds_universal_path_loads(saved, stage, old, new, where, tmp_path, request):
    checkpoint = saved(stage, old)
    if where == "s3":
        # As Tidal's saves into an object store lay a file out: every tensor in one block (one record).
        packed = tmp_path / "packed"
        pafs.copy_files(str(checkpoint), str(packed))
        for path in (packed / "global_step2").glob("*optim_states.pt"):
            torch.save(Buffers().take(path.name, torch.load(path, weights_only=False)), path)
        store, base = fs.resolve(f"{request.getfixturevalue('bucket')}/runs/job/checkpoint_000000002")
        pafs.copy_files(str(packed), base, destination_filesystem=store)
        uri = f"s3://{base}"
    else:
        uri = str(tmp_path / "runs" / "job" / "checkpoint_000000002")
        pafs.copy_files(str(checkpoint), uri)
    width = "13" if old == 2 else str(WIDE)
    out = [json.loads(line) for line in run_ranks("tests.repartition_check", [uri, str(old), str(stage), width], new,
                                                  {fetch.CACHE_ENV: str(tmp_path / "node")})]
    for rank, got in enumerate(out):
        assert "state/0/exp_avg" in got["keys"] and "fp32/0" in got["keys"]
        assert got["differ"] == [], (rank, got["differ"])  # the module, fp32 master and Adam's moments, bit for bit
        assert got["losses_direct"] == got["losses_universal"], rank  # and the steps after
        # Adam's bias correction: every partition counted each of the 2 steps since the save at step 2 once
        assert got["steps_direct"] == got["steps_universal"] == [4.0] * len(got["steps_direct"]), rank
        assert got["reread"] == {}, "a second load on the node reads its copies, nothing from storage"
    if old == 1:  # a grow: each rank reads about half of the one partition, not all of it
        optim = (checkpoint / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").stat().st_size
        state = sum(4 * 3 * n for n in (7 * WIDE + WIDE, WIDE * 5 + 5))  # fp32, exp_avg, exp_avg_sq of a and b
        reads = [got["read"].get("global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt", 0) for got in out]
        print(f"grow 1 -> 2: the partition file {optim:,} bytes ({state:,} of optimizer state); each rank read {reads}")
        for got in reads:  # beside its half: the archive's two ends and each record's header (12 under ZeRO-3)
            assert got <= state / 2 + 2 * share.EDGE + 4096, (got, state)
        assert sum(reads) < 0.75 * 2 * optim, "not the whole file on every rank"
