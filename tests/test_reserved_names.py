"""A job's name never owns another job's folder: `<name>.lease` is a job's lease, `<name>-sweep` a
sweep's state and `<name>-tN` a sweep's trial (tidal/spec/sections.py). A spec whose name ends so
is refused naming the field, before anything is read, written or submitted; a sweep's own trials
keep their names."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import tiny_spec
from tidal.errors import SpecError
from tidal.launch.sweep import trial_spec
from tidal.spec.job import JobSpec


@pytest.mark.parametrize(("name", "owner"), [("x.lease", "job 'x''s lease folder"), ("x-sweep", "job 'x''s sweep state folder")])
def test_a_name_ending_as_another_jobs_folder_is_refused_naming_the_field(name, owner):
    with pytest.raises(SpecError) as e:
        JobSpec().with_overrides({"name": name})
    [(field, message)] = e.value.problems
    assert field == "name" and owner in message and "choose a name" in message


def test_a_trials_name_is_refused_for_a_plain_run_and_a_submission(tmp_path: Path, monkeypatch):
    from tidal.launch import jobs, trainer

    spec = tiny_spec(tmp_path, name="x-t3")

    def never(*_a, **_k):
        raise AssertionError("reached past the name check")

    monkeypatch.setattr(trainer, "Lease", never)
    monkeypatch.setattr(jobs, "connect", never)
    for start in (trainer.run, jobs.submit):
        with pytest.raises(SpecError) as e:
            start(spec)
        [(field, message)] = e.value.problems
        assert field == "name" and "trial 3 of sweep 'x'" in message
    assert not (tmp_path / "runs").exists(), "nothing written"


def test_a_sweeps_trials_keep_their_names(tmp_path: Path):
    base = tiny_spec(tmp_path, name="x").model_dump(mode="json")
    assert trial_spec(base, {"train.lr": 1e-3}, "3").name == "x-t3"
