"""Sweeps: the `KEY=DIST` parser and the `sweep:` section (fast), and a real ASHA sweep on local Ray (slow)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from tests.conftest import ROOT, tiny_spec
from tidal.errors import SpecError
from tidal.spec.load import load_sweep_section
from tidal.spec.sweep import (
    ACCEPTED_FORMS,
    Param,
    SweepSpec,
    merged,
    parse_param,
    trial_label,
)

# --- the parameter syntax -------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("train.lr=loguniform:1e-4:1e-2", Param("train.lr", "loguniform", low=1e-4, high=1e-2)),
        ("train.lr=uniform:0.001:0.01", Param("train.lr", "uniform", low=0.001, high=0.01)),
        ("train.micro_batch=choice:4,8", Param("train.micro_batch", "choice", values=(4, 8))),
        ("train.lr=grid:1e-2, 1e-4", Param("train.lr", "grid", values=(1e-2, 1e-4))),
        ("train.seed=randint:0:100", Param("train.seed", "randint", low=0, high=100)),
        ("train.schedule=choice:cosine,constant", Param("train.schedule", "choice", values=("cosine", "constant"))),
        ("parallelism.activation_checkpointing=choice:true,false",
         Param("parallelism.activation_checkpointing", "choice", values=(True, False))),
    ],
)
def test_param_forms_parse_with_typed_values(text, expected):
    p = parse_param(text)
    assert p == expected
    assert [type(v) for v in p.values] == [type(v) for v in expected.values]  # 4 is an int, 1e-2 a float


@pytest.mark.parametrize(
    "text, why",
    [
        ("train.lr", "not of the form KEY=DIST"),
        ("=choice:1,2", "not of the form KEY=DIST"),
        ("train.lr=", "not of the form KEY=DIST"),
        ("train.lr=normal:0:1", "unknown distribution 'normal'"),
        ("train.lr=1e-3", "must start with a distribution name"),
        ("train.lr=uniform:1", "two bounds"),
        ("train.lr=uniform:1:2:3", "two bounds"),
        ("train.lr=uniform:a:b", "must be numbers"),
        ("train.lr=uniform:0.1:0.01", "must be below HI"),
        ("train.lr=loguniform:0:1", "LO > 0"),
        ("train.seed=randint:0:1.5", "must be integers"),
        ("train.micro_batch=choice:", "none empty"),
        ("train.micro_batch=choice:4,,8", "none empty"),
        ("train.warmup_steps=uniform:0:10", "integer field: use randint"),
    ],
)
def test_malformed_params_fail_showing_the_accepted_forms(text, why):
    with pytest.raises(SpecError) as e:
        parse_param(text)
    message = str(e.value)
    assert why in message
    if "integer field" not in why:
        assert ACCEPTED_FORMS in message
    assert "Traceback" not in message


@pytest.mark.parametrize(
    "text, hint",
    [
        ("train.lrr=uniform:0.1:1", "did you mean 'train.lr'?"),
        ("lr=uniform:0.1:1", "did you mean 'train.lr'?"),
        ("train.micro_bach=choice:4,8", "did you mean 'train.micro_batch'?"),
        ("scaling.max_worker=choice:1,2", "did you mean 'scaling.max_workers'?"),
        ("foo.bar=choice:1,2", "sweepable fields: model.n_layer"),
        ("train=choice:1,2", "is a section, not a field; sweep one of: train.steps"),
        ("name=choice:a,b", "cannot be swept"),
        ("checkpoint.storage=choice:/a,/b", "cannot be swept"),
    ],
)
def test_unknown_or_unsweepable_keys_are_named(text, hint):
    with pytest.raises(SpecError) as e:
        parse_param(text)
    assert hint in str(e.value)
    assert f"--param {text.partition('=')[0]}" in str(e.value)


def test_sweep_section_validates_params_metric_and_keys():
    with pytest.raises(SpecError) as e:
        merged(None, None, samples=0)
    assert "sweep.samples" in str(e.value)
    from tidal.spec.sweep import validate_sweep

    with pytest.raises(SpecError) as e:
        validate_sweep({"params": {"train.lr": "gaussian:0:1"}, "sampels": 3, "metric": "los", "scheduler": "hyperband"})
    text = str(e.value)
    assert "sweep.params" in text and "unknown distribution 'gaussian'" in text
    assert "sweep.sampels: unknown key; did you mean 'samples'?" in text
    assert "sweep.metric" in text and "did you mean 'loss'?" in text
    assert "sweep.scheduler" in text


def test_command_line_values_override_the_section():
    section = SweepSpec(params={"train.lr": "grid:1e-2,1e-3", "train.seed": "randint:0:9"}, samples=2)
    cfg = merged(section, ["train.lr=loguniform:1e-4:1e-2", "train.micro_batch=choice:4,8"], samples=5, mode=None)
    assert cfg.params == {"train.lr": "loguniform:0.0001:0.01", "train.seed": "randint:0:9", "train.micro_batch": "choice:4,8"}
    assert cfg.samples == 5 and cfg.mode == "min"


def test_yaml_sweep_section_is_read_beside_the_job(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(textwrap.dedent("""\
        name: swept
        train: {steps: 30, lr: 1.0e-3, warmup_steps: 2}
        sweep:
          params: {train.lr: "loguniform:1e-4:1e-2"}
          samples: 4
          scheduler: asha
        """))
    spec, section = load_sweep_section(path, ["sweep.samples=6", "train.steps=40"])
    assert spec.name == "swept" and spec.train.steps == 40
    assert section is not None and section.samples == 6 and section.scheduler == "asha"
    assert section.parsed()["train.lr"].kind == "loguniform"

    path.write_text("name: plain\n")
    assert load_sweep_section(path)[1] is None


def test_trial_labels_are_short_and_stable():
    assert trial_label("a1b2c_00003") == "3"
    assert trial_label("weird-id") == "weird-id"


def test_cli_sweep_command_parses_and_stays_light():
    from tidal.launch.sweep_cli import register

    parser = argparse.ArgumentParser(prog="tidal")
    register(parser.add_subparsers())
    args = parser.parse_args(["sweep", "job.yaml", "--param", "train.lr=loguniform:1e-4:1e-2", "--param",
                              "train.micro_batch=choice:4,8", "--samples", "4", "--set", "sweep.scheduler=asha",
                              "--set", "train.steps=10", "--restart"])
    assert args.params == ["train.lr=loguniform:1e-4:1e-2", "train.micro_batch=choice:4,8"]
    assert (args.samples, args.overrides, args.restart) == (4, ["sweep.scheduler=asha", "train.steps=10"], True)
    code = "import sys, tidal.launch.sweep_cli, tidal.spec.sweep; print(sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'torch', 'deepspeed'}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("flag, value", [("--scheduler", "asha"), ("--metric", "loss"), ("--mode", "max"),
                                         ("--max-concurrent", "2")])
def test_removed_sweep_flags_say_where_the_setting_went(flag, value, capsys):
    from tidal.cli import main

    with pytest.raises(SystemExit) as e:
        main(["sweep", str(ROOT / "jobs/quickstart.yaml"), flag, value])
    assert e.value.code == 2
    key = flag.removeprefix("--").replace("-", "_")
    assert f"use --set sweep.{key}={value}" in capsys.readouterr().err


def test_sweep_settings_come_from_set():
    _, section = load_sweep_section(ROOT / "jobs/quickstart.yaml", ["sweep.scheduler=asha", "sweep.max_concurrent=1"])
    assert section is not None and (section.scheduler, section.max_concurrent) == ("asha", 1)


def test_invalid_values_fail_before_any_trial_starts(tmp_path):
    """A micro batch that cannot divide the global batch is caught from the --param, not in a trial."""
    from tidal.launch.sweep import sweep

    spec = tiny_spec(tmp_path)
    with pytest.raises(SpecError) as e:
        sweep(spec, params=["train.micro_batch=choice:4,3"])
    assert "--param train.micro_batch: the value 3 from choice:4,3 makes an invalid job" in str(e.value)
    with pytest.raises(SpecError) as e:
        sweep(spec, params=["train.lr=grid:1e-2,1e-3"], scheduler="asha", grace_steps=24)
    assert "sweep.grace_steps" in str(e.value)
    with pytest.raises(SpecError, match="nothing to sweep"):
        sweep(spec)


# --- a real sweep ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_with_dashboard() -> Iterator[None]:
    """Like conftest's `ray_local`, but with the dashboard: Ray Train frees the workers of a trial
    that ASHA stopped only once the State API (served by the dashboard) shows its controller died."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=True, logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): a sweep runs end to end in test_sweep_resume
