"""The chaos harness's own clock (tidal/testing/timeline.py), which the chaos benchmarks and tests/test_chaos.py
hold the goodput ledger against bucket by bucket: what it derives from a timeline of its launch, its kills, the
loss trace's records and the console's lines, and the comparison (a ledger that books a second to the wrong
bucket is caught in that bucket's row)."""

from __future__ import annotations

import io
import json

import pytest

from tidal.testing.timeline import (
    LogTail,
    Timeline,
    TraceTail,
    compare,
    lives_of,
    observed,
    step_prints,
)

DELAY = 0.5  # the console's lines come this long after the trace's records


def killed_once() -> Timeline:
    """Launched at 0; steps 1-10 traced at 20-29 s (a step takes 1 s); a kill at 29.5 s; the failure's line
    at 33.5 s (33 s less the console's delay); steps 8-10 replayed at 45-47 s, 11-20 at 48-57 s; the summary
    line at 60 s and the job's end at 61 s. Every console step line comes DELAY after its record."""
    trace = [(19.0 + s, s) for s in range(1, 11)] + [(37.0 + s, s) for s in range(8, 21)]
    prints = [(w + DELAY, s) for w, s in trace]
    marks = [(33.0 + DELAY, "restart", 1), (44.0 + DELAY, "resumed", 7), (60.0, "summary", 0)]
    return Timeline(launched=0.0, ended=61.0, kills=[(29.5, 10)], prints=prints, marks=marks, trace=trace)


def agreeing() -> dict[str, float]:
    """What a ledger that books killed_once() right reports."""
    return {"goodput_wall_s": 60.0, "goodput_startup_s": 28.0, "goodput_restore_s": 2.0, "goodput_replayed_s": 4.0,
            "goodput_replayed_steps": 3.0, "goodput_other_s": 6.0, "goodput_productive_s": 19.5,
            "goodput_data_wait_s": 0.5}


def test_the_harness_derives_each_bucket_from_its_own_clock():
    seen = observed(killed_once())
    assert (seen.step, seen.jitter, seen.delay, seen.spread) == (1.0, 0.0, DELAY, 0.0)
    assert (seen.lives, seen.faults, seen.blind) == (2, 1, 0)
    assert seen.wall == 60.0  # launch to the summary line: the account closed before it
    # launch to step 1's start (19 s), and the failure (33 s) to step 8's start in the new group (44 s)
    assert seen.startup == 19.0 + 11.0
    # the step in flight at the kill (one step: the ledger books one interval) and steps 8-10 again
    assert (seen.replayed, seen.replayed_steps) == (1.0 + 3.0, 3)
    assert (seen.detection, seen.hang) == (33.0 - 29.0 - 1.0, 0.0)  # the failure less the last step and that step
    assert seen.end == 60.0 - 57.0
    assert seen.first == 20.0  # steps 1-20, once each
    parts = seen.startup + seen.replayed + seen.detection + seen.hang + seen.end + seen.first + seen.checkpoint
    assert parts == pytest.approx(seen.wall)


def test_a_detection_past_the_ledgers_threshold_is_a_hang():
    """The ledger's documented rule (tidal/goodput/account.py): a gap before a failure over 3 intervals and
    5 s more than one is a hang. A failure seen 9 s after the last step: 8 s past it."""
    t = killed_once()
    t.marks[0] = (38.0 + DELAY, "restart", 1)
    seen = observed(t)
    assert (seen.hang, seen.detection, seen.startup) == (8.0, 0.0, 19.0 + 6.0)


def test_a_save_shows_as_the_excess_of_the_interval_across_it():
    t = killed_once()
    t.trace = [(w + 0.4 * (s > 5 and w < 30), s) for w, s in t.trace]  # step 6 waited 0.4 s for the save after 5
    t.marks.append((25.0, "checkpoint", 5))
    seen = observed(t)
    assert seen.saves == 1 and seen.checkpoint == pytest.approx(0.4)


def test_a_kill_between_two_steps_that_follow_on_starts_a_new_group():
    """Resumed from a checkpoint at the last step done: the steps follow on, the kill between them says
    they are two groups (a step seen just after the kill was done before it: the trace is read late)."""
    t = Timeline(launched=0.0, kills=[(10.05, 10)], trace=[(float(s), s) for s in range(1, 11)] + [(10.1, 11)])
    assert len(lives_of(t)) == 1
    t.trace.append((25.0, 12))
    assert [len(life) for life in lives_of(t)] == [11, 1]


