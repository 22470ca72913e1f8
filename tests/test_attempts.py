"""A checkpoint is the files one attempt wrote: a save that died after one rank finished, then the
same step saved again at a smaller world size, then a grow back and an export, all on a real S3
API. Before attempts were told apart, the dead attempt's rank-1 files stayed in the folder, the
grow's universal conversion counted them as a rank (`shape '[N]' is invalid for input of size
2N`) and failed on every restart.

Rank 0's pause (TIDAL_TEST_CHECKPOINT_WRITE_DELAY_S) comes right before its write waits for the event
log (`before_manifest`, tidal.worker.checkpoint.snapshot), so the kill leaves the checkpoint as a crash during
that wait would: every file written, no manifest. That a manifest never precedes the events of the
steps before it is test_async_checkpoint_unit's; so this is also "a crash during the event-log
wait, then a resize": the steps whose events may be missing are after the resume point, trained
and logged again."""

from __future__ import annotations

import contextlib
import threading

import pytest

import tidal
from tests.conftest import metric_history, tiny_spec
from tests.golden import reference_losses
from tests.helpers import kill, our_processes
from tidal import fs
from tidal.storage import (
    QUARANTINE_FILE,
    STATE_FILE,
    RunDir,
    checkpoint_dir_name,
    listed_files,
    manifest_name,
)
from tidal.testing.processes import wait_for
from tidal.worker.checkpoint.snapshot import WRITE_DELAY_ENV

# The S3 server's address must be in the environment before this module's Ray instance starts.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("s3_server", "ray_local")]


def workers(n: int) -> dict[str, int]:
    return {"scaling.min_workers": n, "scaling.max_workers": n}


def kill_all_workers_once_rank1_wrote(run: RunDir, step: int, seen: dict[str, object]) -> None:
    """SIGKILL every train worker once rank 1's manifest of `step` is in storage and rank 0's is
    not (rank 0 pauses before its manifest): a node lost mid-save, one rank's files finished."""
    folder = f"{run.path}/{checkpoint_dir_name(step)}"
    wait_for(f"rank 1's manifest of step {step}", lambda: fs.exists(run.fs, f"{folder}/{manifest_name(1)}")
             and fs.exists(run.fs, f"{folder}/{STATE_FILE}"), 240, every=0.05)
    seen["rank0_unfinished"] = not fs.exists(run.fs, f"{folder}/{manifest_name(0)}")
    for proc in our_processes("RayTrainWorker"):
        kill(proc)
        seen["killed"] = True


@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.extended)])  # 3: the same attempts code
def test_a_save_that_died_never_mixes_with_the_same_step_saved_again(tmp_path, bucket, stage):
    common = {"parallelism.zero_stage": stage, "train.steps": 8, "checkpoint.every_steps": 4}
    # the undisturbed run's losses (2 workers, local path), stored (tests/golden.py regenerates them)
    expected = reference_losses(f"attempts-steady{stage}", tiny_spec(tmp_path, name=f"steady{stage}", **common))

    def job(n: int, **more: object):
        return tiny_spec(tmp_path, name=f"mixed{stage}", **common, **workers(n),
                         **{"checkpoint.storage": f"{bucket}/runs", **more})

    # 1. Two workers; rank 0 pauses 60 s before its manifest of step 4, rank 1 does not: both die
    #    once rank 1's files and manifest are in, and the job is not restarted.
    spec = job(2, **{"failure.max_restarts": 0}).with_overrides({"worker_env": {WRITE_DELAY_ENV: "60@0"}})
    run = RunDir(spec.checkpoint.storage, spec.name)
    seen: dict[str, object] = {}
    killer = threading.Thread(target=kill_all_workers_once_rank1_wrote, args=(run, 4, seen), daemon=True)
    killer.start()
    with contextlib.suppress(Exception):  # the run fails: that is the point
        tidal.run(spec)
    killer.join(timeout=5)
    assert seen.get("killed") and seen.get("rank0_unfinished"), seen
    # 2. One worker trains past step 4 again and saves it into the same folder; 3. two workers to the end.
    tidal.run(job(1, **{"train.stop_at": 4}))
    result = tidal.run(job(2))

    assert result.error is None, result.error
    got = metric_history(spec, result.mlflow_run_id, "loss")
    assert sorted(got) == list(range(1, 9)), "no step lost, none skipped"
    # Steps 1-4 keep the points the first run logged (replays are not logged again).
    assert fs.read_json(run.fs, f"{run.path}/{checkpoint_dir_name(4)}/{STATE_FILE}")["world_size"] == 1
    assert metric_history(spec, result.mlflow_run_id, "world_size")[8] == 2
    for step in range(1, 9):
        assert got[step] == pytest.approx(expected[step], rel=1e-4), step
    assert not [rel for rel in fs.files_under(run.fs, run.path) if QUARANTINE_FILE in rel]
    four = listed_files(run.fs, f"{run.path}/{checkpoint_dir_name(4)}")
    assert four and not [rel for rel in four if "zero_pp_rank_1" in rel], "step 4 is one worker's checkpoint"

    exported = tidal.export(job(2), checkpoint=8, output=tmp_path / f"export{stage}")
    assert exported.step == 8
