"""Models and data real jobs need: ZeRO-3 with offload, a Hugging Face model from a config, a
user's own model, and text/jsonl/parquet sources whose samples do not depend on restarts."""

from __future__ import annotations

import hashlib
import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import tidal
from tests.conftest import ROOT, metric_history, tiny_spec
from tests.golden import reference_losses
from tests.helpers import TEXT, run_killing_a_worker, write_sources
from tidal.cli import main
from tidal.errors import SpecError
from tidal.launch.stream_prep import encode_batch
from tidal.spec import JobSpec, load_spec
from tidal.spec.load import validate
from tidal.storage import RunDir
from tidal.testing.runs import prepared_store
from tidal.worker.data import Batches
from tidal.worker.models import build_model
from tidal.worker.tokens import encode

HF_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 16}
# TEXT and write_sources (its jsonl and parquet sources) are in tests/helpers.py: tests/golden.py writes them too.
_rng = random.Random(0)
for _ in range(60 * 240):  # past TEXT's draws from the same seed: DOCS as they were when made beside it
    _rng.choice("abcdefghij klmnop")
DOCS = ["".join(_rng.choice("abcdefghij klmnop") for _ in range(16)) for _ in range(2048)]  # +newline: one window each


def write_stream_sources(tmp) -> dict[str, str]:
    jsonl = tmp / "stream.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    parquet = tmp / "stream.parquet"
    pq.write_table(pa.table({"text": DOCS}), parquet, row_group_size=256)
    return {"jsonl": str(jsonl), "parquet": str(parquet)}


def window_id(doc: str) -> int:
    return window_hash(np.frombuffer((doc + "\n").encode(), dtype=np.uint8))


def window_hash(tokens: np.ndarray) -> int:
    return int.from_bytes(hashlib.blake2b(tokens.astype(np.int32).tobytes(), digest_size=8).digest(), "little", signed=True)


WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
COUNTING = [" ".join(WORDS[(i + k) % 10] for k in range(60)) for i in range(40)]  # learnable: counting in words


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> str:
    """A small BPE tokenizer trained here and saved like any Hugging Face tokenizer (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXT + COUNTING, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"]))
    path = tmp_path_factory.mktemp("tok") / "tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(path)
    return str(path)


@pytest.mark.slow
def test_a_hugging_face_tokenizer_feeds_both_data_paths(tmp_path, tokenizer):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    assert encode(["abc def", "ghi"], tokenizer).tolist() == [
        *tok("abc def")["input_ids"], tok.eos_token_id, *tok("ghi")["input_ids"], tok.eos_token_id]
    spec = JobSpec(model={"vocab_size": 128, "seq_len": 16}, data={"source": write_sources(tmp_path)["jsonl"],
                   "tokenizer": tokenizer}, train={"global_batch": 8, "micro_batch": 4}, scaling={"min_workers": 1, "max_workers": 1})
    windows = torch.cat([x for x, _ in Batches(spec, 0, 1, torch.device("cpu")).for_step(1)])
    assert windows.max() < len(tok) and windows.shape == (8, 16)
    # A streamed source is tokenized by the same function, in Ray Data tasks (one chunk per batch).
    packed = np.frombuffer(encode_batch({"text": np.array(TEXT[:4])}, "text", tokenizer)["tokens"][0].as_py(), np.int32)
    assert packed.tolist() == encode(TEXT[:4], tokenizer).tolist() and packed.max() < len(tok)


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused_before_training(tmp_path, tokenizer):
    spec = tiny_spec(tmp_path, **{"data.source": write_sources(tmp_path)["jsonl"], "data.tokenizer": tokenizer,
                                  "model.vocab_size": 64})
    with pytest.raises(SpecError) as e:
        tidal.run(spec)
    assert "model.vocab_size" in str(e.value) and "64 is below the 120 tokens of data.tokenizer" in str(e.value)


def final_step(spec: JobSpec) -> int:
    """The step of the job's final checkpoint, which says its data ended there."""
    found = RunDir(spec.checkpoint.storage, spec.name).latest_complete()
    assert found is not None and found.state.get("data_ended"), found
    return found.step


def test_validate_deepspeed_shows_offload(capsys):
    assert main(["validate", str(ROOT / "jobs" / "tiny-zero3-offload.yaml"), "--deepspeed"]) == 0
    out = capsys.readouterr().out
    assert '"offload_optimizer": {' in out and '"device": "cpu"' in out and '"stage": 3' in out