def test_steps_whose_events_went_with_their_group_are_the_failures_as_the_ledger_books_them():
    """Steps 9 and 10 were trained, but their events never reached the log (rank 0 writes them in the
    background; a newer start drops an older one's): the console never printed their first run, and the
    ledger, which never heard of them, books their time with the failure's gap and their next run as a
    first one. The harness does the same; a line lost in mid-group (a killed tracker's) loses no step."""
    t = killed_once()
    t.prints = [(w, s) for w, s in t.prints if not (s in (9, 10) and w < 30) and s != 3]
    seen = observed(t)
    assert seen.unlogged == 2 and seen.replayed_steps == 1  # only step 8 is trained again, to the ledger
    assert seen.detection == pytest.approx(33.0 - 27.0 - 1.0) and seen.first == pytest.approx(20.0 - 2.0 + 2.0)


def test_a_start_with_no_failure_line_is_left_to_the_ledger_within_its_gap():
    """A node's or a driver's loss, or a resize, prints no `restart` line: the harness cannot tell its
    detection from its start-up, so the ledger's start-up may hold up to that gap more."""
    t = killed_once()
    t.marks = [m for m in t.marks if m[1] != "restart"]
    seen = observed(t)
    assert (seen.faults, seen.blind, seen.blind_s, seen.startup) == (0, 1, 44.0 - 29.0, 19.0)
    row = next(r for r in compare(seen, {**agreeing(), "goodput_other_s": 3.0, "goodput_startup_s": 31.0})
               if r["bucket"].startswith("start-up"))
    assert row["ok"] and row["above"] >= seen.blind_s


def test_without_the_summary_line_the_account_ended_between_the_last_line_and_the_jobs_end():
    """A slow tracker's last lines can be lost (the driver's last drain gives up): the harness then knows
    only that the account closed after the last line it saw and before the driver exited."""
    t = killed_once()
    t.marks = [m for m in t.marks if m[1] != "summary"]
    t.ended = 70.0
    seen = observed(t)
    assert (seen.wall, seen.end_unseen) == (70.0, 70.0 - (57.0 + DELAY))
    assert all(r["ok"] for r in compare(seen, agreeing()))
    assert not next(r for r in compare(seen, {**agreeing(), "goodput_wall_s": 50.0}) if r["bucket"].startswith("wall"))["ok"]


def test_a_job_found_complete_by_a_driver_started_again_ends_its_account_at_its_last_event():
    """The driver was killed while it closed (waiting for MLflow) and started again: the new one found the job
    complete and printed the summary, whose account ends at the job's last event, before that line."""
    t = killed_once()
    t.marks = [m for m in t.marks if m[1] != "summary"]
    t.marks += [(75.0, "complete", 20), (76.0, "summary", 0)]
    seen = observed(t)
    assert (seen.wall, seen.end_unseen) == (76.0, 76.0 - 57.0)
    assert all(r["ok"] for r in compare(seen, agreeing()))


def test_the_comparison_holds_a_ledger_that_books_right():
    rows = compare(observed(killed_once()), agreeing())
    assert [r["bucket"] for r in rows if not r["ok"]] == []
    assert len(rows) == 9


@pytest.mark.parametrize("wrong, rows_off", [
    # the restart's start-up (11 s) booked as productive: caught in both rows
    ({"goodput_startup_s": 17.0, "goodput_productive_s": 30.5}, {"start-up", "productive"}),
    # the replayed steps booked as first executions (the double fold of issue 77 item 4 goes the other way)
    ({"goodput_replayed_s": 1.0, "goodput_productive_s": 22.5, "goodput_replayed_steps": 0.0},
     {"steps", "replayed", "productive"}),
    # the detection booked as a hang though it is under the threshold
    ({"goodput_other_s": 3.0, "goodput_hang_s": 3.0}, {"hang", "other", "productive"}),
    # a queue wait the job never had (issue 77 item 3 the other way): 10 s out of productive
    ({"goodput_queue_s": 10.0, "goodput_productive_s": 9.5}, {"start-up", "productive"}),
    # an account that ends before the job's summary: the wall
    ({"goodput_wall_s": 50.0}, {"wall"}),
])
def test_a_second_booked_to_the_wrong_bucket_is_caught_in_its_row(wrong, rows_off):
    rows = compare(observed(killed_once()), {**agreeing(), **wrong})
    assert {r["bucket"].split(" ")[0].rstrip(",:") for r in rows if not r["ok"]} == rows_off


