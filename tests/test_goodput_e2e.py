"""The goodput account of a real job with a fault (a Ray Train worker SIGKILLed mid-run, on the suite's
shared Ray instance): its buckets sum to the wall time, the replayed bucket holds the steps trained
again, and the end summary, the MLflow run and the SDK's result show it. The accounting itself is
tested as tables in tests/test_goodput.py."""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

import tidal
from tests.helpers import kill_a_worker_at
from tidal.goodput.account import BUCKETS
from tidal.testing.chaos import chaos_spec
from tidal.testing.runs import metric_history

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]


def test_a_killed_worker_shows_in_the_account_of_the_whole_wall_time(tmp_path, capfd):
    killed: list[int] = []
    spec, killer = kill_a_worker_at(chaos_spec(tmp_path, "goodput", steps=40, every=10), 15, killed)
    sigint_before = signal.getsignal(signal.SIGINT)
    result = tidal.run(spec)
    killer.join(timeout=10)
    assert signal.getsignal(signal.SIGINT) is sigint_before, "Ray Train's Ctrl-C handler outlived the run"

    g = result.goodput
    assert math.fsum(g[f"goodput_{b}_s"] for b in BUCKETS) == pytest.approx(g["goodput_wall_s"], rel=1e-6)
    # The account runs from tidal.run's start to the tracker's close: the result's wall time, less the
    # driver's own teardown after that close (seconds on this loaded machine).
    assert result.wall_s - 15 <= g["goodput_wall_s"] <= result.wall_s
    run_id = result.mlflow_run_id
    lost = metric_history(spec, run_id, "steps_lost")[40]
    assert killed and lost == 5 and g["goodput_replayed_steps"] == lost, "the account replays what the ledger counted lost"
    step_times = metric_history(spec, run_id, "step_time_s").values()
    # Each replayed step's own time, and the steps trained after the last log step before the kill (one interval).
    assert lost * min(step_times) <= g["goodput_replayed_s"] <= (lost + 1) * max(step_times) * 1.05
    assert g["goodput_restarts"] >= 1 and g["goodput_restore_s"] > 0 and g["goodput_startup_s"] > 0
    assert 0 < g["goodput"] < 1 and g["goodput_productive_s"] <= g["goodput_step_s"]

    out = capfd.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("[tidal] goodput "))
    assert "restart" in line and "replays" in line, line
    assert "  goodput " in result.summary()

    c = MlflowClient(spec.tracking.uri)
    assert sorted(metric_history(spec, run_id, "goodput_so_far")) == list(range(1, 41)), "as it ran, every step"
    assert sorted(metric_history(spec, run_id, "goodput")) == [40], "the final figure, once, at the last step"
    assert c.get_run(run_id).data.metrics["goodput_replayed_steps"] == lost
    table = json.loads(Path(c.download_artifacts(run_id, "goodput.json", str(tmp_path))).read_text())
    rows = {r[0]: r for r in table["data"]}
    assert set(rows) == {*BUCKETS, "total"} and rows["total"][1] == pytest.approx(g["goodput_wall_s"], abs=0.01)
