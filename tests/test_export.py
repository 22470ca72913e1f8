"""`tidal export` without Ray: which checkpoint it takes, the errors a person sees when the job or
the step is not there, and the exact mapping of the built-in GPT onto Hugging Face's GPT-2.

The end-to-end exports of real DeepSpeed checkpoints are in tests/test_export_e2e.py."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.conftest import tiny_spec
from tidal.cli import main
from tidal.errors import UsageError
from tidal.exporter.model import Candidate, choose, parse_checkpoint
from tidal.storage import STATE_FILE, RunDir, checkpoint_dir_name, manifest_name


def write_spec(tmp_path, spec) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(spec.model_dump(mode="json")))  # JSON is YAML
    return str(path)


def fake_checkpoint(spec, step: int) -> None:
    """The files that make a checkpoint complete for `tidal.storage` (no weights: enough to choose)."""
    run = RunDir(spec.checkpoint.storage, spec.name)
    folder = f"{run.path}/{checkpoint_dir_name(step)}"
    run.write_json(f"{checkpoint_dir_name(step)}/{STATE_FILE}", {"step": step, "world_size": 1, "zero_stage": 2})
    run.write_json(f"{checkpoint_dir_name(step)}/{manifest_name(0)}", {"step": step, "files": {}})
    assert run.fs.get_file_info(folder).type.name == "Directory"


def export_cli(tmp_path, spec, *flags: str) -> int:
    return main(["export", write_spec(tmp_path, spec), "--format", "torch", "--output", str(tmp_path / "out"), *flags])


def test_a_job_that_never_ran_says_to_run_it_or_point_at_its_storage(tmp_path, capsys):
    spec = tiny_spec(tmp_path, name="never-ran")
    assert export_cli(tmp_path, spec) == 2
    err = capsys.readouterr().err
    assert "job 'never-ran' has no complete checkpoint" in err and str(tmp_path / "runs" / "never-ran") in err
    assert "tidal run" in err and "checkpoint.storage" in err
    assert not (tmp_path / "out").exists(), "nothing written"


def test_a_step_without_a_checkpoint_lists_the_steps_that_have_one(tmp_path, capsys):
    spec = tiny_spec(tmp_path, name="two-ckpts")
    for step in (8, 16):
        fake_checkpoint(spec, step)
    assert export_cli(tmp_path, spec, "--checkpoint", "12") == 2
    err = capsys.readouterr().err
    assert "--checkpoint 12" in err and "complete checkpoints are at steps 8, 16" in err and "latest" in err


@pytest.mark.parametrize("bad", ["newest", "-3", "0", "1.5", ""])
def test_a_checkpoint_that_is_neither_latest_nor_a_step_is_refused(bad):
    with pytest.raises(UsageError, match="latest or best or a step number|steps start at 1"):
        parse_checkpoint(bad)


def test_latest_takes_the_newest_complete_checkpoint_and_a_step_takes_that_one(tmp_path):
    spec = tiny_spec(tmp_path)
    found = [Candidate(s, f"p{s}", {"step": s}) for s in (16, 8, 24)]
    assert choose(parse_checkpoint("latest"), found, spec).step == 24
    assert choose(parse_checkpoint("8"), found, spec).path == "p8"
    assert choose(parse_checkpoint(16), found, spec).path == "p16"


def test_best_takes_the_lowest_eval_loss_each_checkpoint_carries_and_needs_one(tmp_path):
    def at(step: int, loss: float | None) -> Candidate:
        evaluation = {"step": step, "metrics": {"eval_loss": loss}} if loss is not None else {}
        return Candidate(step, f"p{step}", {"step": step, "evaluation": evaluation})

    spec = tiny_spec(tmp_path)
    assert choose(parse_checkpoint("best"), [at(8, 2.0), at(16, 1.5), at(24, 1.7)], spec).step == 16
    assert choose("best", [at(8, 1.5), at(16, 1.5), at(24, None)], spec).step == 16, "the newest on a tie"
    with pytest.raises(UsageError, match="carries eval_loss"):
        choose("best", [at(8, None)], spec)


def test_an_output_folder_holding_other_files_is_refused(tmp_path, capsys):
    spec = tiny_spec(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    assert export_cli(tmp_path, spec) == 2
    assert "holds other files" in capsys.readouterr().err
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


def test_a_custom_model_has_no_hugging_face_form(tmp_path, capsys):
    spec = tiny_spec(tmp_path).with_overrides({"model.builder": "tests.custom_model:build"})
    assert main(["export", write_spec(tmp_path, spec), "--format", "hf", "--output", str(tmp_path / "o")]) == 2
    assert "--format torch" in capsys.readouterr().err


def test_export_help_names_formats_mlflow_and_exit_codes(capsys):
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    out = capsys.readouterr().out
    for text in ("--checkpoint", "latest|best|STEP", "from_pretrained", "tidal.load_exported", "--register", "exit codes"):
        assert text in out


@pytest.mark.slow
def test_the_built_in_gpt_maps_exactly_onto_gpt2(tmp_path):
    """Same loss from Hugging Face's GPT-2 loaded from the export as from the built-in GPT, on
    random (not initial: every weight differs) parameters, so a swapped or untransposed weight shows."""
    transformers = pytest.importorskip("transformers")
    from tidal.exporter.gpt2 import to_gpt2
    from tidal.exporter.save import load_torch, save_torch
    from tidal.worker.models.gpt import GPT

    cfg = tiny_spec(tmp_path).model
    gpt = GPT(cfg, seed=3).eval()
    with torch.no_grad():
        for p in gpt.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    batch = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    x, y = batch[:, :-1], batch[:, 1:]
    with torch.no_grad():
        expected = gpt(x, y).item()
        to_gpt2(gpt).save_pretrained(tmp_path / "hf")
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
        logits = hf(input_ids=x).logits
        got = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()
        save_torch(gpt, cfg, str(tmp_path / "pt"))
        again = load_torch(str(tmp_path / "pt"))(x, y).item()
    assert got == pytest.approx(expected, abs=1e-5)
    assert again == expected


@pytest.mark.slow
def test_an_hf_export_with_a_tokenizer_goes_to_mlflow_as_a_transformers_pipeline(tmp_path):
    """MLflow's transformers flavour needs a tokenizer; with one the logged model generates through
    pyfunc, and the job run's status is left as it was."""
    transformers = pytest.importorskip("transformers")
    import mlflow
    from mlflow.tracking import MlflowClient
    from tokenizers import Tokenizer, models, pre_tokenizers

    from tidal.exporter.mlflow import log_exported
    from tidal.exporter.model import Exported

    spec = tiny_spec(tmp_path)
    words = {f"w{i}": i for i in range(62)} | {"[UNK]": 62, "</s>": 63}
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    cfg = transformers.AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=2, vocab_size=64)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(tmp_path / "hf")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>").save_pretrained(
        tmp_path / "hf")
    client = MlflowClient(spec.tracking.uri)
    run_id = client.create_run(client.create_experiment("tests", artifact_location=str(tmp_path / "art")),
                               tags={"tidal.job": spec.name}).info.run_id

    done = log_exported(Exported("tiny", str(tmp_path / "hf"), "hf", 7, "here"), model, spec, run_id,
                        spec.tracking.uri, "tiny-llama")
    assert done.model_uri == "models:/tiny-llama/1" and done.registered == "tiny-llama version 1"
    assert "MLFLOW_TRACKING_URI" not in os.environ, "the export left MLflow pointed at the job's store"
    mlflow.set_tracking_uri(spec.tracking.uri)
    assert mlflow.transformers.load_model(done.model_uri, return_type="components")["model"].config.vocab_size == 64
    [text] = mlflow.pyfunc.load_model(done.model_uri).predict(["w1 w2"], params={"max_new_tokens": 2})
    assert text.startswith("w1 w2")
    assert client.get_run(run_id).info.status == "RUNNING", "a job still training stays RUNNING"


