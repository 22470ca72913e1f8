"""Tidal's defaults for how fast Ray Train recovers, and the user's values winning over them."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import tiny_spec
from tidal.launch.recovery import POLL_INTERVAL, START_TIMEOUT, recovery_env


def test_recovery_defaults_honour_the_users_values(tmp_path: Path):
    elastic = tiny_spec(tmp_path, **{"scaling.min_workers": 1})
    fixed = tiny_spec(tmp_path)
    assert recovery_env(elastic, {}) == {START_TIMEOUT: "5", POLL_INTERVAL: "0.25"}
    assert recovery_env(fixed, {}) == {POLL_INTERVAL: "0.25"}, "a fixed-size job waits for its nodes as long as Ray does"
    assert recovery_env(elastic, {START_TIMEOUT: "90", POLL_INTERVAL: "2"}) == {}
