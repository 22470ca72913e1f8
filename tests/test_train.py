"""End to end on a real local Ray instance with real DeepSpeed engines on gloo."""

from __future__ import annotations

import math

import pytest
from mlflow.tracking import MlflowClient

import tidal
from tests.conftest import metric_history, tiny_spec
from tidal.storage import RunDir

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]


# ZeRO-1 and ZeRO-2 share DeepSpeed's stage_1_and_2.py: stage 2 covers both here (the pipeline test in
# tests/test_models_data.py trains ZeRO-1 end to end).
@pytest.mark.extended  # outside the suite's budget (pyproject.toml): a job trains and tracks end to end in test_cli_e2e and test_telemetry
@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.extended)])  # 3 trains in test_user_code_e2e
def test_zero_stage_trains_and_tracks(tmp_path, stage):
    spec = tiny_spec(tmp_path, name=f"zero{stage}", **{"parallelism.zero_stage": stage})
    result = tidal.run(spec)

    loss = metric_history(spec, result.mlflow_run_id, "loss")
    assert sorted(loss) == list(range(1, 25)), "one loss point per logged step"
    assert loss[24] < 0.7 * loss[1], f"loss did not fall: {loss[1]:.3f} -> {loss[24]:.3f}"
    for key in ("lr", "tokens_per_s", "samples_per_s", "step_time_s", "world_size", "mfu"):
        assert sorted(metric_history(spec, result.mlflow_run_id, key)) == list(range(1, 25)), key
    assert metric_history(spec, result.mlflow_run_id, "tokens_seen")[24] == 24 * 16 * 16  # steps x batch x seq_len
    # Every rank's stall reaches the log step after a save (saves at 8, 16, 24): the slowest rank's.
    blocked = metric_history(spec, result.mlflow_run_id, "checkpoint_blocked_max_s")
    assert all(blocked[s] == 0 for s in range(1, 9)) and blocked[9] > 0 and blocked[17] > 0, blocked
    run = MlflowClient(spec.tracking.uri).get_run(result.mlflow_run_id)
    assert run.data.params["parallelism.zero_stage"] == str(stage)
    assert run.data.params["model.d_model"] == "64"
    assert run.data.tags["tidal.job"] == spec.name
    assert run.info.status == "FINISHED"
    assert result.final_loss == pytest.approx(loss[24])
    # The job file names the run (tidal export logs there); a checkpoint keeps what a resume
    # needs and who wrote it, not the run.
    run_dir = RunDir(spec.checkpoint.storage, spec.name)
    assert run_dir.read_json("tidal-job.json")["mlflow_run_id"] == result.mlflow_run_id
    last = run_dir.latest_complete()
    assert last is not None and "mlflow_run_id" not in last.state
    assert (last.state["world_size"], last.state["zero_stage"], last.state["step"]) == (2, stage, 24)
    assert last.state["fingerprint"] == spec.resume_fingerprint() and last.state["attempt"]


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): test_stream_resume compares 1 and 2 workers with a stored 2-worker run
def test_one_and_two_workers_agree(tmp_path):
    """Data parallelism changes who computes what, not the result: same seed, same global batch."""
    losses = {}
    for workers in (1, 2):
        spec = tiny_spec(tmp_path, name=f"dp{workers}", **{"scaling.min_workers": workers, "scaling.max_workers": workers, "train.steps": 8})
        result = tidal.run(spec)
        losses[workers] = metric_history(spec, result.mlflow_run_id, "loss")
    assert sorted(losses[1]) == sorted(losses[2]) == list(range(1, 9))
    for step in losses[1]:
        assert math.isclose(losses[1][step], losses[2][step], rel_tol=1e-4), (step, losses[1][step], losses[2][step])
