"""Checkpoints on object storage (a real S3 API: moto's server on 127.0.0.1), as on a cluster whose
on-prem and cloud nodes share nothing else: resizes resume from the newest checkpoint with nothing
quarantined, --restart sets the run aside, a finished job is not run again, retention holds, and
only a checkpoint proven corrupt or unsafe is ever condemned."""

from __future__ import annotations

import pytest

import tidal
from tests.conftest import metric_history, tiny_spec
from tests.golden import reference_losses
from tidal import fs
from tidal.storage import (
    QUARANTINE_FILE,
    UNSAFE,
    RunDir,
    check_complete,
    checkpoint_dir_name,
    manifest_name,
)
from tidal.worker.checkpoint import fetch
from tidal.worker.checkpoint.snapshot import WRITE_DELAY_ENV

# The S3 server's address must be in the environment before this module's Ray instance starts.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("s3_server", "ray_local")]


def workers(n: int) -> dict[str, int]:
    return {"scaling.min_workers": n, "scaling.max_workers": n}


def names(run: RunDir, pattern: str = "") -> list[str]:
    return sorted(rel for rel in fs.files_under(run.fs, run.path) if pattern in rel)


# ZeRO-3 only: tests/test_stream_resume.py resizes stage 2 on a local path (and test_user_code_e2e stage 3),
# and the storage code is the same for both stages; the stage-3 layout (partitioned parameters) is
# the harder one.
@pytest.mark.extended  # outside the suite's budget (pyproject.toml): ZeRO-3 resizes run in test_user_code_e2e, S3 restores in test_restore_e2e
@pytest.mark.parametrize("stage", [3])
def test_resize_on_s3_resumes_the_newest_checkpoint_with_nothing_quarantined(tmp_path, bucket, stage):
    common = {"parallelism.zero_stage": stage, "train.steps": 18, "checkpoint.every_steps": 6}
    # the undisturbed run's losses (local path), stored (tests/golden.py regenerates them)
    expected = reference_losses(f"s3-checkpoints-steady{stage}",
                                tiny_spec(tmp_path, name=f"steady{stage}", **common, **workers(2)))

    # One job on S3, three launches: 2 workers to step 6, 1 worker to step 12, 2 workers to the end.
    for n, until in ((2, 6), (1, 12), (2, 18)):
        spec = tiny_spec(tmp_path, name=f"resized{stage}", **common, **workers(n),
                         **{"train.stop_at": until, "checkpoint.storage": f"{bucket}/runs"})
        result = tidal.run(spec)

    got = metric_history(spec, result.mlflow_run_id, "loss")
    world = metric_history(spec, result.mlflow_run_id, "world_size")
    assert sorted(got) == list(range(1, 19)), "no step redone, none skipped"
    assert [world[s] for s in (6, 7, 12, 13, 18)] == [2, 1, 1, 2, 2]
    for step in range(1, 19):
        assert got[step] == pytest.approx(expected[step], rel=1e-4), step
    run = RunDir(spec.checkpoint.storage, spec.name)
    assert not names(run, QUARANTINE_FILE)
    # Each new rank read its slices of the old partitions by byte range: nothing converted
    assert not names(run, "_universal")


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): retention runs in test_eval, --restart is unit-tested on S3 (test_object_storage)
def test_finished_job_restart_and_retention_on_s3(tmp_path, bucket, capsys):
    spec = tiny_spec(tmp_path, name="again", **{"train.steps": 12, "checkpoint.every_steps": 2, "checkpoint.keep": 2,
                                                "checkpoint.storage": f"{bucket}/runs"})
    first = tidal.run(spec)
    assert first.error is None and first.path == f"{bucket}/runs/again/checkpoint_000000012"
    assert first.checkpoint.path.endswith("again/checkpoint_000000012")  # a ray.train.Checkpoint on S3
    assert list(first.metrics_dataframe["step"]) == list(range(1, 13))
    run = RunDir(spec.checkpoint.storage, spec.name)
    assert [p.rsplit("/", 1)[-1] for p in run.checkpoints()] == ["checkpoint_000000012", "checkpoint_000000010"]

    capsys.readouterr()
    again = tidal.run(spec)
    out = capsys.readouterr().out
    assert "already complete at step 12" in out and "--restart" in out and "train.steps" in out
    assert "nan" not in out and again.mlflow_run_id == first.mlflow_run_id
    assert sorted(metric_history(spec, first.mlflow_run_id, "loss")) == list(range(1, 13))

    fresh = tidal.run(spec, restart=True)
    assert fresh.mlflow_run_id != first.mlflow_run_id
    assert sorted(metric_history(spec, fresh.mlflow_run_id, "loss")) == list(range(1, 13))
    store, root = fs.resolve(f"{bucket}/runs")
    aside = [i.base_name for i in fs.list_dir(store, root) if i.base_name.startswith("again.replaced-")]
    assert len(aside) == 1, "the old run is kept aside, whole"
    assert "checkpoint_000000012/tidal-state.json" in fs.files_under(store, f"{root}/{aside[0]}")


