"""The memory tier on by default (issue 76): a job file with no `checkpoint.memory` keeps host-memory
snapshots at an interval that chooses itself (every_steps auto), `checkpoint.memory: null` turns
the tier off, and the quickstart as a new user runs it, a worker killed mid-run, resumes from
memory, replays at most one snapshot interval and reads no checkpoint object from storage."""

from __future__ import annotations

import re

import pytest

import tidal
from tests.conftest import ROOT, metric_history
from tests.helpers import kill_a_worker_at
from tests.memory_jobs import resumes
from tidal.errors import SpecError
from tidal.spec.load import load_spec
from tidal.testing.runs import prepared_store
from tidal.worker.checkpoint import fetch, keeper

QUICKSTART = ROOT / "jobs" / "quickstart.yaml"


def test_the_quickstart_with_no_memory_setting_has_the_tier_on_at_a_chosen_interval():
    assert "memory" not in QUICKSTART.read_text(), "the quickstart must not set the tier: this test is about the default"
    memory = load_spec(QUICKSTART).checkpoint.memory
    assert memory is not None and memory.every_steps == "auto" and memory.peer


def test_null_turns_the_tier_off_and_a_setting_still_applies():
    assert load_spec(QUICKSTART, ["checkpoint.memory=null"]).checkpoint.memory is None
    assert load_spec(QUICKSTART, ["checkpoint.memory.every_steps=5"]).checkpoint.memory.every_steps == 5


@pytest.mark.parametrize("value", ["false", "off", "no"])
def test_another_off_spelling_is_refused_naming_the_field_and_the_choices(value):
    with pytest.raises(SpecError) as e:
        load_spec(QUICKSTART, [f"checkpoint.memory={value}"])
    said = str(e.value)
    assert "checkpoint.memory" in said and "null" in said and "every_steps" in said, said


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_the_quickstart_killed_mid_run_resumes_from_memory_and_reads_no_checkpoint(tmp_path, capfd):
    """The quickstart's own spec (only its length cut to 30 steps, its places moved into tmp): no
    persistent checkpoint before step 40, so a worker killed after step 13 resumes either from a
    memory snapshot or from nothing."""
    spec = load_spec(QUICKSTART, [f"checkpoint.storage={tmp_path / 'runs'}", "train.steps=30",
                                  f"tracking.uri={prepared_store(tmp_path / 'mlflow.db')}"])
    spec = spec.with_overrides({"worker_env": {fetch.CACHE_ENV: str(tmp_path / "cache")}})
    assert spec.checkpoint.memory is not None and spec.checkpoint.every_steps == 40
    killed: list[int] = []
    spec, killer = kill_a_worker_at(spec, 13, killed)
    result = tidal.run(spec)
    killer.join(timeout=5)
    out = capfd.readouterr().out

    assert killed and result.error is None, result.error
    chosen = [int(n) for n in re.findall(r"memory snapshots every (\d+) step\(s\), chosen", out)]
    assert chosen and all(1 <= n <= 40 for n in chosen), out[-3000:]
    (where, step, redo), = resumes(out)
    assert where.startswith("the in-memory snapshot held on node"), out[-3000:]
    assert 1 <= step <= 13 and redo <= max(chosen), f"replayed {redo} step(s) with snapshots every {chosen}"
    assert not list((tmp_path / "cache").rglob("*.pt")), "a checkpoint file was copied from storage"
    assert result.goodput["goodput_replayed_steps"] == redo
    assert sorted(metric_history(spec, result.mlflow_run_id, "loss")) == [10, 20, 30], "each logged step once"
    assert keeper.named(spec.name) == {}, "the job's keepers outlived it"
