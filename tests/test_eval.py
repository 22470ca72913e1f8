"""Evaluation in real jobs (Ray Train + DeepSpeed ZeRO-2 on 2 CPU workers, MLflow on SQLite):
eval_loss once per eval step across a worker's death, the best checkpoint kept through
retention, and early stopping that ends the job, says why, and leaves it complete."""

from __future__ import annotations

import math

import pytest

import tidal
from tests.conftest import ONE_WORKER, metric_history, tiny_spec
from tests.golden import reference_losses
from tests.helpers import run_killing_a_worker
from tidal.eval_best import best_checkpoint
from tidal.storage import RunDir

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]

LONG = {"train.steps": 60, "train.global_batch": 64, "checkpoint.every_steps": 10}
EVAL = {"eval": {"every_steps": 5, "batches": 2}}


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): eval runs in the retention test below; logging once across restarts in test_driver_resume
def test_eval_loss_is_logged_once_per_eval_step_across_a_restart(tmp_path):
    """Also the exact-resume test: a worker killed mid-run, and the job with eval trains exactly
    like an undisturbed one without it."""
    # the undisturbed run's losses, stored (tests/golden.py regenerates them)
    expected = reference_losses("eval-plain", tiny_spec(tmp_path, name="plain", **LONG))

    spec = tiny_spec(tmp_path, name="evaluated", **LONG, **EVAL)
    result, killed = run_killing_a_worker(spec, 25)  # past the checkpoint at step 20, evaluations 5..25 logged
    assert killed, "no worker was killed"
    assert metric_history(spec, result.mlflow_run_id, "restarts")[60] >= 1
    losses = metric_history(spec, result.mlflow_run_id, "loss")  # fails on a step logged twice
    assert sorted(losses) == list(range(1, 61)), "every step logged"
    for step in expected:  # stored on another machine maybe: float tolerance (tests/golden.py)
        assert losses[step] == pytest.approx(expected[step], rel=1e-4), step
    evals = metric_history(spec, result.mlflow_run_id, "eval_loss")  # fails on a step logged twice
    assert sorted(evals) == list(range(5, 61, 5))
    ppl = metric_history(spec, result.mlflow_run_id, "eval_perplexity")
    assert all(ppl[s] == pytest.approx(math.exp(evals[s]), rel=1e-6) for s in evals)
    assert evals[60] < evals[5], "the model learned the task, and evaluation measures it"


def test_best_checkpoint_survives_retention_and_early_stopping_ends_the_job(tmp_path, capfd):
    # one worker: retention and early stopping are the driver's decisions, the same at any size
    good = tiny_spec(tmp_path, name="best", **{**ONE_WORKER,
                                               "train.steps": 16, "checkpoint.every_steps": 4, "checkpoint.keep": 1,
                                               "checkpoint.keep_best": {"metric": "eval_loss"},
                                               "eval": {"every_steps": 4, "batches": 2}})
    first = tidal.run(good)
    run = RunDir(good.checkpoint.storage, good.name)
    best = best_checkpoint(run)
    assert best is not None and best.step in (12, 16)  # the model still learns: a late one

    # The same job continued with a learning rate that wrecks it: evaluation gets worse from here.
    bad = good.with_overrides({"train.steps": 40, "train.lr": 1.0, "eval.patience": 2})
    capfd.readouterr()
    second = tidal.run(bad)
    out = capfd.readouterr().out
    stop = best.step + 2 * 4  # two evaluations (every 4 steps) without improving on the best
    evals = metric_history(bad, second.mlflow_run_id, "eval_loss")
    assert second.mlflow_run_id == first.mlflow_run_id and sorted(evals) == list(range(4, stop + 1, 4))
    assert all(evals[s] > evals[best.step] for s in (20, stop))
    assert metric_history(bad, second.mlflow_run_id, "early_stopped") == {stop: 1.0}
    assert f"ended at step {stop} of 40: early stopping: eval_loss has not improved for 2 evaluation(s)" in out
    assert f"at step {best.step}" in out

    # keep: 1 leaves the newest (the stopping step) and the best, older one; nothing else.
    assert [p.rsplit("/", 1)[-1] for p in run.checkpoints()] == [f"checkpoint_{stop:09d}", best.name]
    assert best_checkpoint(run).step == best.step

    again = tidal.run(bad)
    out = capfd.readouterr().out
    assert f"already complete at step {stop}" in out and "early stopping" in out and "eval.patience=null" in out
    assert again.mlflow_run_id == first.mlflow_run_id


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): sweeps run in test_sweep and test_sweep_resume
def test_a_sweep_ranks_trials_by_eval_loss(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from tidal.launch.sweep import sweep

    monkeypatch.chdir(tmp_path)  # MLflow puts a SQLite store's artifacts under ./mlruns
    spec = tiny_spec(tmp_path, name="swe", **{"train.steps": 8, "checkpoint.every_steps": 4,
                                              "eval": {"every_steps": 4, "batches": 1}})
    result = sweep(spec, params={"train.lr": "grid:1e-2,1e-4"}, metric="eval_loss", max_concurrent=1)
    assert result.metric == "eval_loss" and result.trials["eval_loss"].notna().all()
    client = MlflowClient(spec.tracking.uri)
    children = [client.get_run(c.info.run_id) for c in client.search_runs(
        [client.get_experiment_by_name(spec.tracking.experiment).experiment_id],
        f"tags.`mlflow.parentRunId` = '{result.parent_run_id}'")]
    best = min(children, key=lambda c: c.data.metrics["eval_loss"])
    assert result.best_spec.train.lr == pytest.approx(float(best.data.params["train.lr"]))
    assert result.best_metrics["eval_loss"] == pytest.approx(best.data.metrics["eval_loss"])