def test_export_logs_to_the_specs_mlflow_never_to_a_uri_planted_in_the_run_folder(tmp_path, capsys):
    from tidal.exporter.model import export_tracking_uri

    spec = tiny_spec(tmp_path)
    planted = {"tracking_uri": "http://attacker.example:5000", "mlflow_run_id": "r"}
    assert export_tracking_uri(spec, planted) == spec.tracking.uri
    assert "names another MLflow server (http://attacker.example:5000)" in capsys.readouterr().err
    assert export_tracking_uri(spec, {"tracking_uri": spec.tracking.uri}) == spec.tracking.uri


def test_export_reopens_only_a_run_tagged_as_this_jobs(tmp_path):
    """A run id read from storage naming another job's run (or one Tidal did not make) is refused
    before anything is logged to it."""
    from mlflow.tracking import MlflowClient

    from tidal.errors import TidalError
    from tidal.exporter.mlflow import log_exported
    from tidal.exporter.model import Exported

    spec = tiny_spec(tmp_path)
    client = MlflowClient(spec.tracking.uri)
    experiment = client.create_experiment("tests", artifact_location=str(tmp_path / "art"))
    other = client.create_run(experiment, tags={"tidal.job": "someone-elses"}).info.run_id
    with pytest.raises(TidalError, match=f"MLflow run {other} .* is not job 'tiny'.s"):
        log_exported(Exported("tiny", str(tmp_path / "pt"), "torch", 7, "here"), None, spec, other,
                     spec.tracking.uri, None)
    assert client.list_artifacts(other) == [], "nothing logged"
