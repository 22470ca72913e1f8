"""TrainState holds only what a resume restores; who wrote a checkpoint is saved beside it."""

from __future__ import annotations

from dataclasses import asdict

from tidal.worker.checkpoint.save import Provenance, TrainState

# A state file as checkpoints written before TrainState shrank carry it.
OLD = {"step": 40, "samples_seen": 1280, "tokens_seen": 81920, "world_size": 2, "zero_stage": 2,
       "mlflow_run_id": "a" * 32, "data_ended": True, "fingerprint": {"model.d_model": 64},
       "attempt": "0123456789ab", "evaluation": {"step": 40, "best": 2.5, "since_best": 1}}


def test_an_old_checkpoints_state_file_still_resumes():
    state = TrainState.from_saved(OLD)
    assert state == TrainState(step=40, data_ended=True, evaluation={"step": 40, "best": 2.5, "since_best": 1})


def test_a_new_state_file_round_trips_and_keeps_the_keys_storage_reads():
    state = TrainState(step=8, evaluation={"step": 8})
    written_by = Provenance(world_size=2, zero_stage=3, fingerprint={"model.d_model": 64})
    saved = {**asdict(state), **asdict(written_by), "attempt": "x"}  # as checkpoint.save writes it
    assert {"step", "world_size", "zero_stage", "fingerprint", "attempt"} <= saved.keys()
    assert "mlflow_run_id" not in saved and "samples_seen" not in saved
    assert TrainState.from_saved(saved) == state
