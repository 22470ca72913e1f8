"""Evaluation without Ray: the held-out split training never reads, bad eval settings named by
field, the best checkpoint and what retention spares, the early-stopping decision."""

from __future__ import annotations

import json
import math
import random
import string
from pathlib import Path

import pytest
import torch

from tests.helpers import fake_checkpoint, ray_registers
from tidal.errors import SpecError
from tidal.eval_best import best_checkpoint, improved, spared, stopped_early
from tidal.spec.job import JobSpec
from tidal.spec.load import load_spec
from tidal.spec.sweep import SweepSpec, check_metric
from tidal.storage import STATE_FILE, RunDir
from tidal.worker.data import Batches, split_holdout
from tidal.worker.evaluate import eval_source

CPU = torch.device("cpu")


def text_job(tmp_path: Path, **overrides) -> JobSpec:
    """A job on a small jsonl corpus (byte tokens) whose held-out split the tests inspect."""
    corpus = tmp_path / "corpus.jsonl"
    rng = random.Random(0)  # no two windows alike, so a window's content identifies it
    docs = ["".join(rng.choice(string.ascii_letters) for _ in range(rng.randint(20, 80))) for _ in range(40)]
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    base = {"model": {"n_layer": 1, "n_head": 2, "d_model": 16, "vocab_size": 256, "seq_len": 16},
            "data": {"source": str(corpus)}, "train": {"micro_batch": 2, "global_batch": 8},
            "eval": {"holdout": 0.2, "every_steps": 5}}
    return JobSpec.model_validate(base).with_overrides(overrides) if overrides else JobSpec.model_validate(base)


