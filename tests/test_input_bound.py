"""Input-bound jobs: the decision alone, then a real job whose data source is slow."""

from __future__ import annotations

import math
import re

import pytest
from mlflow.tracking import MlflowClient

import tidal
from tests.conftest import ONE_WORKER, metric_history, tiny_spec
from tidal.tracking.findings import INPUT_BOUND_TAG, summary_lines
from tidal.worker.input_bound import InputWatch, Interval, PhaseTotals, input_bound, wait_share


def test_the_share_is_summed_over_the_windows_steps_not_averaged_over_intervals():
    # 10 steps waiting 0.5 of 1 s, then 1 step waiting nothing: 5 s of 11 s, not (0.5 + 0) / 2
    assert wait_share([Interval(0.5, 1.0, 10), Interval(0.0, 1.0, 1)]) == pytest.approx(5 / 11)
    assert wait_share([]) == 0.0


def test_one_slow_interval_is_noise_a_window_of_them_is_input_bound():
    slow, fast = Interval(0.4, 1.0, 10), Interval(0.01, 1.0, 10)
    assert input_bound([slow], threshold=0.2, intervals=3) is None, "too few intervals to tell"
    assert input_bound([slow, fast, fast], threshold=0.2, intervals=3) is None, "a cold start, then fine"
    assert input_bound([slow, slow, slow], threshold=0.2, intervals=3) == pytest.approx(0.4)
    assert input_bound([fast, slow, slow, slow], threshold=0.2, intervals=3) == pytest.approx(0.4), "the last 3"
    assert input_bound([slow] * 5, threshold=0.0, intervals=3) is None, "0 turns it off"


def test_the_watch_says_it_once_with_the_window_it_judged():
    w = InputWatch(threshold=0.2, intervals=2)
    assert w.update(10, Interval(0.5, 1.0, 10)) is None
    v = w.update(20, Interval(0.5, 1.0, 10))
    assert v is not None and v.share == pytest.approx(0.5) and (v.first_step, v.last_step) == (1, 20)
    assert w.update(30, Interval(0.5, 1.0, 10)) is None, "said once"
    compiling = InputWatch(threshold=0.2, intervals=1)
    assert compiling.update(10, Interval(math.nan, math.nan, 10)) is None, "warm-up intervals have no times"


def test_phase_totals_give_each_phases_share_of_the_wall_time_checkpoints_included():
    t = PhaseTotals()
    t.add(Interval(0.1, 1.0, 10), 0.7, 0.2, wall_s=None)  # the group's first interval: its steps only
    t.add(Interval(0.1, 1.0, 10), 0.7, 0.2, wall_s=12.0)  # 10 s stepping + 2 s saving a checkpoint
    assert t.shares() == pytest.approx({"time_share_data_wait": 2 / 22, "time_share_forward_backward": 14 / 22,
                                        "time_share_optimizer": 4 / 22, "time_share_outside_steps": 2 / 22})
    assert "data wait 9%" in summary_lines(t.shares())[0]


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_a_job_with_a_slow_data_source_is_reported_input_bound(tmp_path, capfd):
    spec = tiny_spec(tmp_path, name="input-bound", **{
        "model.builder": "tests.custom_model:build", "data.dataset": "tests.slow_data:dataset",
        "data.dataset_args": {"n": 256, "vocab": 64, "seq_len": 16, "sleep_s": 0.004},
        "data.input_bound_intervals": 3, "train.steps": 12, "train.log_every": 2, "checkpoint.every_steps": 12,
        **ONE_WORKER,  # one rank waits as two would
    })
    result = tidal.run(spec)
    out = capfd.readouterr().out

    lines = [ln for ln in out.splitlines() if "input-bound:" in ln]
    assert len(lines) == 1, out[-3000:]
    assert lines[0].startswith("[tidal] WARNING: input-bound:"), lines[0]
    # The window is 3 log intervals of 2 steps. Which 3 depends on the machine: an interval
    # that compiled has no times, and a loaded machine's first steps can be compute-heavy.
    window = re.search(r"waited for data over steps (\d+)-(\d+)", lines[0])
    assert window, lines[0]
    first, last = int(window[1]), int(window[2])
    assert last - first + 1 == 6 and last < 12, lines[0]
    assert "data.dataset __getitem__" in lines[0] and "faster storage" in lines[0], lines[0]
    share = metric_history(spec, result.mlflow_run_id, "input_bound_share")
    assert list(share) == [last] and share[last] > 0.2, share
    flag = metric_history(spec, result.mlflow_run_id, "input_bound")
    assert flag == {s: int(s >= last) for s in range(2, 13, 2)}, flag
    tags = MlflowClient(spec.tracking.uri).get_run(result.mlflow_run_id).data.tags
    assert tags[INPUT_BOUND_TAG] == f"data wait {share[last]:.0%} of the step time"
    summary = result.summary()
    assert f"input-bound     {share[last]:.0%} of each step waited for data" in summary, summary
    time_line = next(ln for ln in summary.splitlines() if ln.startswith("  time "))
    assert "data wait" in time_line and "forward/backward" in time_line and "optimizer" in time_line, time_line
    data_share = int(time_line.split("data wait ")[1].split("%")[0])
    assert data_share >= 20, time_line