def test_offload_and_model_choices_are_checked():
    with pytest.raises(SpecError, match="parallelism.offload_params"):
        validate({"parallelism": {"zero_stage": 2, "offload_params": "cpu"}})
    with pytest.raises(SpecError, match="parallelism.nvme_path"):
        validate({"parallelism": {"zero_stage": 3, "offload_optimizer": "nvme"}})
    with pytest.raises(SpecError) as e:
        validate({"model": {"hf_config": HF_LLAMA, "builder": "a.b:c"}})
    assert dict(e.value.problems)["model.builder"].startswith("choose one of")


def test_user_builder_and_missing_builder():
    model = build_model(JobSpec(model={"builder": "tests.custom_model:build", "vocab_size": 32}).model)
    x = torch.randint(0, 32, (2, 8))
    assert model(x, x).item() > 0
    with pytest.raises(SpecError, match="cannot load"):
        build_model(JobSpec(model={"builder": "tests.nowhere:build"}).model)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_samples_depend_on_the_step_only(tmp_path, fmt):
    """The samples of a step are the same at any world size and after any restart."""
    src = write_sources(tmp_path)[fmt]
    spec = JobSpec(model={"vocab_size": 256, "seq_len": 32}, data={"source": src},
                   train={"global_batch": 16, "micro_batch": 4}, scaling={"min_workers": 1, "max_workers": 2})
    cpu = torch.device("cpu")

    def step_samples(world: int, step: int) -> list[tuple[int, ...]]:
        rows = []
        for rank in range(world):
            for tokens, targets in Batches(spec, rank, world, cpu).for_step(step):
                rows += [tuple(r) for r in torch.cat([tokens, targets[:, -1:]], 1).tolist()]
        return rows

    for step in (1, 7, 40):  # 40 is past the first epoch of this small source
        assert step_samples(1, step) == step_samples(2, step)
    epoch = [s for step in range(1, 8) for s in step_samples(2, step)]
    assert len(set(epoch)) == len(epoch), "no window repeats within an epoch"


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
class TestTrains:
    @pytest.mark.extended  # outside the suite's budget (pyproject.toml): offload is DeepSpeed's; ZeRO-3 trains in test_user_code_e2e
    def test_zero3_with_cpu_offload(self, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        spec = load_spec(ROOT / "jobs" / "tiny-zero3-offload.yaml").with_overrides(
            {"checkpoint.storage": str(tmp_path / "runs"), "tracking.uri": prepared_store(tmp_path / "mlflow.db")})
        loss = metric_history(spec, tidal.run(spec).mlflow_run_id, "loss")
        plain = spec.with_overrides({"name": "no-offload", "parallelism.offload_optimizer": "none",
                                     "parallelism.activation_checkpointing": False})
        # Offload moves the optimizer and recomputation trades memory for time: neither may change the math.
        assert metric_history(plain, tidal.run(plain).mlflow_run_id, "loss") == pytest.approx(loss, rel=1e-5)
        assert loss[24] < 0.7 * loss[4]

    @pytest.mark.extended  # outside the suite's budget (pyproject.toml): pipeline configs and checkpoints are unit-tested
    def test_pipeline_matches_the_whole_model_and_resumes_exactly(self, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        pipe = load_spec(ROOT / "jobs" / "tiny-pipeline.yaml").with_overrides(
            {"checkpoint.storage": str(tmp_path / "runs"), "tracking.uri": prepared_store(tmp_path / "mlflow.db"),
             "train.log_every": 1})
        loss = metric_history(pipe, tidal.run(pipe).mlflow_run_id, "loss")
        whole = pipe.with_overrides({"name": "whole", "parallelism.pipeline_stages": 1, "scaling.min_workers": 1,
                                     "scaling.max_workers": 1})
        reference = reference_losses("models-data-whole", whole)  # stored (tests/golden.py regenerates it)
        # Same weights, same batch: splitting the model into stages changes where it runs, not the math
        # (to a stored curve's drift between machines: tests/golden.py).
        assert loss[1] == pytest.approx(reference[1], rel=1e-4)
        assert loss == pytest.approx(reference, rel=1e-4)
        assert loss[24] < 0.7 * loss[1], (loss[1], loss[24])

        # 2 stages x 2 replicas (4 workers on 2 CPUs): replicas split each global batch like data parallelism.
        wide = pipe.with_overrides({"name": "pipe-2x2", "train.steps": 8, "scaling.min_workers": 4,
                                    "scaling.max_workers": 4, "scaling.cpus_per_worker": 0.5})
        wide_loss = metric_history(wide, tidal.run(wide).mlflow_run_id, "loss")
        assert wide_loss[1] == pytest.approx(reference[1], rel=1e-4)

        # Stopped at step 10 (a checkpoint), then run again: it continues exactly where it stopped.
        tidal.run(pipe.with_overrides({"name": "pipe-resumed", "train.stop_at": 10}))
        resumed = pipe.with_overrides({"name": "pipe-resumed"})
        assert metric_history(resumed, tidal.run(resumed).mlflow_run_id, "loss") == pytest.approx(loss, rel=1e-6)

    @pytest.mark.extended  # outside the suite's budget (pyproject.toml): streams across restarts and resizes run in test_stream_resume
    def test_streamed_sources_survive_a_restart_without_repeats_or_gaps(self, tmp_path):
        """One epoch of jsonl and parquet, tokenized by Ray Data, on 2 workers, one of them killed
        mid-run: the job trains every window of the source once, as many steps as an undisturbed run
        (which windows each step trains, at any world size: tests/test_stream_resume.py)."""
        sources = write_stream_sources(tmp_path)
        # data.epochs 1: the job ends after the last whole step of the epoch (a step takes 16).
        common = {"data.streaming": True, "data.epochs": 1, "model.vocab_size": 256, "train.steps": 10_000,
                  "checkpoint.every_steps": 16}

        for fmt, source in sources.items():
            spec = tiny_spec(tmp_path, name=f"stream-{fmt}", **common, **{"data.source": source})
            result, _ = run_killing_a_worker(spec, 40)
            assert max(metric_history(spec, result.mlflow_run_id, "restarts").values()) >= 1, "no restart happened"
            assert final_step(spec) == len(DOCS) // 16, fmt
            assert sorted(metric_history(spec, result.mlflow_run_id, "loss")) == list(range(1, len(DOCS) // 16 + 1))
            # Its shards hold every document (one window each) once: nothing lost or doubled in the read.
            shards = sorted((tmp_path / "runs" / spec.name / "tidal-stream").glob("*/shard_*.npy"))
            windows = np.concatenate([np.load(p) for p in shards])
            assert sorted(window_hash(w) for w in windows) == sorted(window_id(d) for d in DOCS), fmt

    @pytest.mark.extended  # outside the suite's budget (pyproject.toml): the tokenizer's data paths are unit-tested above
    def test_streamed_jsonl_with_a_hugging_face_tokenizer_trains(self, tmp_path, tokenizer):
        source = tmp_path / "counting.jsonl"
        source.write_text("".join(json.dumps({"text": d}) + "\n" for d in COUNTING))
        spec = tiny_spec(tmp_path, name="tok", **{"data.source": str(source), "data.streaming": True,
                                                  "data.tokenizer": tokenizer, "model.vocab_size": 128})
        loss = metric_history(spec, tidal.run(spec).mlflow_run_id, "loss")
        assert sorted(loss) == list(range(1, 25)) and loss[24] < 0.5 * loss[1], (loss[1], loss[24])

    def test_hugging_face_model_from_config(self, tmp_path):
        spec = tiny_spec(tmp_path, name="hf", **{"model.hf_config": HF_LLAMA, "model.vocab_size": 256})
        loss = metric_history(spec, tidal.run(spec).mlflow_run_id, "loss")
        assert loss[24] < 0.85 * loss[1], (loss[1], loss[24])

    @pytest.mark.extended  # outside the suite's budget (pyproject.toml): resumed samples also in test_stream_resume; parquet reading is unit-tested
    def test_parquet_job_resumes_with_the_same_samples(self, tmp_path):
        src = write_sources(tmp_path)["parquet"]
        common = {"data.source": src, "model.vocab_size": 256, "train.steps": 16, "checkpoint.every_steps": 4}
        # the undisturbed run's losses, stored: tests/golden.py writes the same parquet file to train it
        expected = reference_losses("models-data-pq-steady", tiny_spec(tmp_path, name="pq-steady", **common), tmp_path)
        tidal.run(tiny_spec(tmp_path, name="pq-restarted", **common, **{"train.stop_at": 6}))
        spec = tiny_spec(tmp_path, name="pq-restarted", **common)
        got = metric_history(spec, tidal.run(spec).mlflow_run_id, "loss")
        assert sorted(got) == list(range(1, 17))
        for step in range(1, 17):  # resumed from step 4: steps 5-6 replayed on the same samples
            assert got[step] == pytest.approx(expected[step], rel=1e-4), step  # stored: float tolerance

    @pytest.mark.extended  # outside the suite's budget (pyproject.toml): JSONL also streamed with a tokenizer above
    def test_jsonl_job_trains(self, tmp_path):
        src = write_sources(tmp_path)["jsonl"]
        spec = tiny_spec(tmp_path, name="jsonl", **{"data.source": src, "model.vocab_size": 256, "train.lr": 3e-3})
        loss = metric_history(spec, tidal.run(spec).mlflow_run_id, "loss")
        assert loss[24] < 0.8 * loss[1]