@pytest.mark.slow
@pytest.mark.usefixtures("ray_with_dashboard")
def test_asha_sweep_tracks_trials_and_picks_the_best(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from tidal.launch.sweep import sweep

    monkeypatch.chdir(tmp_path)  # MLflow puts a SQLite store's artifacts under ./mlruns
    spec = tiny_spec(tmp_path, name="sw", **{"train.steps": 16, "train.log_every": 4})
    lrs = [1e-2, 3e-3, 1e-3]
    result = sweep(spec, params={"train.lr": "grid:" + ",".join(map(str, lrs))}, scheduler="asha",
                   grace_steps=4, max_concurrent=1, config=SweepSpec(checkpoint_every=4))

    trials = result.trials
    assert sorted(trials["train.lr"]) == sorted(lrs)
    assert list(trials["name"]) == [f"sw-t{i}" for i in range(3)]
    assert set(trials["status"]) <= {"completed", "stopped_early"} and "completed" in set(trials["status"])
    assert "stopped_early" in set(trials["status"]), "ASHA stopped no trial:\n" + trials.to_string()
    assert (tmp_path / "runs" / "sw-sweep").is_dir(), "Tune's state lives under checkpoint.storage"
    for name in trials["name"]:
        assert (tmp_path / "runs" / name / "tidal-job.json").is_file(), f"{name} has its own run folder"

    client = MlflowClient(spec.tracking.uri)
    parent = client.get_run(result.parent_run_id)
    assert parent.data.tags["tidal.sweep"] == "sw" and parent.info.status == "FINISHED"
    assert parent.data.params["sweep.params.train.lr"].startswith("grid:")
    exp = client.get_experiment_by_name(spec.tracking.experiment)
    children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{result.parent_run_id}'")
    assert len(children) == 3
    assert sorted(float(c.data.params["train.lr"]) for c in children) == sorted(lrs), "distinct params per child"
    assert {c.info.status for c in children} <= {"FINISHED", "KILLED"}

    finished = {c.data.tags["tidal.trial"]: c for c in children if c.data.tags["tidal.sweep_status"] == "completed"}
    best = min(finished.values(), key=lambda c: c.data.metrics["loss"])
    assert result.best_spec.name == f"sw-t{best.data.tags['tidal.trial']}"
    assert result.best_spec.train.lr == pytest.approx(float(best.data.params["train.lr"]))
    assert result.best_metrics["loss"] == pytest.approx(best.data.metrics["loss"])
    assert parent.data.metrics["best_loss"] == pytest.approx(best.data.metrics["loss"])
    artifacts = {a.path for a in client.list_artifacts(result.parent_run_id)}
    assert {"best_spec.yaml", "trials.csv", "summary.json", "base_spec.yaml"} <= artifacts
    print(result.summary())

    # The same sweep again restores Tune's finished experiment: no trial trains twice.
    again = sweep(spec, params={"train.lr": "grid:" + ",".join(map(str, lrs))}, scheduler="asha",
                  grace_steps=4, max_concurrent=1, config=SweepSpec(checkpoint_every=4))
    assert again.parent_run_id == result.parent_run_id
    assert again.best_spec.name == result.best_spec.name
    assert again.wall_s < 30
