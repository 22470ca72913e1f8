"""CI's rotation of the extended tests (tests/rotation.py): the same commit always runs the same share, N
consecutive commits run every extended test, and no share's measured time passes the stage's budget."""

from __future__ import annotations

import json

import pytest

from tests.rotation import (
    BUDGET_S,
    DURATIONS,
    UNMEASURED_S,
    choose,
    parse_durations,
    partition,
    share_index,
)

MEASURED = json.loads(DURATIONS.read_text())


def _tests(n: int) -> dict[str, float]:
    return {f"tests/test_{k % 7}.py::test_{k}": 30.0 + (k * 37) % 170 for k in range(n)}


@pytest.mark.parametrize("durations", [MEASURED, _tests(64), _tests(5)], ids=["measured", "64", "5"])
def test_consecutive_commits_run_every_test_once_within_the_budget(durations: dict[str, float]) -> None:
    first = choose(durations, durations, commits=1000, sha="ab12")
    ran: list[str] = []
    for commits in range(1000, 1000 + first.count):
        share = choose(durations, durations, commits, sha="ab12")
        assert share.count == first.count
        assert share.estimate_s <= BUDGET_S
        ran += share.ids
    assert sorted(ran) == sorted(durations)  # each exactly once


def test_the_measured_file_names_tests_with_their_seconds() -> None:
    assert MEASURED and all("::" in test and 0 < s < BUDGET_S for test, s in MEASURED.items())


def test_a_commit_always_runs_the_same_share() -> None:
    durations = _tests(64)
    picks = {choose(reversed(list(durations)), durations, commits=None, sha="9f3c2e1d00aa").ids for _ in range(3)}
    picks.add(choose(sorted(durations), dict(sorted(durations.items(), reverse=True)), None, "9f3c2e1d00aa").ids)
    assert len(picks) == 1
    assert share_index(7, 43, "ffff") == 43 % 7
    assert share_index(7, None, "ffff") == 0xFFFF % 7
    assert share_index(7, None, "") == 0


def test_an_unmeasured_test_counts_long_and_a_test_past_the_budget_is_refused() -> None:
    share = choose(["tests/test_new.py::test_new"], {}, commits=3, sha="")
    assert share.ids == ("tests/test_new.py::test_new",) and share.estimate_s == UNMEASURED_S
    with pytest.raises(ValueError, match="longer than the whole budget"):
        partition({"tests/t.py::test_soak": BUDGET_S + 1}, BUDGET_S)


def test_durations_are_read_from_pytests_report() -> None:
    report = """============================= slowest durations =============================
120.51s call     tests/test_burst.py::test_job_bursts_to_cloud_and_the_cloud_node_is_released
6.20s setup    tests/test_burst.py::test_job_bursts_to_cloud_and_the_cloud_node_is_released
0.31s teardown tests/test_reshard.py::test_resume_across_world_sizes[2]
0.01s call     tests/test_driver_resume.py::test_truncated_newest_checkpoint_is_quarantined_and_skipped
=========================== short test summary info ============================
FAILED tests/test_driver_resume.py::test_truncated_newest_checkpoint_is_quarantined_and_skipped - IndexError
"""
    assert parse_durations(report.splitlines()) == {  # the failed one stopped early: not a duration
        "tests/test_burst.py::test_job_bursts_to_cloud_and_the_cloud_node_is_released": 126.7,
        "tests/test_reshard.py::test_resume_across_world_sizes[2]": 0.3,
    }
