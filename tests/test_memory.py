"""The memory estimate `tidal validate --deepspeed` prints: DeepSpeed's own ZeRO estimators (copied
so that the CLI needs no torch) checked against DeepSpeed's, the GPT's parameter count against
the built model, and what offload moves where."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tidal.cli import main
from tidal.spec.job import JobSpec
from tidal.spec.memory import activation_bytes, estimate, gpt_params, zero2_states, zero3_states

# benchmarks/gpu.py's ~1B GPT.
GPT_1B = {"n_layer": 18, "n_head": 16, "d_model": 2048, "vocab_size": 50304, "seq_len": 2048}


def job(model: dict, **parallelism) -> JobSpec:
    return JobSpec(model=model, train={"micro_batch": 4, "global_batch": 32},
                   parallelism={"precision": "bf16", **parallelism},
                   scaling={"min_workers": 8, "max_workers": 8, "gpus_per_worker": 1})


@pytest.mark.parametrize("shape", [{"n_layer": 2, "n_head": 2, "d_model": 64, "vocab_size": 64, "seq_len": 16},
                                   {"n_layer": 3, "n_head": 4, "d_model": 96, "vocab_size": 1000, "seq_len": 32},
                                   {"n_layer": 1, "n_head": 8, "d_model": 256, "vocab_size": 50, "seq_len": 300}])
def test_gpt_parameter_count_is_the_built_models_as_deepspeed_counts_it(shape):
    from deepspeed.runtime.zero.stage3 import model_to_params

    from tidal.spec.sections import ModelSpec
    from tidal.worker.models.gpt import GPT

    model = GPT(ModelSpec(**shape), seed=0)
    assert gpt_params(ModelSpec(**shape)) == model_to_params(model)  # (total, largest layer), tied head once


@pytest.mark.parametrize("params", [1_000, 3_300_000, 1_010_000_000, 6_700_000_000])
@pytest.mark.parametrize("gpus, nodes", [(1, 1), (8, 1), (8, 4), (4, 3)])
def test_zero_estimates_are_deepspeeds(params, gpus, nodes):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    largest = params // 7
    for offload in (False, True):
        assert zero2_states(params, gpus, nodes, offload) == estimate_zero2_model_states_mem_needs(
            params, gpus, nodes, offload)
        for offload_params in (False, True):
            for zero_init in (False, True):
                assert zero3_states(params, largest, gpus, nodes, offload, offload_params, zero_init) == \
                    estimate_zero3_model_states_mem_needs(params, largest, gpus, nodes, offload, offload_params, zero_init)


def test_1b_zero2_bf16_on_8_gpus_has_deepspeeds_model_states():
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    got = estimate(job(GPT_1B, zero_stage=2), world=8)
    params = 1_013_669_888  # 18 x 12d^2 (906M) + the tied 50,304 x 2048 embedding (103M) + the rest
    assert gpt_params(JobSpec(model=GPT_1B).model)[0] == params
    host, device = estimate_zero2_model_states_mem_needs(params, 8, 1, cpu_offload=False)
    assert (got.states, got.host_per_node) == (device, host)
    assert 4.30e9 < got.states < 4.32e9  # 2 + 18/8 bytes a parameter
    assert got.activations > 0 and got.device_total == got.states + got.activations


@pytest.mark.parametrize("world", [1, 8])
def test_zero3_cpu_offload_moves_the_optimizer_states_to_host_memory(world):
    on_gpu = estimate(job(GPT_1B, zero_stage=3), world=world)
    offloaded = estimate(job(GPT_1B, zero_stage=3, offload_optimizer="cpu"), world=world)
    both = estimate(job(GPT_1B, zero_stage=3, offload_optimizer="cpu", offload_params="cpu"), world=world)
    params, largest = gpt_params(JobSpec(model=GPT_1B).model)
    # fp32 master weights, gradients and Adam moments (16 B a parameter) leave the GPUs...
    assert on_gpu.states - offloaded.states == 16 * params // world
    # ...for the node's host, which also holds each worker's fp32 model while it is built
    # (Tidal builds it whole before ZeRO partitions it): DeepSpeed's estimate takes the larger.
    assert offloaded.host_per_node == int(1.5 * params * max(16, 4 * world))
    assert offloaded.host_per_node > on_gpu.host_per_node or world == 8
    assert both.states == 4 * largest  # only the layer being gathered stays on the GPU


def test_activation_checkpointing_keeps_the_layer_inputs_only():
    m = JobSpec(model=GPT_1B).model
    full = activation_bytes(m, 4, "bf16", checkpointing=False, fused_attention=False)
    kept = activation_bytes(m, 4, "bf16", checkpointing=True, fused_attention=False)
    logits = 2048 * 4 * 50304 * (2 + 4)
    assert kept - logits < (full - logits) / 5, "18 layers' inputs and one layer instead of 18 layers"
    assert activation_bytes(m, 4, "bf16", False, fused_attention=True) < full, "no attention scores kept"
    assert activation_bytes(m, 4, "fp32", False, False) - logits * 8 // 6 == 2 * (full - logits)


def test_validate_deepspeed_prints_the_estimate_for_each_world_size(capsys):
    job_file = str(ROOT / "jobs" / "gpt-7b-zero3-offload.yaml")
    assert main(["validate", job_file, "--deepspeed", "--set", "scaling.min_workers=4", "--set", "scaling.max_workers=8", "--set", "train.global_batch=840"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("# Memory estimate per GPU"):].splitlines()
    assert table[1].split()[1:] == ["world", "states", "activations", "total", "host/node", "workers/node"]
    assert [row.split()[1] for row in table[2:4]] == ["4", "8"]


def test_a_model_of_unknown_shape_says_why_it_has_no_estimate(capsys):
    job_file = str(ROOT / "jobs" / "tiny-pipeline.yaml")
    assert main(["validate", job_file, "--deepspeed"]) == 0
    assert "# Memory estimate: none (a pipeline stage holds only its own layers" in capsys.readouterr().out


def test_the_estimate_imports_neither_torch_nor_deepspeed():
    code = "import sys, tidal.spec.memory; print(sorted({'torch', 'deepspeed'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
