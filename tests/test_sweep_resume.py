"""A sweep resumes from its JSON state, never from Tune's pickles (issue #47): whoever can write to the
sweep's storage plants a `tuner.pkl` that runs code when unpickled; `tidal sweep` resumed runs none
of it, and reruns only the trial that had not finished (on real Ray, one short trial)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import yaml

from tests.conftest import ONE_WORKER, tiny_spec
from tidal.cli import main
from tidal.launch.sweep import _fingerprint, _trial_base
from tidal.launch.sweep_state import SWEEP_FILE, SweepState, new_trials, plan_trials
from tidal.spec.load import load_sweep_section
from tidal.spec.sweep import merged
from tidal.storage import RunDir

pytestmark = pytest.mark.slow
PARAMS = ["train.lr=grid:0.01,0.003"]


class Planted:
    """What an attacker puts in tuner.pkl: unpickling it writes `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('unpickled')",))


@pytest.mark.usefixtures("ray_local")
def test_a_planted_tuner_pickle_never_runs_and_the_sweep_resumes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # MLflow puts a SQLite store's artifacts under ./mlruns
    spec = tiny_spec(tmp_path, name="rs", **{"train.steps": 4, "checkpoint.every_steps": 4, "train.log_every": 2,
                                                   **ONE_WORKER})
    path = tmp_path / "rs.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in spec.model_dump(mode="json").items() if k != "sweep"}))
    # An interrupted sweep: trial 0 completed, trial 1 was running when it stopped.
    loaded, section = load_sweep_section(path, ["sweep.max_concurrent=1"])
    cfg = merged(section, PARAMS)
    base = _trial_base(loaded, cfg)
    trials = new_trials(plan_trials(cfg.parsed(), cfg.samples, cfg.seed))
    trials[0].update(status="completed", step=4, metrics={"loss": 3.0})
    trials[1]["status"] = "running"
    folder = RunDir(base.checkpoint.storage, "rs-sweep")
    folder.write_json(SWEEP_FILE, SweepState("", _fingerprint(base, cfg), trials).as_json())
    marker = tmp_path / "planted-code-ran"
    experiment = Path(base.checkpoint.storage) / "rs-sweep"
    (experiment / "tuner.pkl").write_bytes(pickle.dumps(Planted(marker)))
    (experiment / "trainable.pkl").write_bytes(pickle.dumps(Planted(marker)))

    code = main(["sweep", str(path), "--param", PARAMS[0], "--set", "sweep.max_concurrent=1"])
    out = capsys.readouterr().out
    assert not marker.exists(), "a pickle from the sweep's storage was loaded"
    assert code == 0, out[-3000:]
    assert "resuming sweep 'rs'" in out and "1 of 2 trial(s) to run" in out
    assert not (Path(base.checkpoint.storage) / "rs-t0").exists(), "the completed trial did not run again"
    assert (Path(base.checkpoint.storage) / "rs-t1" / "tidal-job.json").is_file(), "the unfinished trial ran"
    state = folder.read_json(SWEEP_FILE)
    assert [t["status"] for t in state["trials"]] == ["completed", "completed"]
    assert state["trials"][1]["values"] == {"train.lr": 0.003}
