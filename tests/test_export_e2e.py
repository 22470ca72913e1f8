"""`tidal export` of real DeepSpeed checkpoints written by real tidal runs on a local Ray.

What makes the checks real: the loss a job logs at step s+1 is the loss of the weights its
checkpoint at step s holds, computed by the distributed (sharded) training model on step s+1's
batch. An exported model that reproduces it on that batch outside DeepSpeed carries the trained
weights, consolidated right; the initial weights give a loss far outside the tolerance.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import tidal
from tests.conftest import ROOT, metric_history
from tests.helpers import EXPORT_TOLERANCE as TOLERANCE
from tests.helpers import batch_of_step, set_args
from tidal.cli import main
from tidal.exporter.model import EXPORT_FILE
from tidal.spec.load import load_spec
from tidal.testing.runs import prepared_store

# The S3 server's address must be in the environment before this module's Ray instance starts.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("s3_server", "ray_local")]
def hf_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(input_ids=x).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1)).item()


def job_overrides(tmp_path, storage: str, steps: int, every: int) -> list[str]:
    return [f"train.steps={steps}", f"checkpoint.every_steps={every}", "train.log_every=1",
            f"checkpoint.storage={storage}", f"tracking.uri={prepared_store(tmp_path / 'mlflow.db')}",
            "tracking.experiment=tests"]


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): the exporter runs end to end in the ZeRO-2 test below
def test_hf_llama_zero3_exports_to_from_pretrained_with_the_training_loss(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    job = str(ROOT / "jobs" / "tiny-hf-llama.yaml")
    overrides = [*job_overrides(tmp_path, str(tmp_path / "runs"), steps=4, every=3), "parallelism.zero_stage=3"]
    spec = load_spec(job, overrides)
    result = tidal.run(spec)
    logged = metric_history(spec, result.mlflow_run_id, "loss")
    capsys.readouterr()

    out = tmp_path / "llama-hf"
    assert main(["export", job, *set_args(overrides), "--checkpoint", "3", "--format", "hf", "--output", str(out), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["step"] == 3 and record["checkpoint"].endswith("checkpoint_000000003")
    assert json.loads((out / EXPORT_FILE).read_text()) == record
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()

    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    x, y = batch_of_step(spec, 4)
    got = hf_loss(model, x, y)
    assert got == pytest.approx(logged[4], abs=TOLERANCE)
    torch.manual_seed(spec.train.seed)  # the weights the job started from
    untrained = transformers.AutoModelForCausalLM.from_config(model.config).eval()
    assert abs(hf_loss(untrained, x, y) - logged[4]) > 20 * TOLERANCE, "the check tells trained from initial weights"


def test_quickstart_zero2_on_s3_exports_to_torch_mlflow_and_gpt2(tmp_path, bucket):
    transformers = pytest.importorskip("transformers")
    import mlflow

    spec = load_spec(ROOT / "jobs" / "quickstart.yaml", job_overrides(tmp_path, f"{bucket}/runs", steps=5, every=4))
    result = tidal.run(spec)
    logged = metric_history(spec, result.mlflow_run_id, "loss")
    x, y = batch_of_step(spec, 5)

    # Step 4 from S3, as safetensors + config, logged and registered in MLflow (pytorch flavour).
    pt = tidal.export(spec, checkpoint=4, format="torch", output=tmp_path / "gpt", register="quickstart-gpt")
    assert pt.checkpoint == f"{bucket}/runs/quickstart/checkpoint_000000004"
    gpt = tidal.load_exported(pt.output)
    assert type(gpt).__name__ == "GPT"
    with torch.no_grad():
        assert gpt(x, y).item() == pytest.approx(logged[5], abs=TOLERANCE)
    assert pt.mlflow_run_id == result.mlflow_run_id and pt.model_uri == "models:/quickstart-gpt/1"
    mlflow.set_tracking_uri(spec.resolved().tracking.uri)
    from_mlflow = mlflow.pytorch.load_model(pt.model_uri).eval()
    with torch.no_grad():
        assert from_mlflow(x, y).item() == gpt(x, y).item()
    assert mlflow.pyfunc.load_model(pt.model_uri).metadata.run_id == result.mlflow_run_id
    assert mlflow.get_run(result.mlflow_run_id).info.status == "FINISHED", "the job's status is kept"

    # The latest checkpoint (step 5) as a Hugging Face GPT-2: the same model as the torch export.
    hf = tidal.export(spec, format="hf", output=tmp_path / "gpt2")
    latest = tidal.export(spec, format="torch", output=tmp_path / "gpt5")
    assert hf.step == latest.step == 5
    gpt2 = transformers.AutoModelForCausalLM.from_pretrained(hf.output).eval()
    with torch.no_grad():
        assert hf_loss(gpt2, x, y) == pytest.approx(tidal.load_exported(latest.output)(x, y).item(), abs=1e-5)


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): the pipeline layout; the other exports run in the suite
def test_pipeline_checkpoint_exports_to_the_built_in_gpt_with_the_training_loss(tmp_path):
    spec = load_spec(ROOT / "jobs" / "tiny-pipeline.yaml", job_overrides(tmp_path, str(tmp_path / "runs"), steps=4, every=3))
    logged = metric_history(spec, tidal.run(spec).mlflow_run_id, "loss")
    exported = tidal.export(spec, checkpoint=3, format="torch", output=tmp_path / "gpt")
    x, y = batch_of_step(spec, 4)
    with torch.no_grad():
        assert tidal.load_exported(exported.output)(x, y).item() == pytest.approx(logged[4], abs=TOLERANCE)
