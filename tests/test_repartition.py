"""A ZeRO-1/2 resize without a universal conversion (tidal.worker.repartition): the plan alone
against DeepSpeed's own partitioning, which checkpoints it takes, then real checkpoints saved by a
DeepSpeed group and loaded at another size by real ranks (processes on gloo), on a folder and on
the S3 test server, compared with DeepSpeed's universal path. No Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch

from tests.conftest import tiny_spec
from tidal import fs
from tidal.storage import Found
from tidal.testing.processes import free_port
from tidal.worker import fetch, share
from tidal.worker.host_buffers import Buffers
from tidal.worker.repartition import direct, partition_size, pieces

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


def listing(old: int, prefix: str = "") -> dict[str, int]:
    return {f"{TAG}/mp_rank_00_model_states.pt": 10,
            **{f"{TAG}/{prefix}zero_pp_rank_{d}_mp_rank_00_optim_states.pt": 100 for d in range(old)},
            "manifest-0.json": 1, "state.json": 1}


@pytest.mark.parametrize("case,expected", [
    ({}, True),
    ({"prefix": "bf16_", "overrides": {"parallelism.precision": "bf16"}}, True),  # ZeRO-2 in bf16: the same optimizer
    ({"stage": 1}, True),
    ({"stage": 1, "prefix": "bf16_", "overrides": {"parallelism.precision": "bf16"}}, False),  # DeepSpeed's BF16 optimizer
    ({"stage": 3}, False),
    ({"extra": {f"{TAG}/zero_pp_rank_0_mp_rank_01_optim_states.pt": 100}}, False),  # tensor parallel
    ({"extra": {f"{TAG}/layer_01-model_states.pt": 5}}, False),  # pipeline
    ({"drop": f"{TAG}/zero_pp_rank_1_mp_rank_00_optim_states.pt"}, False),  # a partition missing
    ({"overrides": {"parallelism.deepspeed": {"zero_optimization": {"round_robin_gradients": True}}}}, False),
    ({"files": None}, False),
])
def test_only_plain_data_parallel_zero12_checkpoints_resize_directly(tmp_path, case, expected):
    stage = case.get("stage", 2)
    files = {**listing(2, case.get("prefix", "")), **case.get("extra", {})}
    files.pop(case.get("drop", ""), None)
    spec = tiny_spec(tmp_path, **{"parallelism.zero_stage": stage, **case.get("overrides", {})})
    found = Found("/x", pafs.LocalFileSystem(), {"step": 8, "world_size": 2, "zero_stage": stage},
                  case.get("files", files))
    assert direct(spec, found, TAG, 1) is expected


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
def saved(tmp_path_factory) -> dict[int, Path]:
    """ZeRO-2 checkpoints of tests.zero_checkpoint's model: 2 ranks (narrow), 1 rank (wide)."""
    root = tmp_path_factory.mktemp("saved")
    jobs = {2: ("13", 2), 1: (str(WIDE), 1)}

    def save(old: int) -> None:
        width, world = jobs[old]
        run_ranks("tests.zero_checkpoint", [str(root / f"w{old}"), "2", width], world, {})

    threads = [threading.Thread(target=save, args=(old,)) for old in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for old in jobs:
        (root / f"w{old}" / "global_step2").is_dir() or pytest.fail(f"no checkpoint saved at {old} rank(s)")
    return {old: root / f"w{old}" for old in jobs}


@pytest.mark.slow
@pytest.mark.parametrize("old,new,where", [(2, 1, "local"), (1, 2, "s3")])  # s3: one record a file
def test_a_direct_resize_loads_what_deepspeeds_universal_path_loads(saved, old, new, where, tmp_path, request):
    if where == "s3":
        # As Tidal's saves into an object store lay a file out: every tensor in one block (one record).
        packed = tmp_path / "packed"
        pafs.copy_files(str(saved[old]), str(packed))
        for path in (packed / "global_step2").glob("*optim_states.pt"):
            torch.save(Buffers().take(path.name, torch.load(path, weights_only=False)), path)
        store, base = fs.resolve(f"{request.getfixturevalue('bucket')}/runs/job/checkpoint_000000002")
        pafs.copy_files(str(packed), base, destination_filesystem=store)
        uri = f"s3://{base}"
    else:
        uri = str(tmp_path / "runs" / "job" / "checkpoint_000000002")
        pafs.copy_files(str(saved[old]), uri)
    width = "13" if old == 2 else str(WIDE)
    out = [json.loads(line) for line in run_ranks("tests.repartition_check", [uri, str(old), "2", width], new,
                                                  {fetch.CACHE_ENV: str(tmp_path / "node")})]
    for rank, got in enumerate(out):
        assert "state/0/exp_avg" in got["keys"] and "fp32/0" in got["keys"]
        assert got["differ"] == [], (rank, got["differ"])  # the module, fp32 master and Adam's moments, bit for bit
        assert got["losses_direct"] == got["losses_universal"], rank  # and the steps after
        assert got["reread"] == {}, "a second load on the node reads its copies, nothing from storage"
    if old == 1:  # a grow: each rank reads about half of the one partition, not all of it
        optim = (saved[1] / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").stat().st_size
        state = sum(4 * 3 * n for n in (7 * WIDE + WIDE, WIDE * 5 + 5))  # fp32, exp_avg, exp_avg_sq of a and b
        reads = [got["read"].get("global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt", 0) for got in out]
        print(f"grow 1 -> 2: the partition file {optim:,} bytes ({state:,} of optimizer state); each rank read {reads}")
        for got in reads:
            assert got <= state / 2 + 2 * share.EDGE + 1024, (got, state)
        assert sum(reads) < 0.75 * 2 * optim, "not the whole file on every rank"
