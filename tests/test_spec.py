"""The job spec: every shipped job validates; each kind of bad input gets a message naming its field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.helpers import tidal_main
from tidal.cli import main
from tidal.errors import SpecError
from tidal.spec import JobSpec, load_spec
from tidal.spec.batch import bad_world_sizes, grad_accum_steps
from tidal.spec.deepspeed import ds_config

JOBS = sorted((ROOT / "jobs").glob("*.yaml"))


def test_jobs_exist():
    assert {p.name for p in JOBS} >= {"quickstart.yaml"}


@pytest.mark.parametrize("path", JOBS, ids=lambda p: p.name)
def test_every_shipped_job_validates(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    spec = load_spec(path)
    for world in {spec.scaling.min_workers, spec.scaling.max_workers}:
        cfg = ds_config(spec, world, on_gpu=spec.scaling.gpus_per_worker > 0)
        replicas = spec.parallelism.data_parallel_size(world)
        assert cfg["train_batch_size"] == cfg["train_micro_batch_size_per_gpu"] * replicas * cfg["gradient_accumulation_steps"]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "job.yaml"
    p.write_text(text)
    return p


def problems(tmp_path: Path, text: str, overrides: list[str] | None = None) -> dict[str, str]:
    with pytest.raises(SpecError) as e:
        load_spec(write(tmp_path, text), overrides)
    return dict(e.value.problems)


def test_unknown_key_suggests_the_likely_one(tmp_path):
    p = problems(tmp_path, "train: {stpes: 10}")
    assert "did you mean 'steps'?" in p["train.stpes"]
    assert "global_batch" in p["train.stpes"]  # lists what is allowed


def test_unknown_section(tmp_path):
    p = problems(tmp_path, "trian: {steps: 10}")
    assert "did you mean 'train'?" in p["trian"]


def test_wrong_type(tmp_path):
    p = problems(tmp_path, "train: {steps: many}")
    assert "valid integer" in p["train.steps"] and "'many'" in p["train.steps"]


def test_zero_stage_4(tmp_path):
    p = problems(tmp_path, "parallelism: {zero_stage: 4}")
    assert "must be one of: 0, 1, 2 or 3" in p["parallelism.zero_stage"]


def test_min_above_max(tmp_path):
    p = problems(tmp_path, "scaling: {min_workers: 3, max_workers: 2}")
    assert "min_workers <= max_workers" in p["scaling.min_workers"]


def test_global_batch_not_divisible_names_the_world_sizes(tmp_path):
    p = problems(tmp_path, "train: {global_batch: 32, micro_batch: 8}\nscaling: {min_workers: 1, max_workers: 3}")
    msg = p["train.global_batch"]
    assert "world size(s) [3]" in msg and "[1, 3]" in msg and "try global_batch 48" in msg


def test_missing_data_file(tmp_path):
    p = problems(tmp_path, "data: {source: nowhere.jsonl}")
    assert "file not found" in p["data.source"]


def test_missing_job_file(tmp_path):
    with pytest.raises(SpecError, match="job file not found"):
        load_spec(tmp_path / "absent.yaml")


def test_all_problems_reported_at_once(tmp_path):
    p = problems(tmp_path, "train: {stpes: 1}\nparallelism: {zero_stage: 9}\nmodel: {d_model: x}")
    assert set(p) == {"train.stpes", "parallelism.zero_stage", "model.d_model"}


def test_bad_job_name(tmp_path):
    p = problems(tmp_path, "name: ../escape")
    assert "letters, digits" in p["name"]


def test_overrides_are_typed_and_validated(tmp_path):
    path = write(tmp_path, "train: {steps: 10}")
    assert load_spec(path, ["train.steps=50", "train.lr=1e-3"]).train.steps == 50
    assert "valid integer" in problems(tmp_path, "{}", ["train.steps=lots"])["train.steps"]
    assert "section.key=value" in problems(tmp_path, "{}", ["train.steps"])["--set"]


def test_with_overrides_returns_a_validated_copy():
    spec = JobSpec()
    other = spec.with_overrides({"train.lr": 0.01})
    assert other.train.lr == 0.01 and spec.train.lr == 3e-4
    with pytest.raises(SpecError, match="parallelism.zero_stage"):
        spec.with_overrides(["parallelism.zero_stage=7"])


def test_batch_math():
    assert grad_accum_steps(32, 8, 2) == 2
    assert bad_world_sizes(32, 8, 1, 4) == [3]


def test_resolved_makes_paths_absolute(tmp_path):
    spec = JobSpec().resolved(tmp_path)
    assert spec.checkpoint.storage == str(tmp_path / "tidal-runs")
    assert spec.tracking.uri == f"sqlite:///{tmp_path}/mlflow.db"


def test_cli_validate_prints_the_resolved_spec_and_deepspeed(capsys):
    assert main(["validate", str(ROOT / "jobs/quickstart.yaml"), "--deepspeed", "--set", "parallelism.zero_stage=3"]) == 0
    out = capsys.readouterr().out
    assert "zero_stage: 3" in out and '"stage": 3' in out and '"gradient_accumulation_steps": 2' in out


def test_cli_bad_spec_exits_2_without_traceback(tmp_path):
    path = write(tmp_path, "parallelism: {zero_stage: 4}\nscaling: {min_workers: 3, max_workers: 2}")
    code, _, err = tidal_main("validate", str(path))
    assert code == 2
    assert "parallelism.zero_stage" in err and "scaling.min_workers" in err
    assert "Traceback" not in err


def test_cli_traceback_with_tidal_debug(tmp_path):
    path = write(tmp_path, "parallelism: {zero_stage: 4}")
    code, _, err = tidal_main("validate", str(path), env={"TIDAL_DEBUG": "1"})
    assert code == 2 and "Traceback" in err


def test_cli_import_budget():
    """`tidal --help` and `tidal validate` must not pay for torch, ray or deepspeed."""
    code = "import sys, tidal, tidal.cli; bad = {'torch', 'ray', 'deepspeed', 'mlflow'} & set(sys.modules); print(sorted(bad))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_cli_help_lists_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "validate" in out and "run" in out and "TIDAL_DEBUG" in out


PIPE = "parallelism: {pipeline_stages: 2, zero_stage: 1}\nmodel: {n_layer: 2}\n"


def test_pipeline_job_validates_and_shows_its_pipeline(capsys):
    assert main(["validate", str(ROOT / "jobs/tiny-pipeline.yaml"), "--deepspeed"]) == 0
    out = capsys.readouterr().out
    assert '"stages": 2' in out and '"gradient_accumulation_steps": 4' in out  # 16 / (4 x 1 replica)


def test_pipeline_refuses_zero_2_and_3(tmp_path):
    p = problems(tmp_path, PIPE + "scaling: {min_workers: 2, max_workers: 2}", ["parallelism.zero_stage=3"])
    assert "ZeRO stage 0 or 1" in p["parallelism.zero_stage"]


def test_pipeline_refuses_an_elastic_range_or_a_split_replica(tmp_path):
    for scaling in ("{min_workers: 2, max_workers: 4}", "{min_workers: 3, max_workers: 3}"):
        p = problems(tmp_path, PIPE + f"scaling: {scaling}")
        assert "min_workers = max_workers = replicas x 2" in p["scaling.min_workers"], scaling


def test_pipeline_refuses_models_it_cannot_split(tmp_path):
    p = problems(tmp_path, PIPE + "scaling: {min_workers: 2, max_workers: 2}", ["model.hf_config={model_type: llama}"])
    assert "only the built-in GPT" in p["parallelism.pipeline_stages"]
    p = problems(tmp_path, PIPE + "scaling: {min_workers: 4, max_workers: 4}", ["parallelism.pipeline_stages=4"])
    assert "at least 4 layers" in p["parallelism.pipeline_stages"]


def test_pipeline_batch_counts_replicas_not_workers(tmp_path):
    # 4 workers = 2 stages x 2 replicas: 24 is a multiple of micro_batch 4 x 2 replicas, though not of 4 x 4 workers.
    load_spec(write(tmp_path, PIPE + "scaling: {min_workers: 4, max_workers: 4}\ntrain: {global_batch: 24, micro_batch: 4}"))
    p = problems(tmp_path, PIPE + "scaling: {min_workers: 4, max_workers: 4}\ntrain: {global_batch: 20, micro_batch: 4}")
    assert "data-parallel replicas (2 = 4 workers / 2 stages)" in p["train.global_batch"]


def test_streaming_needs_a_file_and_no_pipeline(tmp_path):
    p = problems(tmp_path, "data: {streaming: true}")
    assert "streams a file source" in p["data.streaming"]
    p = problems(tmp_path, PIPE + "scaling: {min_workers: 2, max_workers: 2}\ndata: {streaming: true, epochs: 1}")
    assert "same samples" in p["data.streaming"]


def test_epochs_apply_to_streams_only(tmp_path):
    p = problems(tmp_path, "data: {epochs: 2}")
    assert "data.streaming true" in p["data.epochs"]


# --- warmup -----------------------------------------------------------------------------------


def test_short_run_trains_with_a_shortened_warmup(capsys):
    """The issue's case: quickstart warms up 10 steps, and a 10-step run is not refused."""
    spec = load_spec(ROOT / "jobs/quickstart.yaml", ["train.steps=10"])
    assert spec.train.warmup_plan()[0] == 9
    assert ds_config(spec, 2, on_gpu=False)["scheduler"]["params"]["warmup_num_steps"] == 9
    assert main(["validate", str(ROOT / "jobs/quickstart.yaml"), "--set", "train.steps=10"]) == 0
    err = capsys.readouterr().err
    assert "note: train.warmup_steps 10 is not below train.steps (10): warming up over 9 step(s)" in err


