"""Which checkpoint a resume picks: the newest complete one, never a half-written one."""

from __future__ import annotations

import logging

import pytest

from tests.helpers import fake_checkpoint
from tidal.errors import CheckpointError
from tidal.spec.job import JobSpec
from tidal.storage import STATE_FILE, RunDir, check_compatible, manifest_name


def test_newest_complete_wins(tmp_path):
    for s in (10, 20, 30):
        fake_checkpoint(tmp_path / "job", s)
    found = RunDir(str(tmp_path), "job").latest_complete()
    assert found is not None and found.step == 30 and found.name == "checkpoint_000000030"


def test_truncated_file_is_skipped_with_a_warning(tmp_path, caplog):
    fake_checkpoint(tmp_path / "job", 10)
    newest = fake_checkpoint(tmp_path / "job", 20)
    victim = newest / "global_step20" / "zero_pp_rank_1_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[:50])
    with caplog.at_level(logging.WARNING, logger="tidal"):
        found = RunDir(str(tmp_path), "job").latest_complete()
    assert found is not None and found.step == 10
    assert "checkpoint_000000020" in caplog.text and "truncated" in caplog.text


def test_missing_rank_manifest_is_incomplete(tmp_path):
    fake_checkpoint(tmp_path / "job", 10)
    newest = fake_checkpoint(tmp_path / "job", 20)
    (newest / manifest_name(1)).unlink()
    assert RunDir(str(tmp_path), "job").latest_complete().step == 10


def test_missing_state_file_is_incomplete(tmp_path):
    newest = fake_checkpoint(tmp_path / "job", 20)
    (newest / STATE_FILE).unlink()
    assert RunDir(str(tmp_path), "job").latest_complete() is None


def test_no_run_folder_means_fresh_start(tmp_path):
    assert RunDir(str(tmp_path), "never-ran").latest_complete() is None


def test_changed_model_is_refused_naming_fields():
    saved = {"step": 40, "fingerprint": JobSpec().resume_fingerprint()}
    changed = JobSpec().with_overrides({"model.d_model": 128, "model.n_layer": 6})
    with pytest.raises(CheckpointError) as e:
        check_compatible(changed, saved)
    assert "model.d_model: 256 -> 128" in str(e.value) and "model.n_layer: 4 -> 6" in str(e.value)
    assert "--restart" in str(e.value)


def test_longer_run_may_resume():
    saved = {"step": 40, "fingerprint": JobSpec().resume_fingerprint()}
    check_compatible(JobSpec().with_overrides({"train.steps": 1000, "train.lr": 1e-3}), saved)


def test_quarantined_checkpoint_is_skipped(tmp_path):
    from tidal.storage import quarantine

    fake_checkpoint(tmp_path / "job", 10)
    fake_checkpoint(tmp_path / "job", 20)
    run = RunDir(str(tmp_path), "job")
    quarantine(run.latest_complete(), "zero_pp_rank_0_optim_states.pt does not unpickle")
    found = run.latest_complete()
    assert found is not None and found.step == 10


def test_pipeline_checkpoint_is_refused_at_another_world_size():
    pipe = {"parallelism.pipeline_stages": 2, "parallelism.zero_stage": 1, "model.n_layer": 2}
    written = JobSpec().with_overrides({**pipe, "scaling.min_workers": 2, "scaling.max_workers": 2})
    saved = {"step": 40, "world_size": 2, "fingerprint": written.resume_fingerprint()}
    check_compatible(written, saved)
    with pytest.raises(CheckpointError) as e:
        check_compatible(written.with_overrides({"scaling.min_workers": 4, "scaling.max_workers": 4}), saved)
    assert "written by 2" in str(e.value) and "scaling.min_workers = scaling.max_workers = 2" in str(e.value)
