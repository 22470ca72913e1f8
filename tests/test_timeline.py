"""The chaos harness's own clock (tidal/testing/timeline.py), which the chaos benchmarks hold the goodput
ledger against: what it derives from a timeline of launch, kills and printed steps, and the comparison."""

from __future__ import annotations

import io

import pytest

from tidal.testing.timeline import Timeline, compare, from_ledger, observed, step_prints


def killed_once() -> Timeline:
    """Launched at 0, steps 1-10 printed at 20-29 s, a kill at 29.5 s, steps 8-10 replayed at 45-47 s,
    step 11 at 48 s and 12-20 at 49-57 s; the job ended at 60 s."""
    prints = [(19.0 + s, s) for s in range(1, 11)] + [(45.0, 8), (46.0, 9), (47.0, 10)]
    prints += [(48.0, 11)] + [(37.0 + s, s) for s in range(12, 21)]
    return Timeline(launched=0.0, ended=60.0, kills=[(29.5, 10)], prints=prints)


def test_the_harness_clock_gives_start_up_each_faults_loss_and_progress():
    seen = observed(killed_once())
    # start-up 20 s; the kill's gap 29 -> 48 s less one ordinary step (1 s); the rest is progress
    assert seen == {"startup": 20.0, "faults": 18.0, "progress": 22.0, "wall": 60.0}
    assert observed(Timeline(0.0, 5.0)) == {"startup": 5.0, "faults": 0.0, "progress": 0.0, "wall": 5.0}


def test_a_step_printed_just_after_the_kill_was_done_before_it():
    """Lines reach the harness late: step 10, done before a kill at 29 s, printed at 29.5 s; the gap runs
    from its print to the first step beyond it, whether the harness knew the step or not."""
    late = killed_once()
    for known in (10, 0):
        late.kills = [(29.0, known)]
        assert observed(late)["faults"] == 18.0


def test_a_step_printed_long_after_the_kill_does_not_shorten_the_faults_loss():
    """Under load the console's lines reach the harness seconds late: step 10, done before the kill at
    29.5 s (the harness knew it), printed only at 33 s. Its loss runs from the kill at the latest, not
    from that print, which would leave 3.5 s of the fault to progress."""
    late = killed_once()
    late.prints = [(33.0, 10) if p == (29.0, 10) else p for p in late.prints]
    step = (8.0 + 5.0 + 9.0) / 18  # the ordinary intervals: steps 1-9, 9-10 (the late line) and 11-20
    assert observed(late)["faults"] == pytest.approx(48.0 - 29.5 - step)


@pytest.mark.parametrize("ledger, agree", [
    ({"goodput_startup_s": 30.0, "goodput_restore_s": 2.0, "goodput_replayed_s": 6.0, "goodput_productive_s": 20.0,
      "goodput_other_s": 2.0, "goodput_wall_s": 60.0}, True),
    # a ledger that booked the restart's 15 s to `other` (as progress): 15 s off on both groups
    ({"goodput_startup_s": 15.0, "goodput_restore_s": 2.0, "goodput_replayed_s": 6.0, "goodput_productive_s": 20.0,
      "goodput_other_s": 17.0, "goodput_wall_s": 60.0}, False),
])
def test_the_ledger_is_held_against_the_harness_group_by_group(ledger, agree):
    rows = compare(observed(killed_once()), from_ledger(ledger), within_s=2.0)
    assert [r["group"] for r in rows] == ["lost to start-up and faults", "progress", "wall"]
    assert all(r["ok"] for r in rows[:2]) is agree and rows[2]["ok"]


def test_the_step_lines_are_timed_as_they_pass_through_stdout(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    now = [100.0]
    t = Timeline(launched=99.0)
    with step_prints(t, clock=lambda: now[0]):
        import sys

        sys.stdout.write("[tidal] step 1/20 | loss 5.0\n[tidal] checkpoint at step 1\n[tidal] st")
        now[0] = 101.5
        sys.stdout.write("ep 2/20 | loss 4.9\n(RayTrainWorker pid=1) step 3/20\n")
    assert t.prints == [(100.0, 1), (101.5, 2)]
    assert "[tidal] step 2/20 | loss 4.9" in out.getvalue(), "everything still reaches the real stdout"


def test_a_drivers_log_is_read_as_it_grows(tmp_path):
    from tidal.testing.timeline import LogTail

    log = tmp_path / "driver.log"
    t = Timeline(launched=0.0)
    now = [5.0]
    tail = LogTail(log, t, clock=lambda: now[0])
    tail.read()  # no file yet: nothing
    log.write_text("[tidal] job 'x': 2 worker(s)\n[tidal] step 1/9 | loss 3\n[tidal] step 2/9 | lo")
    tail.read()
    now[0] = 7.0
    with log.open("a") as f:
        f.write("ss 2\n[tidal] step 3/9 | loss 1\n")
    tail.read()
    assert t.prints == [(5.0, 1), (7.0, 2), (7.0, 3)]


def test_both_chaos_benchmarks_report_the_comparison_in_one_form():
    from tidal.testing.timeline import markdown_rows

    ledger = {"goodput_startup_s": 15.0, "goodput_restore_s": 2.0, "goodput_replayed_s": 6.0,
              "goodput_productive_s": 20.0, "goodput_other_s": 17.0, "goodput_wall_s": 60.0}
    rows = markdown_rows("under faults", killed_once(), ledger, "; a note").splitlines()
    assert rows[0] == ("| under faults, lost to start-up and faults: the harness's clock / the ledger | 38.0 s / "
                       "23.0 s: **-15.0 s** (beyond 4 s; a note) |")
    assert len(rows) == 3 and rows[2].endswith("60.0 s / 60.0 s: **+0.0 s** (within 4 s; a note) |")
    assert markdown_rows("x", killed_once(), {}) == "| x: the ledger against the harness's clock | no goodput account in the run |\n"