def test_an_unsafe_manifest_a_corrupt_file_and_a_failed_load_cost_one_resume_and_condemn_only_the_bad(tmp_path,
                                                                                                      bucket):
    """Three faults of what storage holds, met by one resume from the newest checkpoint back:
    - step 12's manifest names a file outside its checkpoint (what a writer of one object under the
      run's prefix can do: on S3 `global_step12/../../x` is the key `<run>/x`, which exists, so the
      checkpoint counted as complete): condemned before anything loads, nothing written outside the
      restore cache;
    - step 8's model file is garbage of the right size (bit rot): quarantined when it does not
      unpickle, and Ray restarts the group;
    - step 4's load raises once (as an out-of-memory or a network error would): nothing is wrong
      with it, so it is not condemned; Ray restarts the group and the same checkpoint loads."""
    flag, cache = tmp_path / "fail-next-load", tmp_path / "cache"
    spec = tiny_spec(tmp_path, name="rotten", **{"train.steps": 16, "checkpoint.every_steps": 4,
                                                 "checkpoint.storage": f"{bucket}/runs", "failure.max_restarts": 3,
                                                 "model.builder": "tests.custom_model:build_flaky_load"})
    spec = spec.with_overrides({"worker_env": {"TIDAL_TEST_LOAD_FAULT": str(flag), fetch.CACHE_ENV: str(cache)}})
    tidal.run(spec.with_overrides({"train.stop_at": 12}))
    run = RunDir(spec.checkpoint.storage, spec.name)
    twelve, eight, four = run.checkpoints()[:3]
    with run.fs.open_output_stream(f"{run.path}/x") as f:
        f.write(b"abc")
    manifest = fs.read_json(run.fs, f"{twelve}/{manifest_name(1)}")
    manifest["files"] = {"global_step12/../../x": 3, **manifest["files"]}
    fs.write_json(run.fs, f"{twelve}/{manifest_name(1)}", manifest)
    # The model's file: DeepSpeed reads it before it loads the model (FlakyLoad), so this attempt
    # fails on the garbage alone and the injected failure waits for the checkpoint before it.
    victim = next(rel for rel in fs.files_under(run.fs, eight) if rel.endswith("model_states.pt"))
    size = fs.files_under(run.fs, eight)[victim]
    with run.fs.open_output_stream(f"{eight}/{victim}") as f:  # same size, garbage inside: bit rot
        f.write(b"\0" * size)
    flag.write_text("once")

    result = tidal.run(spec)

    assert result.error is None, result.error
    condemned = fs.read_json(run.fs, f"{twelve}/{QUARANTINE_FILE}")
    assert condemned is not None and UNSAFE in condemned["error"], condemned
    marker = fs.read_json(run.fs, f"{eight}/{QUARANTINE_FILE}")
    assert marker is not None and "does not unpickle" in marker["error"] and victim.rsplit("/", 1)[-1] in marker["error"]
    assert not flag.exists(), "the injected failure happened"
    assert four.endswith(checkpoint_dir_name(4))
    assert names(run, QUARANTINE_FILE) == [f"{p.rsplit('/', 1)[-1]}/{QUARANTINE_FILE}" for p in (eight, twelve)], \
        "only the two bad ones"
    assert not list(cache.rglob("x")), "nothing written outside its folder"
    assert sorted(metric_history(spec, result.mlflow_run_id, "loss")) == list(range(1, 17))
    assert metric_history(spec, result.mlflow_run_id, "restarts")[16] >= 2, "both load faults failed an attempt"
    # Each resume went back to step 4 (a rank that loaded may say so in the attempt its peer failed)
    assert metric_history(spec, result.mlflow_run_id, "max_steps_lost")[16] == 8, "resumed from step 4, not from scratch"


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): background writes run in test_async_checkpoint
def test_background_writes_land_complete_checkpoints_on_s3(tmp_path, bucket):
    """Asynchronous checkpoints every 2 steps into S3, each write slowed to 1 s so every save waits
    for the one before (back-pressure): every checkpoint lands whole and Ray registers the last."""
    spec = tiny_spec(tmp_path, name="async-s3", **{"train.steps": 8, "checkpoint.every_steps": 2, "checkpoint.keep": 4,
                                                   "checkpoint.storage": f"{bucket}/runs"},
                     worker_env={WRITE_DELAY_ENV: "1"})
    result = tidal.run(spec)

    run = RunDir(spec.checkpoint.storage, spec.name)
    assert [p.rsplit("/", 1)[-1] for p in run.checkpoints()] == [checkpoint_dir_name(s) for s in (8, 6, 4, 2)]
    for path in run.checkpoints():
        assert check_complete(run.fs, path)[0] is None, path
    assert result.path == f"{bucket}/runs/async-s3/{checkpoint_dir_name(8)}"
    assert sorted(metric_history(spec, result.mlflow_run_id, "loss")) == list(range(1, 9))
    assert run.latest_complete().step == 8
