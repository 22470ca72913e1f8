"""jobs/mlp-classifier.yaml (a user model, dataset and step; not a language model) on real Ray and
DeepSpeed: a passthrough key reaches the engine, a killed worker resumes exactly (ZeRO-2), and the
job resizes 2 -> 1 -> 2 workers across ZeRO-3 with the losses of a run that never did."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import tidal
from tests.conftest import metric_history
from tests.golden import REFERENCES, reference_losses
from tidal.spec.job import JobSpec
from tidal.spec.load import load_spec
from tidal.testing.runs import prepared_store

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]

EXAMPLE = Path(__file__).resolve().parents[1] / "jobs" / "mlp-classifier.yaml"
STEPS = 60  # checkpoints every 20 steps (the example's)


def example(tmp: Path, name: str, **overrides: Any) -> JobSpec:
    return load_spec(EXAMPLE).with_overrides({
        "name": name, "checkpoint.storage": str(tmp / "runs"), "checkpoint.keep": 10,
        "tracking.uri": prepared_store(tmp / "mlflow.db"), "tracking.experiment": "tests", "train.log_every": 1,
        "failure.max_restarts": 2, "train.step_fn": "tests.user_step_probe:step",
        "worker_env.TIDAL_TEST_PROBE": str(tmp / name / "probe"), **overrides})


def losses(spec: JobSpec) -> dict[int, float]:
    return metric_history(spec, tidal.run(spec).mlflow_run_id, "loss")


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    tmp = tmp_path_factory.mktemp("undisturbed")
    (tmp / "steady").mkdir()
    spec = example(tmp, "steady", **{"parallelism.deepspeed.steps_per_print": 1000})
    got = losses(spec)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got[STEPS] < 0.5 * got[1], "the classifier did not learn"
    return tmp, got


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): killed workers resume exactly in test_chaos and test_async_checkpoint
def test_a_killed_worker_resumes_exactly(undisturbed, tmp_path):
    _, expected = undisturbed
    (tmp_path / "killed").mkdir()
    # 2 micro-batches per step per worker: the 60th is in step 30, past the checkpoint at step 20
    spec = example(tmp_path, "killed", **{"worker_env.TIDAL_TEST_DIE_AT": "60"})
    result = tidal.run(spec)
    assert (tmp_path / "killed" / "probe.died").exists(), "the worker never died"
    got = metric_history(spec, result.mlflow_run_id, "loss")
    assert sorted(got) == list(range(1, STEPS + 1)), "every step logged exactly once"
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-6), step
    assert metric_history(spec, result.mlflow_run_id, "restarts")[STEPS] >= 1


def test_resizes_across_zero3_keep_the_losses_and_passthrough_keys_reach_the_engine(tmp_path):
    """Against the example's undisturbed run at ZeRO-2 on 2 workers, stored (`python -m tests.golden
    user-code-steady`); the first launch's engine shows the DeepSpeed keys the job passed through."""
    expected = reference_losses("user-code-steady", REFERENCES["user-code-steady"](tmp_path), tmp_path)
    (tmp_path / "resized").mkdir()
    for workers, until in ((2, 20), (1, 40), (2, STEPS)):  # one job, three launches
        spec = example(tmp_path, "resized", **{"parallelism.zero_stage": 3, "train.stop_at": until,
                                                "scaling.min_workers": workers, "scaling.max_workers": workers,
                                                "parallelism.deepspeed.steps_per_print": 1000})
        result = tidal.run(spec)
    for rank in (0, 1):
        engine = json.loads((tmp_path / "resized" / f"probe.rank{rank}").read_text())
        # the example's own key, one set like --set, and what Tidal derived beside them
        assert engine["reduce_bucket_size"] == 500_000
        assert engine["steps_per_print"] == 1000
        assert engine["zero_stage"] == 3
        assert engine["optimizer"] == "Adam"  # train.optimizer: Adam, not DeepSpeed's AdamW default
        assert engine["lr_scheduler"] == "LambdaLR"  # train.schedule: wsd, which DeepSpeed lacks
    got = metric_history(spec, result.mlflow_run_id, "loss")
    assert got[STEPS] < 0.5 * got[1], "the classifier did not learn"
    world = metric_history(spec, result.mlflow_run_id, "world_size")
    assert sorted(got) == list(range(1, STEPS + 1))
    assert [world[s] for s in (20, 21, 40, 41, 60)] == [2, 1, 1, 2, 2]
    for step in expected:  # ZeRO-3 at 1 or 2 workers against ZeRO-2 at 2: equal to float tolerance
        assert got[step] == pytest.approx(expected[step], rel=1e-4), step
    # Each new rank read its slices of the old partitions (tidal.worker.checkpoint.repartition_zero3): nothing converted
    assert not list((tmp_path / "runs" / "resized").glob("checkpoint_*/global_step*_universal*"))