def rows(t: torch.Tensor) -> set[tuple[int, ...]]:
    return {tuple(r.tolist()) for r in t}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_training_never_reads_the_held_out_samples(tmp_path, world):
    spec = text_job(tmp_path)
    seen: set[tuple[int, ...]] = set()
    held = None
    for rank in range(world):
        batches = Batches(spec, rank, world, CPU)
        held = rows(batches.held_out) if held is None else held
        assert rows(batches.held_out) == held, "every rank holds out the same samples"
        n_train = len(batches.source.windows)
        for step in range(1, 3 * n_train // spec.train.global_batch + 2):  # three epochs and more
            for x, y in batches.for_step(step):
                seen |= rows(torch.cat([x, y[:, -1:]], dim=1))
    all_windows = Batches(spec.with_overrides({"eval": None}), 0, 1, CPU).source.windows
    assert held and len(held) == round(0.2 * len(all_windows))
    assert not seen & held, "a held-out sample reached training"
    assert seen == rows(all_windows) - held, "training reads every other sample"
    # and evaluation reads exactly the held-out ones
    ev = eval_source(spec, Batches(spec, 0, 1, CPU).held_out)
    assert rows(ev.samples(0, len(held))) == held


def test_split_is_seeded_and_a_count_works():
    train, held = split_holdout(100, 7, seed=3)
    assert len(held) == 7 and len(train) == 93 and not set(train.tolist()) & set(held.tolist())
    assert torch.equal(held, split_holdout(100, 7, seed=3)[1])
    assert not torch.equal(held, split_holdout(100, 7, seed=4)[1])


def test_a_holdout_that_leaves_nothing_to_train_is_refused():
    with pytest.raises(Exception, match="eval.holdout"):
        split_holdout(10, 10, seed=0)


def test_a_holdout_changes_the_resume_fingerprint_only_when_set(tmp_path):
    spec = text_job(tmp_path)
    assert spec.resume_fingerprint()["eval.holdout"] == 0.2
    plain = spec.with_overrides({"eval": None})
    assert "eval.holdout" not in plain.resume_fingerprint()
    synthetic = JobSpec(eval={"every_steps": 5})
    assert synthetic.fingerprint_hash() == JobSpec().fingerprint_hash(), "adding eval keeps the job's MLflow run"


def problems(tmp_path: Path, text: str) -> dict[str, str]:
    p = tmp_path / "job.yaml"
    p.write_text(text)
    with pytest.raises(SpecError) as e:
        load_spec(p)
    return dict(e.value.problems)


def test_bad_eval_settings_are_refused_naming_the_field(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello " * 100)
    assert "fraction" in problems(tmp_path, "eval: {holdout: 1.5}")["eval.holdout"]
    assert "at least 1" in problems(tmp_path, "eval: {holdout: 0}")["eval.holdout"]
    assert "greater than or equal to 1" in problems(tmp_path, "eval: {every_steps: 0}")["eval.every_steps"]
    assert "did you mean 'patience'" in problems(tmp_path, "eval: {patiense: 3}")["eval.patiense"]
    assert "nothing to split" in problems(tmp_path, "eval: {holdout: 0.1}")["eval.holdout"]
    assert "fraction" in problems(tmp_path, f"data: {{source: {corpus}}}\neval: {{}}")["eval.holdout"]
    assert "file not found" in problems(tmp_path, "eval: {source: nowhere.jsonl}")["eval.source"]
    p = problems(tmp_path, f"data: {{source: {corpus}}}\neval: {{source: {corpus}, holdout: 0.1}}")
    assert "remove one" in p["eval.holdout"]
    p = problems(tmp_path, f"data: {{source: {corpus}, streaming: true}}\neval: {{holdout: 0.1}}")
    assert "streamed" in p["eval.source"]
    assert "add an eval section" in problems(tmp_path, "checkpoint: {keep_best: {metric: eval_loss}}")["checkpoint.keep_best"]
    assert "eval_loss" in problems(tmp_path, "eval: {}\ncheckpoint: {keep_best: {metric: loss}}")["checkpoint.keep_best.metric"]
    pipeline = ("model: {n_layer: 2}\nparallelism: {pipeline_stages: 2, zero_stage: 1}\n"
                "scaling: {min_workers: 2, max_workers: 2}\ntrain: {global_batch: 16, micro_batch: 8}\neval: {}")
    assert "pipeline" in problems(tmp_path, pipeline)["eval"]
    user = "model: {builder: jobs.mlp_classifier:model}\ndata: {dataset: jobs.mlp_classifier:dataset}\neval: {}"
    assert "data.dataset is not supported" in problems(tmp_path, user)["eval"]


def test_a_sweep_on_eval_loss_needs_an_eval_section():
    with pytest.raises(SpecError) as e:
        check_metric(JobSpec(), SweepSpec(metric="eval_loss"))
    assert "eval section" in dict(e.value.problems)["sweep.metric"]
    check_metric(JobSpec(eval={}), SweepSpec(metric="eval_loss"))  # accepted


def evaluated(run: Path, step: int, eval_loss: float | None) -> None:
    """A complete fake checkpoint whose state records an evaluation at its step."""
    d = fake_checkpoint(run, step)
    state = json.loads((d / STATE_FILE).read_text())
    if eval_loss is not None:
        state["evaluation"] = {"step": step, "metrics": {"eval_loss": eval_loss}}
    text = json.dumps(state)
    (d / STATE_FILE).write_text(text)
    manifest = d / "tidal-manifest-rank00000.json"  # keep the recorded size right: still complete
    m = json.loads(manifest.read_text())
    m["files"][STATE_FILE] = len(text)
    manifest.write_text(json.dumps(m))


def test_best_checkpoint_is_read_from_the_checkpoints(tmp_path):
    run = tmp_path / "job"
    for step, loss in [(10, 2.0), (20, 1.5), (30, 1.7), (40, None)]:
        evaluated(run, step, loss)
    found = best_checkpoint(RunDir(str(tmp_path), "job"))
    assert found is not None and found.step == 20
    assert best_checkpoint(RunDir(str(tmp_path), "job"), mode="max").step == 10
    assert best_checkpoint(RunDir(str(tmp_path), "empty")) is None


def test_retention_spares_the_best_checkpoint(tmp_path):
    spec = JobSpec(name="job", eval={}, checkpoint={"keep": 1, "storage": str(tmp_path), "keep_best": {}})
    run = tmp_path / "job"
    for step, loss in [(10, 2.0), (20, 1.5), (30, 1.7), (40, 1.9)]:
        evaluated(run, step, loss)
    rd = RunDir(str(tmp_path), "job")
    ray_registers(rd, keep=1)(40)  # Ray registered the newest; the others it never saw
    rd.prune(1, spare=spared(spec, rd))
    assert sorted(p.name for p in run.iterdir() if p.is_dir()) == ["checkpoint_000000020", "checkpoint_000000040"]
    assert spared(spec.with_overrides({"checkpoint.keep_best": None}), rd) == []


def test_improvement_and_early_stopping_decisions():
    assert improved(1.0, None) and improved(0.9, 1.0) and not improved(1.0, 1.0)
    assert not improved(0.95, 1.0, min_delta=0.1) and improved(0.85, 1.0, min_delta=0.1)
    spec = JobSpec(eval={"patience": 2})
    state = {"step": 30, "evaluation": {"stopped_early": True, "since_best": 2}}
    assert stopped_early(spec, state)
    assert not stopped_early(spec.with_overrides({"eval.patience": 3}), state), "a larger patience trains on"
    assert not stopped_early(spec.with_overrides({"eval.patience": None}), state)
    assert not stopped_early(spec, {"step": 30})


def test_evaluation_is_the_mean_held_out_loss_and_leaves_training_as_it_was(tmp_path):
    """On a real model (the built-in GPT with dropout, no DeepSpeed) in a one-process gloo group."""
    import torch.distributed as dist

    from tidal.worker.evaluate import Evaluator
    from tidal.worker.models import build_model

    spec = text_job(tmp_path, **{"model.dropout": 0.5, "eval.batches": 3})
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        batches = Batches(spec, 0, 1, CPU)
        model = build_model(spec.model)
        evaluator = Evaluator(spec, 0, 1, CPU, batches.held_out)
        record: dict = {}
        torch.manual_seed(1)
        metrics, stop = evaluator.run(model, record, step=5)
        after = torch.rand(1)
        assert model.training, "back in train mode"
        with torch.no_grad():  # every held-out window once per batch of 8 (the set cycles), in eval mode
            model.eval()
            seqs = torch.cat([evaluator.source.samples(b * 8, 8) for b in range(3)])
            expected = sum(float(model(c[:, :-1], c[:, 1:])) * len(c) for c in seqs.split(2)) / len(seqs)
            model.train()
        assert metrics["eval_loss"] == pytest.approx(expected, rel=1e-6)
        assert metrics["eval_perplexity"] == pytest.approx(math.exp(expected), rel=1e-6)
        assert record == {"best": metrics["eval_loss"], "best_step": 5, "since_best": 0, "step": 5,
                          "metrics": metrics, "stopped_early": False} and not stop
        assert evaluator.run(model, record, step=10)[0] == metrics, "the same sequences every time"
        assert record["since_best"] == 1
        torch.manual_seed(1)
        assert torch.equal(torch.rand(1), after), "evaluation draws nothing from the global RNG"
    finally:
        dist.destroy_process_group()
