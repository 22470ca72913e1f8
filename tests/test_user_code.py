"""User code from the spec, optimizers and schedules by name, DeepSpeed passthrough: fast checks, no Ray."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from tidal.errors import SpecError, TidalError
from tidal.spec.batch import rank_slice
from tidal.spec.deepspeed import ds_config
from tidal.spec.job import JobSpec
from tidal.spec.load import load_spec, validate
from tidal.spec.schedule import lr_factor
from tidal.worker.user_code import UserDataset, load_ref, step_function

EXAMPLE = "jobs/mlp-classifier.yaml"


def problems(data: dict) -> dict[str, str]:
    with pytest.raises(SpecError) as e:
        validate(data)
    return dict(e.value.problems)


# --- DeepSpeed passthrough --------------------------------------------------------------------
def test_passthrough_keys_merge_into_the_derived_config():
    spec = JobSpec(parallelism={"zero_stage": 3, "deepspeed": {
        "zero_optimization": {"reduce_bucket_size": 12345, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 7, "fp16": {"initial_scale_power": 8}, "train_batch_size": "auto"}})
    cfg = ds_config(spec, world_size=2, on_gpu=False)
    assert cfg["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 12345, "stage3_param_persistence_threshold": 0}
    assert cfg["steps_per_print"] == 7  # a default of Tidal's, not derived from any field: the user's to set
    assert cfg["fp16"] == {"enabled": False, "loss_scale": 0, "initial_scale_power": 8}
    assert cfg["train_batch_size"] == spec.train.global_batch  # "auto": what Tidal derives


@pytest.mark.parametrize(("extra", "key", "field"), [
    ({"train_micro_batch_size_per_gpu": 4}, "train_micro_batch_size_per_gpu", "train.micro_batch"),
    ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps", "train.global_batch"),
    ({"gradient_clipping": 0.5}, "gradient_clipping", "train.grad_clip"),
    ({"zero_optimization": {"stage": 3}}, "zero_optimization.stage", "parallelism.zero_stage"),
    ({"zero_optimization": 3}, "zero_optimization", "parallelism.zero_stage"),
    ({"optimizer": {"params": {"betas": [0.8, 0.9]}}}, "optimizer", "train.optimizer"),
    ({"scheduler": {"type": "WarmupLR"}}, "scheduler", "train.schedule"),
    ({"bf16": {"enabled": True}}, "bf16.enabled", "parallelism.precision"),
])
def test_a_derived_key_is_refused_naming_both(extra, key, field):
    got = problems({"parallelism": {"deepspeed": extra}})
    msg = got[f"parallelism.deepspeed.{key}"]
    assert msg.startswith(f"conflicts with {field} ") and f"set {field} instead" in msg


def test_auto_where_tidal_derives_nothing_is_refused():
    got = problems({"parallelism": {"deepspeed": {"zero_optimization": {"reduce_bucket_size": "auto"}}}})
    assert "derives no zero_optimization.reduce_bucket_size" in got["parallelism.deepspeed.zero_optimization.reduce_bucket_size"]


# --- user code references -----------------------------------------------------------------------
@pytest.mark.parametrize("field", ["model.builder", "data.dataset", "train.step_fn"])
def test_a_bad_reference_names_the_field_and_the_form(field):
    section, key = field.split(".")
    got = problems({section: {key: "my_models/mlp.py"}})
    assert "is not a 'module:function' reference; write e.g. 'my_models.mlp:build'" in got[field]


def test_a_missing_module_or_function_says_where_it_is_looked_for():
    with pytest.raises(SpecError) as e:
        load_ref("data.dataset", "no_such_pkg.data:make")
    field, msg = e.value.problems[0]
    assert field == "data.dataset" and "No module named 'no_such_pkg'" in msg and "directory you start `tidal run` from" in msg
    with pytest.raises(SpecError, match=r"jobs.mlp_classifier has no function 'nope' \(it has: .*dataset.*model.*step"):
        load_ref("model.builder", "jobs.mlp_classifier:nope")


def test_user_code_combinations_are_checked():
    got = problems({"data": {"dataset": "jobs.mlp_classifier:dataset", "source": "corpus.txt"}})
    assert got["data.dataset"].startswith("replaces data.source")
    assert problems({"model": {"builder_args": {"hidden": 8}}})["model.builder_args"].startswith("are arguments for model.builder")


class Stream(IterableDataset):
    def __iter__(self):
        yield from range(10)


def stream() -> Stream:
    return Stream()


def squares(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.tensor([float(i)]), torch.tensor(i * i)) for i in range(n)]


def test_a_dataset_without_a_resumable_position_is_refused():
    spec = JobSpec(data={"dataset": "tests.test_user_code:stream"})
    with pytest.raises(SpecError) as e:
        UserDataset(spec)
    field, msg = e.value.problems[0]
    assert field == "data.dataset" and "IterableDataset" in msg and "map-style torch Dataset" in msg


def test_user_samples_depend_on_the_global_index_only():
    """Resume and resize are exact: what a step trains on does not depend on who asks or when."""
    spec = JobSpec(data={"dataset": "tests.test_user_code:squares", "dataset_args": {"n": 10}},
                   train={"global_batch": 8, "micro_batch": 2})
    ds = UserDataset(spec)
    seen = ds.indices(0, 30)
    for epoch in range(3):  # every epoch is a permutation of the whole dataset
        assert sorted(seen[epoch * 10:(epoch + 1) * 10]) == list(range(10))
    assert UserDataset(spec).indices(17, 5) == seen[17:22]  # a fresh process (a restart) agrees
    step3 = 2 * 8
    for world in (1, 2, 4):
        got = []
        for rank in range(world):
            for x, y in ds.micro_batches(step3, rank_slice(8, world, rank), 2, torch.device("cpu")):
                assert x.shape == (2, 1) and torch.equal(y, (x.flatten() ** 2).long())
                got += [int(v) for v in x.flatten()]
        assert got == seen[step3:step3 + 8], world


def test_the_step_function_must_return_a_scalar_loss():
    spec = JobSpec(train={"step_fn": "jobs.mlp_classifier:step"})
    step = step_function(spec)
    model = torch.nn.Linear(16, 4)
    loss = step(model, (torch.randn(3, 16), torch.tensor([0, 1, 2])))
    assert loss.shape == () and loss.requires_grad
    with pytest.raises(TidalError, match="train.step_fn: 'jobs.mlp_classifier:step' returned"):
        step(lambda x: x.sum(dim=1).detach().unsqueeze(1).repeat(1, 4), (torch.randn(3, 16), torch.tensor([0, 1, 2])))


# --- optimizers and schedules ---------------------------------------------------------------------
def test_optimizers_by_name_with_their_arguments():
    sgd = ds_config(JobSpec(train={"optimizer": {"name": "SGD", "args": {"momentum": 0.9, "nesterov": True}}}), 2, False)
    assert sgd["optimizer"] == {"type": "SGD", "params": {"lr": 3e-4, "weight_decay": 0.0, "momentum": 0.9, "nesterov": True}}
    assert sgd["zero_allow_untested_optimizer"] is True
    adam = ds_config(JobSpec(train={"optimizer": {"name": "Adam", "args": {"betas": [0.8, 0.9]}}}), 2, False)
    assert adam["optimizer"]["params"]["adam_w_mode"] is False and adam["optimizer"]["params"]["betas"] == [0.8, 0.9]
    gpu_lion = JobSpec(train={"optimizer": {"name": "Lion"}}, scaling={"gpus_per_worker": 1})
    assert ds_config(gpu_lion, 2, True)["optimizer"]["type"] == "Lion"


def test_optimizer_arguments_and_limits_are_checked_at_load():
    got = problems({"train": {"optimizer": {"name": "SGD", "args": {"lr": 0.1, "betas": [0.9, 0.9]}}}})
    assert got["train.optimizer.args.lr"].startswith("conflicts with train.lr")
    assert got["train.optimizer.args.betas"].startswith("SGD takes momentum, dampening, nesterov")
    assert "offload_optimizer cpu" in problems({"train": {"optimizer": {"name": "Lion"}}})["train.optimizer.name"]
    elastic_sgd = {"train": {"optimizer": {"name": "SGD"}}, "scaling": {"min_workers": 1, "max_workers": 2}}
    assert "universal checkpoints" in problems(elastic_sgd)["train.optimizer.name"]


def test_a_resize_is_refused_for_optimizers_without_a_universal_form():
    from tidal.spec.user_refs import resize_refusal

    assert resize_refusal(JobSpec(train={"optimizer": {"name": "Adam"}}), 1) is None
    why = resize_refusal(JobSpec(train={"optimizer": {"name": "SGD", "args": {"momentum": 0.9}}}), 1)
    assert why is not None and "SGD's state does not convert" in why and "world size that wrote it" in why


def test_linear_and_wsd_schedules():
    wsd = JobSpec(train={"schedule": "wsd", "steps": 20, "warmup_steps": 4, "decay_fraction": 0.25, "min_lr_ratio": 0.1}).train
    f = [lr_factor(wsd, i) for i in range(20)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0] and f[4:15] == [1.0] * 11
    assert f[15] == 1.0 and f[19] == pytest.approx(0.1) and f[15:] == sorted(f[15:], reverse=True)
    linear = JobSpec(train={"schedule": "linear", "steps": 10, "warmup_steps": 0, "min_lr_ratio": 0.0}).train
    assert [lr_factor(linear, i) for i in (0, 9)] == [1.0, 0.0]
    assert "scheduler" not in ds_config(JobSpec(train={"schedule": "wsd"}), 2, False)  # the engine passes a torch one


def test_the_example_job_loads_and_its_code_builds():
    from tidal.worker.models import build_model

    spec = load_spec(EXAMPLE)
    assert isinstance(build_model(spec.model), torch.nn.Module)
    assert isinstance(load_ref("data.dataset", spec.data.dataset)(**spec.data.dataset_args), Dataset)


def test_a_user_dataset_reports_samples_per_second_and_no_made_up_tokens_or_mfu(capsys):
    """A classifier's samples have no seq_len tokens: tokens/s and MFU would be invented (they showed MFU > 100%)."""
    from tidal.tracking.console import Console
    from tidal.worker.metrics import speed

    lm = JobSpec(name="lm", train={"global_batch": 16, "micro_batch": 4})
    own = JobSpec(name="own", model={"builder": "jobs.mlp_classifier:model"},
                  data={"dataset": "jobs.mlp_classifier:dataset"}, train={"global_batch": 16, "micro_batch": 4})
    assert set(speed(lm, 0.5, 2, 1e6, 1e12)) >= {"tokens_per_s", "mfu", "samples_per_s"}
    assert speed(own, 0.5, 2, 1e6, 1e12) == {"samples_per_s": 32.0}
    Console(10)({"kind": "metrics", "step": 1, "values": {"loss": 0.5, **speed(own, 0.5, 2, 1e6, 1e12)}})
    line = capsys.readouterr().out
    assert "32.0 samples/s" in line and "tok/s" not in line and "MFU" not in line
