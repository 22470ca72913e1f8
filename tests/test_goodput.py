"""The goodput account (tidal/goodput): events in, buckets out, every second of the wall time in
exactly one bucket. Tables of event sequences as the job's log holds them; on a real Ray job with
a fault the same is checked by tests/test_goodput_e2e.py."""

from __future__ import annotations

import math

import pytest

from tidal.goodput.account import BUCKETS, State, finish, fold
from tidal.goodput.report import final_metrics, line, live_metrics, rows

T0 = 1_000_000.0


def ev(kind: str, t: float, step: int = 0, **values: float | str) -> dict:
    """An entry as the log holds it, at T0 + t seconds."""
    extra = {k: values.pop(k) for k in ("reason",) if k in values}
    return {"kind": kind, "ts": int(round((T0 + t) * 1000)), "step": step, "values": values,
            "id": f"{step:012d}-{t}-{kind}", **extra}


def account(events: list[dict], end: float | None) -> State:
    s = State()
    for e in events:
        fold(s, e)
    return finish(s, T0 + end) if end is not None else s


def buckets(s: State) -> dict[str, float]:
    return {b: round(v, 6) for b, v in s.seconds.items() if v}


def launch(t: float = 0.0, queue_s: float = 0.0) -> dict:
    return ev("launched", t + 10, t0=T0 + t, queue_s=queue_s)


