"""Which way a checkpoint loads (tidal.worker.checkpoint.route.decide): one pure decision of the
checkpoint's layout and the spec, as a table. Each row: what was saved (stage, world, files),
the job that resumes it and at which size, and the one way it loads."""

from __future__ import annotations

import pytest

from tests.conftest import tiny_spec
from tidal.worker.checkpoint.route import Convert, Layout, Load, Route, decide

TAG = "global_step8"
SAME, RANGE12, RANGE3 = Route(Load.AS_SAVED), Route(Load.RANGE_ZERO12), Route(Load.RANGE_ZERO3)
SPREAD, RANK0 = Route(Load.UNIVERSAL, Convert.SPREAD), Route(Load.UNIVERSAL, Convert.RANK0)
SPREAD3, RANK0_3 = Route(Load.UNIVERSAL_ZERO3, Convert.SPREAD), Route(Load.UNIVERSAL_ZERO3, Convert.RANK0)


def listing(old: int, prefix: str = "", zero3: bool = False) -> dict[str, int]:
    """A tag folder's files as DeepSpeed saves them at `old` ranks, with the run folder's own beside them."""
    models = ([f"{TAG}/zero_pp_rank_{d}_mp_rank_00_model_states.pt" for d in range(old)] if zero3
              else [f"{TAG}/mp_rank_00_model_states.pt"])
    return {**dict.fromkeys(models, 10),
            **{f"{TAG}/{prefix}zero_pp_rank_{d}_mp_rank_00_optim_states.pt": 100 for d in range(old)},
            "manifest-0.json": 1, "state.json": 1}


NVME = {"parallelism.offload_params": "nvme", "parallelism.nvme_path": "/local_nvme"}
ROUND_ROBIN = {"parallelism.deepspeed": {"zero_optimization": {"round_robin_gradients": True}}}
UNIVERSAL = {"checkpoint.resize": "universal"}
TP = {f"{TAG}/zero_pp_rank_0_mp_rank_01_optim_states.pt": 100}
PIPELINE = {f"{TAG}/layer_01-model_states.pt": 5}
CUT_4096 = {"parallelism.deepspeed": {"zero_optimization": {"sub_group_size": 4096}}}


@pytest.mark.parametrize("case,expected", [
    # the size that wrote it, or ZeRO stage 0 (whole on every rank): DeepSpeed's own load
    ({"world": 2}, SAME),
    ({"world": 2, "stage": 3, "zero3": True, "frozen": 2}, SAME),
    ({"stage": 0, "files": {f"{TAG}/mp_rank_00_model_states.pt": 10}}, SAME),
    # by byte range: a plain data-parallel checkpoint of this job's stage
    ({}, RANGE12),
    ({"world": 4}, RANGE12),  # a grow
    ({"prefix": "bf16_", "overrides": {"parallelism.precision": "bf16"}}, RANGE12),  # ZeRO-2 in bf16: the same optimizer
    ({"stage": 1}, RANGE12),
    ({"stage": 3, "zero3": True, "frozen": 0}, RANGE3),
    # what a by-range load does not cover, plain data-parallel: a conversion spread over the ranks
    ({"stage": 1, "prefix": "bf16_", "overrides": {"parallelism.precision": "bf16"}}, SPREAD),  # DeepSpeed's BF16 optimizer
    ({"overrides": UNIVERSAL}, SPREAD),  # asked for
    ({"stage": 3, "zero3": True, "frozen": 0, "overrides": UNIVERSAL}, SPREAD3),
    ({"stage": 3, "zero3": True}, SPREAD3),  # saved before Tidal recorded frozen parameters
    ({"stage": 3, "zero3": True, "frozen": 2}, SPREAD3),  # their fragments: per rank, in the model states
    ({"stage": 3, "zero3": True, "frozen": 0, "drop": f"{TAG}/zero_pp_rank_1_mp_rank_00_model_states.pt"}, SPREAD3),
    ({"stage": 3, "zero3": True, "frozen": 0, "overrides": NVME}, SPREAD3),
    ({"stage": 3, "frozen": 0}, SPREAD3),  # ZeRO-1/2's files under a ZeRO-3 stage
    ({"drop": f"{TAG}/zero_pp_rank_1_mp_rank_00_optim_states.pt"}, SPREAD),  # a partition missing
    ({"overrides": ROUND_ROBIN}, SPREAD),
    # not plain data-parallel, or not listed: DeepSpeed's converter on rank 0 alone
    ({"extra": TP}, RANK0),  # tensor parallel
    ({"extra": PIPELINE}, RANK0),  # pipeline
    ({"stage": 3, "zero3": True, "frozen": 0, "extra": TP}, RANK0_3),
    ({"files": None}, RANK0),
    ({"stage": 3, "files": None}, RANK0_3),
    # ZeRO-3 partitions cut at another sub_group_size than the spec's: only the conversion reads them,
    # at any size (DeepSpeed's own load and a by-range one failed every attempt on them)
    ({"stage": 3, "zero3": True, "frozen": 0, "cut": 1_000_000_000}, RANGE3),  # DeepSpeed's default, recorded
    ({"stage": 3, "zero3": True, "frozen": 0, "cut": 4096}, SPREAD3),
    ({"world": 2, "stage": 3, "zero3": True, "frozen": 0, "cut": 4096}, SPREAD3),
    ({"world": 2, "stage": 3, "zero3": True, "frozen": 0, "cut": 4096, "overrides": CUT_4096}, SAME),
    ({"stage": 3, "zero3": True, "frozen": 0, "overrides": CUT_4096}, RANGE3),  # not recorded: as before
])
def test_one_decision_says_how_each_checkpoint_loads(tmp_path, case, expected):
    stage = case.get("stage", 2)
    files = {**listing(2, case.get("prefix", ""), case.get("zero3", False)), **case.get("extra", {})}
    files.pop(case.get("drop", ""), None)
    spec = tiny_spec(tmp_path, **{"parallelism.zero_stage": stage, **case.get("overrides", {})})
    state = {"step": 8, "world_size": 2, "zero_stage": stage,
             **({"frozen_params": case["frozen"]} if "frozen" in case else {}),
             **({"sub_group_size": case["cut"]} if "cut" in case else {})}
    layout = Layout.of(state, case.get("files", files), TAG)
    route = decide(layout, spec, case.get("world", 1))
    assert route == expected
    assert route.resized is (expected is not SAME) and route.universal is (expected.convert is not None)