def test_a_console_that_falls_behind_and_catches_up_moves_no_step_bucket():
    """Under load the tracker's lines fell 9 s behind before the kill and caught up during the restart
    (the old harness timed steps by these lines: its fault losses came out short by the difference). The
    trace's records time the steps; the console's spread widens the tolerance of what it places."""
    t = killed_once()
    late = {s: w for w, s in t.trace if s <= 7}
    t.prints = [(late[s] + 9.0, s) if s in late else (w, s) for w, s in t.prints]
    calm, seen = observed(killed_once()), observed(t)
    assert (seen.first, seen.replayed_steps, seen.end) == (calm.first, calm.replayed_steps, calm.end)
    assert seen.spread > 8.0
    assert all(r["ok"] for r in compare(seen, agreeing()))


def test_the_lines_are_timed_as_they_pass_through_stdout(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    now = [100.0]
    t = Timeline(launched=99.0)
    with step_prints(t, clock=lambda: now[0]):
        import sys

        sys.stdout.write("[tidal] step 1/20 | loss 5.0\n[tidal] checkpoint at step 1: 1.0 MiB\n[tidal] st")
        now[0] = 101.5
        sys.stdout.write("ep 2/20 | loss 4.9\n(RayTrainWorker pid=1) step 3/20\n[tidal] restart 1: restarting\n")
        sys.stdout.write("[tidal] resumed from checkpoint_000000001 at step 1/20\n[tidal] goodput 9.1% of 1m02s\n")
        sys.stdout.write("[tidal] job 'x' is already complete at step 20 (checkpoint_000000020; train.steps is 20)\n")
    assert t.prints == [(100.0, 1), (101.5, 2)]
    assert t.marks == [(100.0, "checkpoint", 1), (101.5, "restart", 1), (101.5, "resumed", 1), (101.5, "summary", 0),
                       (101.5, "complete", 20)]
    assert "[tidal] step 2/20 | loss 4.9" in out.getvalue(), "everything still reaches the real stdout"


def test_a_drivers_log_and_the_loss_trace_are_read_as_they_grow(tmp_path):
    log, trace = tmp_path / "driver.log", tmp_path / "chaos.trace"
    t = Timeline(launched=0.0)
    now = [5.0]
    tail, records = LogTail(log, t, clock=lambda: now[0]), TraceTail(trace, t, clock=lambda: now[0])
    tail.read()  # no file yet: nothing
    log.write_text("[tidal] job 'x': 2 worker(s)\n[tidal] step 1/9 | loss 3\n[tidal] step 2/9 | lo")
    trace.write_text(json.dumps({"step": 1, "loss": 3.0}) + "\n" + '{"step": 2, "lo')
    tail.read()
    records.read()
    now[0] = 7.0
    with log.open("a") as f:
        f.write("ss 2\n[tidal] step 3/9 | loss 1\n")
    with trace.open("a") as f:
        f.write('ss": 2.0}\n{"torn\n')  # a record cut short by a killed rank is skipped
    tail.read()
    records.read()
    assert t.prints == [(5.0, 1), (7.0, 2), (7.0, 3)]
    assert t.trace == [(5.0, 1), (7.0, 2)]


def test_both_chaos_benchmarks_report_the_comparison_in_one_form():
    from tidal.testing.timeline import markdown_rows

    rows = markdown_rows("under faults", killed_once(), agreeing(), "; a note").splitlines()
    assert rows[0].startswith("| under faults: the harness's clock | 2 lives, 1 failure line(s) after a kill")
    assert rows[0].endswith("; a note |") and len(rows) == 10
    assert rows[1] == ("| under faults, wall: launch to the account's end: harness / ledger | 60.0 s / 60.0 s: **+0.0** "
                       "(held: -1.1 to +1.1) |")
    assert markdown_rows("x", killed_once(), {}) == "| x: the ledger against the harness's clock | no goodput account in the run |\n"
