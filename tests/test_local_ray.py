"""The local Ray instance `tidal run` and `tidal sweep` start without RAY_ADDRESS: without Ray's
dashboard unless asked for, and then without the warning Ray Train's cleaner prints every second
it cannot reach the State API (tests/test_tracking_console.py runs one and reads its output)."""

from __future__ import annotations

import importlib
import logging

import pytest

from tidal.launch.trainer import local_ray_options

CLEANER = "ray.train.v2._internal.execution.controller.placement_group_cleaner"


@pytest.mark.parametrize("dashboard, env, expected", [
    (False, {}, False),
    (False, {"TIDAL_RAY_DASHBOARD": "0"}, False),
    (False, {"TIDAL_RAY_DASHBOARD": "1"}, True),
    (True, {}, True),  # an ASHA sweep needs the State API
])
def test_the_dashboard_starts_only_when_asked_for(dashboard, env, expected):
    options = local_ray_options(dashboard, env)
    assert options["include_dashboard"] is expected
    assert ("runtime_env" in options) is not expected, "the hook only where the cleaner cannot reach the State API"


def test_the_setup_hook_names_a_function_that_lowers_the_cleaner_warning(monkeypatch):
    """Ray imports the hook by name in every worker process: a wrong name would fail every worker."""
    monkeypatch.delenv("TIDAL_DEBUG", raising=False)
    module, _, name = local_ray_options(False, {})["runtime_env"]["worker_process_setup_hook"].rpartition(".")
    hook = getattr(importlib.import_module(module), name)
    logger = logging.getLogger(CLEANER)
    before = logger.level
    try:
        logger.setLevel(logging.NOTSET)  # setLevel, not an attribute: it also clears logging's cache
        monkeypatch.setenv("TIDAL_DEBUG", "1")
        hook()
        assert logger.isEnabledFor(logging.WARNING), "TIDAL_DEBUG=1 keeps every library line"
        monkeypatch.delenv("TIDAL_DEBUG")
        hook()
        assert not logger.isEnabledFor(logging.WARNING) and logger.isEnabledFor(logging.ERROR)
    finally:
        logger.setLevel(before)