# Each case: events, the job's end (s after T0), the buckets expected (seconds; the rest are 0).
CASES = {
    "a clean run": (
        [launch(queue_s=4), ev("group_started", 20, 0, world=2, setup_s=6, restore_s=0),
         ev("metrics", 30, 10, step_time_s=0.9, data_wait_s=0.1, world_size=2),
         ev("checkpoint", 31, 10),
         ev("metrics", 41.5, 20, step_time_s=1.0, world_size=2, eval_s=0.5)],
        45,
        # launch: 4 queue + 6 start-up; Ray's 4 s + setup 6 s; 10 steps of 0.9 s (1 of it data wait) + 1 s other;
        # the save 1 s; eval 0.5 s, 10 steps of 1.0 s (0.9 s each before the save: 1 s slower);
        # 3.5 s of teardown.
        {"queue": 4, "startup": 16, "productive": 8 + 9, "data_wait": 1, "other": 1 + 3.5,
         "checkpoint_stall": 1, "eval": 0.5, "post_save_slowdown": 1},
    ),
    "a kill, a restore and replayed steps": (
        [launch(), ev("group_started", 15, 0, world=2, setup_s=5),
         ev("metrics", 25, 10, step_time_s=1.0), ev("checkpoint", 26, 10),
         ev("metrics", 36, 20, step_time_s=1.0),
         ev("failure", 38),  # 2 s after the last log step: the steps since are lost, no hang
         ev("group_started", 50, 10, world=2, setup_s=7, restore_s=3),
         ev("metrics", 60, 20, step_time_s=1.0),  # steps 11-20 again
         ev("metrics", 70, 30, step_time_s=1.0)],
        70,
        {"startup": 10 + 5 + 2 + 7, "productive": 30, "checkpoint_stall": 1, "replayed": 2 + 10, "restore": 3},
    ),
    "a hang: a gap well over the step interval before the failure": (
        [launch(), ev("group_started", 10, 0, world=1),
         ev("metrics", 20, 10, step_time_s=1.0), ev("failure", 80),
         ev("group_started", 90, 10, world=1, setup_s=5), ev("metrics", 100, 20, step_time_s=1.0)],
        100,
        {"startup": 10 + 10, "productive": 20, "replayed": 10, "hang": 50},
    ),
    "a hang the watchdog declared: from the last finished step to the group's end": (
        [launch(), ev("group_started", 10, 0, world=1), ev("metrics", 20, 10, step_time_s=1.0),
         # steps 11 and 12 finished, then nothing: declared 47 s after step 12, the stacks taken by 70
         {**ev("hang", 70, 12), "stalled_s": 47.0, "values": {}},
         ev("failure", 75), ev("group_started", 85, 10, world=1, setup_s=5), ev("metrics", 95, 20, step_time_s=1.0)],
        95,
        {"startup": 10 + 10, "productive": 20, "replayed": 2, "hang": 48 + 5},
    ),
    "a resize by admission, and a preemption's drain": (
        [launch(), ev("group_started", 10, 0, world=2),
         ev("metrics", 20, 10, step_time_s=1.0), ev("checkpoint", 21, 10),
         ev("group_ending", 22, 10, reason="resize"),
         ev("group_started", 40, 10, world=4, setup_s=8),  # 10 s for Ray to regroup, 8 of setup
         ev("metrics", 50, 20, step_time_s=1.0), ev("checkpoint", 51, 20),
         ev("group_ending", 52, 20, reason="preemption"),
         ev("failure", 80),  # the drained node goes at the deadline: not a hang
         ev("group_started", 95, 20, world=2, setup_s=5), ev("metrics", 105, 30, step_time_s=1.0)],
        105,
        {"startup": 10 + 8 + 5, "productive": 30, "checkpoint_stall": 2, "other": 1 + 1,
         "resize_preemption": 10 + 28 + 10},
    ),
    "Ray's elastic regrowth: a group of another size, no failure": (
        [launch(), ev("group_started", 10, 0, world=1), ev("metrics", 20, 10, step_time_s=1.0),
         ev("group_started", 35, 8, world=2, setup_s=5, restore_s=2), ev("metrics", 45, 18, step_time_s=1.0)],
        45,
        {"startup": 10 + 5, "productive": 10 + 8, "replayed": 2, "resize_preemption": 8, "restore": 2},
    ),
    "a relaunch: no driver between launches": (
        [launch(), ev("group_started", 10, 0, world=1), ev("metrics", 20, 10, step_time_s=1.0),
         launch(100), ev("group_started", 120, 10, world=1, restore_s=2), ev("metrics", 130, 20, step_time_s=1.0)],
        130,
        {"startup": 10 + 10 + 8, "productive": 20, "other": 80, "restore": 2},
    ),
    "a restarted group's slow first step is start-up, not replay": (
        [launch(), ev("group_started", 10, 0, world=2), ev("metrics", 20, 10, step_time_s=1.0),
         ev("failure", 21),
         # One step per log interval: step 10 again takes 5 s (its warm-up), the next one 1 s.
         ev("group_started", 30, 9, world=2, setup_s=5), ev("metrics", 35, 10, step_time_s=5.0, first_step_s=5.0),
         ev("metrics", 36, 11, step_time_s=1.0),
         # A restart that logs 5 steps at once: its first took 6 s, the other four 1 s each.
         ev("failure", 37), ev("group_started", 40, 11, world=2, setup_s=3),
         ev("metrics", 50, 16, step_time_s=2.0, first_step_s=6.0)],
        50,
        # 10 + 9 start-up, 10 productive, 1 s lost at the failure; 4 s of the replayed step's 5 to start-up,
        # 1 s replayed, step 11 productive; 1 s lost, 3 s start-up, then 5 s of the 10 s interval's first
        # step to start-up (6 s, against the 1 s each of the other four).
        {"startup": 10 + 9 + 4 + 3 + 5, "productive": 10 + 1 + 5, "replayed": 1 + 1 + 1},
    ),
    "a restart whose new group fails before it is set up: the time until the next one is start-up": (
        # a kill inside the restore (found by the chaos harness's clock, issue 77 item 5): no group_started
        [launch(), ev("group_started", 10, 0, world=2), ev("metrics", 20, 10, step_time_s=1.0),
         ev("failure", 21), ev("failure", 33),
         ev("group_started", 45, 10, world=2, setup_s=5, restore_s=2), ev("metrics", 55, 20, step_time_s=1.0)],
        55,
        # 1 s lost at the first failure; the 12 s of the start that failed, then Ray's 5 s and setup 5 s
        {"startup": 10 + 12 + 5 + 5, "restore": 2, "replayed": 1, "productive": 20},
    ),
    "a withdrawn drain: the wait for a deadline that ended nothing is the preemption's": (
        [launch(), ev("group_started", 10, 0, world=2), ev("metrics", 20, 10, step_time_s=1.0),
         ev("checkpoint", 21, 10), ev("group_ending", 21, 10, reason="preemption"),
         # the node was not taken: 31 s waited for the deadline, then 10 steps more in the same group
         ev("metrics", 62, 20, step_time_s=1.0)],
        62,
        {"startup": 10, "productive": 20, "checkpoint_stall": 1, "resize_preemption": 31},
    ),
    "a parked job: its first driver's wait, the time parked and its successor's wait are queue": (
        # the first driver waits 50 s in the queue and parks (no driver, no workers); admission starts
        # its successor 1000 s later, which waits 5 s more and 10 s of start-up
        [ev("launched", 55, t0=T0, queue_s=50, parked=1.0), ev("launched", 1070, t0=T0 + 1055, queue_s=5),
         ev("group_started", 1080, 0, world=1), ev("metrics", 1090, 10, step_time_s=1.0)],
        1090,
        {"queue": 50 + 1000 + 5, "startup": 5 + 10 + 10, "productive": 10},
    ),
    "a compiled model's warm-up steps beside timed ones: start-up, as the docs say": (
        [launch(), ev("group_started", 10, 0, world=1),
         # 10 steps: 2 compiling (20 s, left out of step_time_s), 8 timed at 1 s; 1 s of logging
         ev("metrics", 39, 10, step_time_s=1.0, warmup_steps=2, warmup_s=20.0)],
        39,
        {"startup": 10 + 20, "productive": 8, "other": 1},
    ),
    "stragglers, a background write the optimizer waited for, warm-up steps": (
        [launch(), ev("group_started", 10, 0, world=2),
         ev("metrics", 20, 10, step_time_s=math.nan),  # compile warm-up only: start-up
         ev("metrics", 30, 20, step_time_s=1.0, straggler_wait_s=0.2, checkpoint_gate_s=0.5)],
        30,
        {"startup": 20, "productive": 7.5, "straggler_wait": 2, "checkpoint_stall": 0.5},
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_second_is_in_exactly_one_bucket(name):
    events, end, expected = CASES[name]
    s = account(events, end)
    assert buckets(s) == pytest.approx(expected)
    assert math.fsum(s.seconds.values()) == pytest.approx(end, abs=1e-6) == s.wall


def test_events_read_twice_or_late_add_no_time():
    events, end, _ = CASES["a kill, a restore and replayed steps"]
    once = account(events, end)
    twice = State()
    for e in events[:5] + events[:5] + events[5:]:  # a tracker that died before its mark: the log read again
        fold(twice, e)
    finish(twice, T0 + end)
    assert twice.seconds == once.seconds and twice.replayed_steps == once.replayed_steps == 10
    late = account(events + [ev("checkpoint", 5, 0)], None)  # older than the cursor: nothing to hand out
    assert math.fsum(late.seconds.values()) == pytest.approx(70 - 0)


def test_the_state_survives_the_mark_as_json():
    import json

    events, end, _ = CASES["a kill, a restore and replayed steps"]
    s = State()
    for e in events[:4]:
        fold(s, e)
    s = State.load(json.loads(json.dumps(s.dump())))  # a new tracker, from the mark
    for e in events[4:]:
        fold(s, e)
    assert s.seconds == account(events, None).seconds


def test_worker_hours_and_cost_follow_the_group_and_its_price():
    # Price labels: the group of 2 costs 6/hour (3 per worker-hour), known only from its first log step.
    s = account([launch(queue_s=10), ev("group_started", 10, 0, world=2),
                 ev("metrics", 3610, 10, step_time_s=360.0, world_size=2, cost_per_hour=6.0)], 3610)
    assert s.worker_s["queue"] == 0  # no workers held while queued
    assert s.worker_s["productive"] == pytest.approx(2 * 3600)
    assert s.cost["productive"] == pytest.approx(6.0)
    m = final_metrics(s)
    assert m["goodput_productive_worker_hours"] == pytest.approx(2.0) and m["goodput_productive_cost"] == 6.0
    assert "goodput_queue_cost" in m and rows(s)[-1]["seconds"] == pytest.approx(3610)


def test_the_summary_line_names_what_was_lost():
    events, end, _ = CASES["a kill, a restore and replayed steps"]
    s = account(events, end)
    # worker-hours: 2 workers from each group's start to its failure or the end (Ray's 2 s regrouping: none)
    assert line(s) == ("goodput 42.9% of 1m10s (0.0322 worker-hours): lost 34.3% to start-up (1 restart), "
                       "17.1% to replays (10 steps), 4.3% to restores, 1.4% to checkpoint stalls")
    assert live_metrics(s) == {"goodput_so_far": pytest.approx(30 / 70), "goodput_so_far_wall_s": 70}
    assert live_metrics(account(events[1:], end)) == {}, "no launch in the log: no live figure"
    assert line(State()) is None and final_metrics(State()) == {}


def test_a_log_from_before_launches_were_recorded_starts_at_its_first_event():
    s = account([ev("group_started", 10, 0, world=1), ev("metrics", 20, 10, step_time_s=1.0)], 25)
    assert s.wall == 15 and s.seconds["productive"] == 10 and set(BUCKETS) == set(s.seconds)


def test_the_trackers_ledger_keeps_the_account_across_its_own_restart(mlflow_uri, tmp_path):
    """The tracker's ledger folds the job's event log as it reads it, carries the goodput so far
    on each step it sends to MLflow, and a new ledger (a restarted tracker) goes on from its mark."""
    import time

    from tests.conftest import metric_history
    from tests.ledger_fakes import STEP, Server, ledger, setup
    from tidal.tracking.emitter import Emitter
    from tidal.tracking.events import Launched
    from tidal.tracking.writer import RunWriter

    spec, run, buffer = setup(tmp_path, mlflow_uri, name="goodput")
    run_id = RunWriter(spec).start(None)
    server = Server(spec)
    t0 = time.time() - 5
    buffer.append({**Launched(0, {"t0": t0, "queue_s": 1.0}).entry(), "ts": int(time.time() * 1000)})
    events = Emitter(spec.checkpoint.storage, spec.name)
    events.started(0, 2, 2.0, 0.0)
    for s in (1, 2):
        events.metrics({"step": s, **STEP, "step_time_s": 0.001})
    events.drain()
    first = ledger(spec, run, server, run_id)
    first.poll()
    assert first.flush() == 0
    events.failed({1: "gone"}, 2)
    events.started(1, 2, 1.0, 0.5)
    events.metrics({"step": 2, **STEP, "step_time_s": 0.001})  # replayed
    events.metrics({"step": 3, **STEP, "step_time_s": 0.001})
    events.drain()
    second = ledger(spec, run, server, run_id)
    second.poll()
    assert second.flush() == 0
    state = second.finish_goodput(time.time())
    assert state.launches == 1 and state.restarts == 1 and state.replayed_steps == 1
    assert state.seconds["queue"] == 1.0, "the launch waited 1 s for admission"
    assert math.fsum(state.seconds.values()) == pytest.approx(time.time() - t0, abs=0.5)
    assert sorted(metric_history(spec, run_id, "goodput_so_far")) == [1, 2, 3]


def test_with_the_account_off_the_ledger_sends_the_steps_and_no_goodput(mlflow_uri, tmp_path, monkeypatch):
    """TIDAL_GOODPUT=0 (what benchmarks.goodput_overhead measures against): the same steps reach
    MLflow, and no account is kept, carried or closed."""
    import time

    from tests.conftest import metric_history
    from tests.ledger_fakes import STEP, Server, ledger, setup
    from tidal.tracking.emitter import Emitter
    from tidal.tracking.events import Launched
    from tidal.tracking.writer import RunWriter

    monkeypatch.setenv("TIDAL_GOODPUT", "0")
    spec, run, buffer = setup(tmp_path, mlflow_uri, name="goodput-off")
    run_id = RunWriter(spec).start(None)
    buffer.append({**Launched(0, {"t0": time.time() - 5, "queue_s": 1.0}).entry(), "ts": int(time.time() * 1000)})
    events = Emitter(spec.checkpoint.storage, spec.name)
    events.started(0, 2, 2.0, 0.0)
    for s in (1, 2):
        events.metrics({"step": s, **STEP, "step_time_s": 0.001})
    events.drain()
    off = ledger(spec, run, Server(spec), run_id)
    off.poll()
    assert off.flush() == 0
    assert sorted(metric_history(spec, run_id, "loss")) == [1, 2]
    assert metric_history(spec, run_id, "goodput_so_far") == {}
    state = off.finish_goodput(time.time())
    assert state.goodput is None and final_metrics(state) == {} and line(state) is None


def test_the_sdks_result_gives_the_account_and_its_summary_names_it():
    from tidal.launch.result import RunResult

    events, end, _ = CASES["a kill, a restore and replayed steps"]
    m = {"loss": 1.0, **final_metrics(account(events, end))}
    r = RunResult("job", "run", "sqlite:///x.db", "/tmp/runs", m, 70.0)
    assert r.goodput["goodput"] == pytest.approx(30 / 70) and r.goodput["goodput_replayed_s"] == pytest.approx(12)
    assert "  goodput         42.9% of 1m10s; lost most to start-up 34.3%, replays 17.1%, restores 4.3%" in (
        r.summary().splitlines())
    assert RunResult("job", "run", "sqlite:///x.db", "/tmp/runs", {"loss": 1.0}).goodput == {}


def test_tidal_runs_shows_each_runs_goodput_and_each_teams(tmp_path, capsys):
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    from tidal.cli import main
    from tidal.testing.runs import prepared_store
    from tidal.tracking.runs import list_runs, run_records

    uri = prepared_store(tmp_path / "mlflow.db")
    c = MlflowClient(uri)
    exp = c.create_experiment("tidal", artifact_location=str(tmp_path / "artifacts"))
    for name, team, g, wall in (("a", "vision", 0.9, 3600.0), ("b", "vision", 0.5, 1200.0), ("c", "nlp", 0.8, 7200.0)):
        run = c.create_run(exp, run_name=name, tags={"tidal.job": name, "tidal.team": team})
        c.log_batch(run.info.run_id, metrics=[Metric(k, v, 0, 10) for k, v in {
            "goodput": g, "goodput_wall_s": wall, "goodput_productive_worker_hours": 2 * g * wall / 3600,
            "goodput_startup_worker_hours": 2 * (1 - g) * wall / 3600}.items()])
    assert sorted(r["goodput"] for r in list_runs(uri)) == ["50.0%", "80.0%", "90.0%"]
    assert {r["job"]: r["goodput_worker_hours"] for r in run_records(uri)}["a"] == pytest.approx(2.0)
    assert main(["runs", "--uri", uri, "--by-team"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["team", "runs", "wall", "hours", "worker-hours", "goodput"]
    assert lines[1].split() == ["nlp", "1", "2.00", "4.00", "80.0%"]
    assert lines[2].split() == ["vision", "2", "1.33", "2.67", "80.0%"]  # (0.9 x 1 h + 0.5 x 1/3 h) / 4/3 h


def test_the_trackers_close_ends_the_account_prints_it_and_stores_its_table(mlflow_uri, tmp_path, capsys):
    """The tracker's close (the same code in its actor and in the driver) ends the account after the
    run's usage and artifacts, prints the end summary's line, and gives MLflow the final figures
    once and the table `goodput.json`."""
    import json
    import time
    from pathlib import Path

    from mlflow.tracking import MlflowClient

    from tests.conftest import metric_history, tiny_spec
    from tidal.storage import RunDir
    from tidal.tracking.buffer import MetricsBuffer
    from tidal.tracking.emitter import Emitter
    from tidal.tracking.events import Launched
    from tidal.tracking.tracker import Tracker

    spec = tiny_spec(tmp_path, name="close", **{"tracking.uri": mlflow_uri})
    run = RunDir(spec.checkpoint.storage, spec.name)
    t0 = time.time() - 3
    MetricsBuffer(run.fs, run.path).append({**Launched(0, {"t0": t0, "queue_s": 0.0}).entry(),
                                            "ts": int(time.time() * 1000)})
    events = Emitter(spec.checkpoint.storage, spec.name)
    events.started(0, 1, 1.0, 0.0)
    events.metrics({"step": 1, "loss": 2.0, "world_size": 1, "step_time_s": 0.01})
    events.drain()
    tracker = Tracker(spec, system_metrics=False, background=False)
    run_id, latest, left = tracker.close(True, time.time() - t0)
    assert left == 0 and latest["goodput_wall_s"] >= 3 and "goodput_startup_s" in latest
    assert any(x.startswith("[tidal] goodput ") for x in capsys.readouterr().out.splitlines())
    assert metric_history(spec, run_id, "goodput") == {1: pytest.approx(latest["goodput"])}
    c = MlflowClient(mlflow_uri)
    table = json.loads(Path(c.download_artifacts(run_id, "goodput.json", str(tmp_path))).read_text())
    assert [r[0] for r in table["data"]] == [*BUCKETS, "total"]
    # Running the finished job's tracker again (nothing trained since) logs nothing twice.
    Tracker(spec, system_metrics=False, background=False).close(True, 0.0)
    assert metric_history(spec, run_id, "goodput") == {1: pytest.approx(latest["goodput"])}


def suspended_log(at) -> list[dict]:
    """100 s at 4 workers, suspended by admission for an hour (the group ended, the driver waited
    for its seat: nothing held), then 100 s more at 4; the nodes cost 8/hour (2 per worker-hour)."""
    from tidal.tracking.events import GroupEnded, GroupEnding, GroupStarted, Launched, StepMetrics

    step = {"loss": 2.0, "world_size": 4.0, "step_time_s": 10.0, "cost_per_hour": 8.0}
    return [{**Launched(0, {"t0": at(0) / 1000, "queue_s": 0.0}).entry(), "ts": at(0)},
            {**GroupStarted(0, {"world": 4.0, "setup_s": 0.0, "restore_s": 0.0}).entry(), "ts": at(0)},
            {**StepMetrics(10, step).entry(), "ts": at(100)},
            {**GroupEnding(10, "resize").entry(), "ts": at(100)},
            {**GroupEnded(10).entry(), "ts": at(101)},  # the driver's fit() returned: the group is gone
            {**GroupStarted(10, {"world": 4.0, "setup_s": 0.0, "restore_s": 0.0}).entry(), "ts": at(3701)},
            {**StepMetrics(20, step).entry(), "ts": at(3801)}]


def test_a_suspended_job_holds_no_workers_and_pays_nothing_while_it_waits():
    s = State()
    for i, e in enumerate(suspended_log(lambda t: int((T0 + t) * 1000))):
        fold(s, {**e, "id": str(i)})
    finish(s, T0 + 3801)
    m = final_metrics(s)
    worker_hours = sum(v for k, v in m.items() if k.endswith("_worker_hours"))
    assert worker_hours == pytest.approx(804 / 3600), "4 x (100 + 1 + 100) s: the hour suspended held nothing"
    assert sum(v for k, v in m.items() if k.endswith("_cost")) == pytest.approx(2 * 804 / 3600)
    assert s.seconds["resize_preemption"] == pytest.approx(3601), "the wall time still counts the wait"


def test_a_failed_group_holds_no_workers_until_the_next_starts():
    s = account([launch(), ev("group_started", 10, 0, world=4), ev("metrics", 20, 10, step_time_s=1.0),
                 ev("failure", 21), ev("group_started", 621, 10, world=4, setup_s=1)], 621)
    # the launch's 10 s and Ray's 10 minutes finding workers held none; the new group's 1 s of setup did
    assert s.worker_s["startup"] == pytest.approx(4 * 1), "Ray's 10 minutes finding workers: none held"


def test_tidal_runs_by_team_and_mlflow_carry_the_suspended_jobs_worker_hours(mlflow_uri, tmp_path, capsys):
    """The same suspended job through the tracker that closes it (MLflow's final metrics) and
    `tidal runs --by-team`: 0.22 worker-hours, not 4."""
    import time

    from tests.conftest import metric_history, tiny_spec
    from tidal.cli import main
    from tidal.storage import RunDir
    from tidal.tracking.buffer import MetricsBuffer
    from tidal.tracking.tracker import Tracker

    spec = tiny_spec(tmp_path, name="suspended", **{"tracking.uri": mlflow_uri})
    run = RunDir(spec.checkpoint.storage, spec.name)
    start = time.time() - 3801
    buffer = MetricsBuffer(run.fs, run.path)
    for e in suspended_log(lambda t: int((start + t) * 1000)):
        buffer.append(e)
    tracker = Tracker(spec, tags={"tidal.team": "vision"}, system_metrics=False, background=False)
    run_id, latest, _ = tracker.close(True, 3801.0)
    hours = sum(v for k, v in latest.items() if k.startswith("goodput_") and k.endswith("_worker_hours"))
    assert hours == pytest.approx(804 / 3600, abs=0.01)
    cost = sum(metric_history(spec, run_id, f"goodput_{b}_cost").get(20, 0.0) for b in BUCKETS)
    assert cost == pytest.approx(2 * 804 / 3600, abs=0.02)
    capsys.readouterr()
    assert main(["runs", "--uri", mlflow_uri, "--by-team"]) == 0
    vision = next(x.split() for x in capsys.readouterr().out.splitlines() if x.startswith("vision"))
    assert vision[3] == "0.22"


def test_the_clock_reports_the_warm_up_steps_it_left_out(monkeypatch):
    """What the account books to start-up: the compile steps the clock left out of step_time_s."""
    import torch

    from tidal.worker import metrics
    from tidal.worker.metrics import PhaseClock

    now = [0.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])
    clock = PhaseClock(torch.device("cpu"), comms=None, warmup_steps=2)
    for seconds in (15.0, 5.0, 1.0, 1.0):
        clock.start_step(sync=False)
        now[0] += seconds
        clock.end_step()
    first = clock.take()
    assert (first["warmup_steps"], first["warmup_s"], first["step_time_s"]) == (2, 20.0, 1.0)
    clock.start_step(sync=False)
    now[0] += 1.0
    clock.end_step()
    assert "warmup_s" not in clock.take(), "only the interval that held them says so"


def long_log(tmp_path, mlflow_uri, name, steps):
    """A job's log of a launch, a group and `steps` log steps, as its workers and driver write it."""
    import time

    from tests.ledger_fakes import STEP, setup
    from tidal.tracking.emitter import Emitter
    from tidal.tracking.events import Launched
    from tidal.tracking.writer import RunWriter

    spec, run, buffer = setup(tmp_path, mlflow_uri, name=name)
    run_id = RunWriter(spec).start(None)
    t0 = time.time() - 60
    buffer.append({**Launched(0, {"t0": t0, "queue_s": 0.0}).entry(), "ts": int(t0 * 1000) + 1})
    events = Emitter(spec.checkpoint.storage, spec.name)
    events.started(0, 2, 1.0, 0.0)
    for s in range(1, steps + 1):
        events.metrics({"step": s, **STEP, "step_time_s": 0.001})
    assert events.drain(timeout_s=60)
    return spec, run, run_id


@pytest.mark.slow
def test_a_long_log_read_again_by_a_restarted_tracker_is_counted_once(mlflow_uri, tmp_path):
    """MLflow down after the tracker took in 600 log steps (they stay in the log, unsent), then the
    tracker restarts: the new one reads the whole log again and must not count it twice."""
    from tests.ledger_fakes import Server, ledger

    spec, run, run_id = long_log(tmp_path, mlflow_uri, "long-log", 600)
    server = Server(spec)
    first = ledger(spec, run, server, run_id)
    first.poll()  # MLflow answered what it holds: all 600 are taken in (and folded)
    server.down = True
    assert first.flush() == 600, "MLflow went down: every point waits in the log"
    once = dict(first.goodput.seconds)
    server.down = False
    second = ledger(spec, run, server, run_id)  # the restarted tracker, from the first one's mark
    second.poll()
    assert second.flush() == 0
    assert second.goodput.replayed_steps == 0, "no step of the log was trained twice"
    assert second.goodput.seconds == once
    assert second.goodput.seen == set(), "every event sent and dropped from the log: no id kept for it"


def test_running_a_finished_job_again_ends_its_account_where_the_job_ended(mlflow_uri, tmp_path, capsys):
    """The job ended an hour ago with its last events unsent (MLflow down); running it again sends
    them and closes the account at the job's own last event, not an hour later."""
    import time

    from tests.conftest import tiny_spec
    from tidal.launch.trainer import _complete
    from tidal.storage import Found, RunDir
    from tidal.tracking.buffer import MetricsBuffer
    from tidal.tracking.events import GroupStarted, Launched, StepMetrics

    spec = tiny_spec(tmp_path, name="done", **{"tracking.uri": mlflow_uri})
    run = RunDir(spec.checkpoint.storage, spec.name)
    ended = time.time() - 3600
    at = lambda t: int((ended - 100 + t) * 1000)  # noqa: E731 - the job ran 100 s, ending an hour ago
    buffer = MetricsBuffer(run.fs, run.path)
    for e in ({**Launched(0, {"t0": at(0) / 1000, "queue_s": 0.0}).entry(), "ts": at(0)},
              {**GroupStarted(0, {"world": 1.0, "setup_s": 5.0, "restore_s": 0.0}).entry(), "ts": at(10)},
              {**StepMetrics(spec.train.steps, {"loss": 1.0, "world_size": 1.0, "step_time_s": 0.5}).entry(),
               "ts": at(100)}):
        buffer.append(e)

    class NoLease:
        def config(self):
            return None

    found = Found(f"{run.path}/checkpoint_x", run.fs, {"step": spec.train.steps})
    result = _complete(spec, found, {}, run, time.time(), NoLease())
    assert result.metrics["step"] == spec.train.steps
    latest = MetricsBuffer(run.fs, run.path).load()
    assert latest == [], "the events left were sent"
    mark = run.read_json("tidal-mlflow-sent.json")
    assert mark["goodput"]["cursor"] - mark["goodput"]["start"] == pytest.approx(100, abs=1), (
        "the account ends at the job's last event: the hour since it ended is no time of the job's")


def test_an_event_from_before_the_end_read_after_it_reopens_nothing():
    events, end, _ = CASES["a kill, a restore and replayed steps"]
    s = account(events, end)
    fold(s, ev("metrics", 65, 25, step_time_s=1.0))  # written before the end, read after the account closed
    finish(s, T0 + end + 3600)  # the finished job run again an hour later
    assert s.wall == pytest.approx(end) and s.mode == "ended"


def test_the_prometheus_gauges_carry_cost_by_bucket_where_nodes_are_priced():
    from tidal.tracking.goodput_gauges import gauge_values

    priced = account([launch(), ev("group_started", 10, 0, world=2),
                      ev("metrics", 3610, 10, step_time_s=360.0, world_size=2, cost_per_hour=6.0)], 3610)
    values = {(name, tags.get("bucket")): v for name, tags, v in gauge_values(priced, {"tidal_job": "j", "team": "t"})}
    assert values[("goodput_cost", "productive")] == pytest.approx(6.0)
    assert values[("goodput_worker_hours", "productive")] == pytest.approx(2.0)
    unpriced = account(CASES["a clean run"][0], 45)
    assert not [n for n, _, _ in gauge_values(unpriced, {}) if n == "goodput_cost"], "no price, no cost gauge"


def test_the_gauges_team_is_the_jobs_own_when_admission_gives_none(mlflow_uri, tmp_path):
    from tests.conftest import tiny_spec
    from tidal.tracking.tracker import Tracker

    spec = tiny_spec(tmp_path, name="teamed", **{"tracking.uri": mlflow_uri, "scheduling.team": "vision"})
    assert Tracker(spec, system_metrics=False, background=False).gauges.tags["team"] == "vision"
    admitted = Tracker(spec, tags={"tidal.team": "nlp"}, system_metrics=False, background=False)
    assert admitted.gauges.tags["team"] == "nlp", "admission's seat decides where it gives one"


@pytest.mark.parametrize("since_set, interval_ms, expected", [
    (0.0, None, 10.0),  # Ray's default report interval: one export after the last set
    (4.0, "2000", 0.0),  # already exported
    (0.5, "2000", 1.5),
    (0.0, "60000", 15.0),  # never longer than this at a job's end
])
def test_the_final_gauges_wait_for_one_export_before_the_tracker_ends(since_set, interval_ms, expected):
    from tidal.tracking.goodput_gauges import settle_s

    assert settle_s(since_set, interval_ms) == pytest.approx(expected)


@pytest.mark.parametrize("collecting, expected", [
    (None, 10.0),  # Ray's default: metrics are collected and exported
    ("true", 10.0),
    ("1", 10.0),
    ("false", 0.0),  # RAY_enable_metrics_collection=false: nothing is ever exported, nothing to wait for
    ("0", 0.0),
    ("FALSE", 0.0),
])
def test_the_final_gauges_wait_only_where_ray_exports_metrics(collecting, expected):
    from tidal.tracking.goodput_gauges import settle_s

    assert settle_s(0.0, None, collecting) == pytest.approx(expected)


def test_a_driver_that_parks_its_job_writes_its_wait_into_the_log(tmp_path, monkeypatch):
    """The queue wait of a driver that parks (admission/parking.py) stays in the job's account: the
    driver leaves a `launched` event saying so, and the account's first second is its start."""
    import contextlib

    from tests.conftest import tiny_spec
    from tidal.admission.parking import Parked
    from tidal.launch import trainer
    from tidal.storage import RunDir
    from tidal.tracking.buffer import MetricsBuffer

    spec = tiny_spec(tmp_path, name="parks")

    @contextlib.contextmanager
    def parks(_spec):
        raise Parked("parks-1-p", 3)
        yield

    monkeypatch.setattr(trainer, "connect_ray", lambda *a, **k: None)
    monkeypatch.setattr(trainer.admission, "seat", parks)
    result = trainer.run(spec, began=T0)
    assert result.parked_as == "parks-1-p"
    run = RunDir(spec.checkpoint.storage, spec.name)
    [park] = [e for e in MetricsBuffer(run.fs, run.path).load() if e["kind"] == "launched"]
    assert park["values"]["parked"] == 1 and park["values"]["t0"] == T0
    s = State()
    fold(s, park)
    assert s.start == T0 and s.mode == "parked" and s.seconds["queue"] == pytest.approx(park["values"]["queue_s"])