@pytest.mark.parametrize(
    "train, expected",
    [
        ({"steps": 120, "warmup": 0.05}, 6),
        ({"steps": 30, "warmup": 0.1}, 3),  # 0.1 * 30 is 3.0000000000000004 in floats
        ({"steps": 10, "warmup": 0.05}, 1),  # rounded up: a fraction asked for some warmup
        ({"steps": 100, "warmup": 0.0}, 0),
        ({"steps": 100}, 20),  # the default, as before train.warmup existed
        ({"steps": 100, "warmup_steps": 5}, 5),
        ({"steps": 10, "warmup": 1.0}, 9),
        ({"steps": 1, "warmup_steps": 3}, 0),
    ],
)
def test_warmup_steps_from_either_field(train, expected):
    assert JobSpec(train=train).train.warmup_plan()[0] == expected


def test_warmup_note_names_the_field_that_asked():
    assert JobSpec(train={"steps": 100, "warmup_steps": 5}).train.warmup_plan()[1] is None
    _, note = JobSpec(train={"steps": 10, "warmup": 1.0}).train.warmup_plan()
    assert note is not None and note.startswith("train.warmup 1.0 x 10 steps = 10 is not below train.steps (10)")
    _, note = JobSpec(train={"steps": 10}).train.warmup_plan()
    assert note is not None and "train.warmup_steps 20 (the default)" in note


def test_warmup_and_warmup_steps_together_are_refused_naming_both(tmp_path):
    p = problems(tmp_path, "train: {warmup: 0.05, warmup_steps: 10}")
    assert "train.warmup_steps (10) are both set" in p["train.warmup"]
    assert "--set train.warmup_steps=null" in p["train.warmup"]
    # the way out the message gives works
    assert load_spec(write(tmp_path, "train: {warmup: 0.05, warmup_steps: 10}"), ["train.warmup_steps=null"]).train.warmup == 0.05


def test_warmup_fraction_above_one_is_refused(tmp_path):
    assert "less than or equal to 1" in problems(tmp_path, "train: {warmup: 5}")["train.warmup"]
