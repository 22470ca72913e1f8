"""ZeRO-1/2 gradient buckets sized to the model: the same training, without a 2 GB allocation a step."""

from __future__ import annotations

import pytest
import torch

from tidal.spec.deepspeed import DEEPSPEED_REDUCE_BUCKET, ds_config
from tidal.spec.job import JobSpec


def spec(zero_stage: int = 2, **deepspeed) -> JobSpec:
    return JobSpec(name="buckets", model={"n_layer": 2, "n_head": 2, "d_model": 32, "vocab_size": 64, "seq_len": 8},
                   train={"steps": 4, "micro_batch": 2, "global_batch": 2, "lr": 1e-2, "warmup_steps": 1},
                   parallelism={"zero_stage": zero_stage, "deepspeed": deepspeed},
                   scaling={"min_workers": 1, "max_workers": 1})


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_1_and_2_get_a_bucket_the_size_of_the_model(stage):
    zero = ds_config(spec(stage), 1, on_gpu=False, trainable_params=123_456)["zero_optimization"]
    assert zero["reduce_bucket_size"] == 123_456


def test_deepspeed_keeps_its_bucket_where_the_model_is_larger_unknown_or_zero_3():
    assert "reduce_bucket_size" not in ds_config(spec(2), 1, False, trainable_params=DEEPSPEED_REDUCE_BUCKET + 1)["zero_optimization"]
    assert "reduce_bucket_size" not in ds_config(spec(2), 1, False)["zero_optimization"]  # `tidal validate`: no model built
    assert "reduce_bucket_size" not in ds_config(spec(3), 1, False, trainable_params=1000)["zero_optimization"]


def test_a_bucket_size_the_user_set_wins():
    cfg = ds_config(spec(2, zero_optimization={"reduce_bucket_size": 5000}), 1, False, trainable_params=1000)
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 5000


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): a DeepSpeed bucket setting
@pytest.mark.slow  # a real DeepSpeed engine (its first one on a fresh machine JIT-builds a CPU comm op)
def test_the_engine_trains_the_same_with_a_bucket_the_size_of_the_model(tmp_path, monkeypatch):
    """Tidal's engine (build_engine) against the same job with DeepSpeed's own 5e8-element bucket:
    equal losses and weights, bit for bit, and a bucket buffer of the model's size."""
    import torch.distributed as dist

    from tidal.worker.engine import build_engine

    def train(job: JobSpec) -> tuple[list[float], torch.Tensor, int]:
        engine = build_engine(job, 1, torch.device("cpu"))
        buffers: list[int] = []  # the bucket ZeRO allocated for this step, seen while it exists (in backward)
        bucket = next(iter(engine.optimizer.ipg_buckets.values()))
        next(engine.module.parameters()).register_post_accumulate_grad_hook(
            lambda _: buffers.append(bucket.buffer[0].numel()))
        tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        losses = []
        for _ in range(4):
            loss = engine(tokens, tokens)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        weights = torch.cat([p.detach().flatten() for p in engine.module.parameters()])
        assert len(buffers) == 4 and len(set(buffers)) == 1, buffers
        return losses, weights, buffers[0]

    monkeypatch.setenv("LOCAL_RANK", "0")  # as Ray Train sets it in a worker
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        sized, sized_weights, sized_buffer = train(spec(2))
        default, default_weights, default_buffer = train(spec(2, zero_optimization={"reduce_bucket_size": DEEPSPEED_REDUCE_BUCKET}))
    finally:
        dist.destroy_process_group()
    model_params = sized_weights.numel()
    assert sized_buffer == model_params and default_buffer == DEEPSPEED_REDUCE_BUCKET
    assert sized == default and torch.equal(sized_weights, default_weights)
