"""The local Ray instance `tidal run` and `tidal sweep` start without RAY_ADDRESS: without Ray's
dashboard unless asked for, and then without the warning Ray Train's cleaner prints every second
it cannot reach the State API (tests/test_tracking_console.py runs one and reads its output); and
where a driver connects instead: RAY_ADDRESS, or a live `ray start` cluster on this machine."""

from __future__ import annotations

import importlib
import logging
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.helpers import driver_in
from tidal.launch.connect import SETUP_HOOK as QUIET
from tidal.launch.connect import local_ray_options

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


RECORDED = "10.1.2.3:6379"


@pytest.mark.parametrize("env, recorded, alive, address, warns", [
    ({"RAY_ADDRESS": "head:6379"}, RECORDED, True, "head:6379", False),  # RAY_ADDRESS wins
    ({"RAY_ADDRESS": "local"}, RECORDED, True, None, False),  # Ray's own word for "start one"
    ({}, None, False, None, False),  # nothing recorded: a local instance, as before
    ({}, RECORDED, True, "auto", False),  # `ray start` on this machine, still up: use it, as ray.init does
    ({}, RECORDED, False, None, True),  # ... but gone: a local instance, and say why
])
def test_where_a_driver_connects(env, recorded, alive, address, warns):
    from tidal.launch.connect import ray_target

    target = ray_target(env, recorded, lambda a: alive and a == RECORDED)
    assert target.address == address
    assert (target.warning is not None) is warns
    if warns:
        assert RECORDED in target.warning and "ray_current_cluster" in target.warning


def test_the_address_file_is_where_ray_start_writes_it(tmp_path):
    """Ray's own function decides where `ray start` records its address; ours must read the same file."""
    from ray._common.utils import get_ray_address_file

    from tidal.launch.connect import address_file

    for env in ({}, {"TMPDIR": str(tmp_path)}, {"RAY_TMPDIR": str(tmp_path / "r"), "TMPDIR": str(tmp_path)}):
        with pytest.MonkeyPatch.context() as mp:
            for k in ("RAY_TMPDIR", "TMPDIR"):
                mp.delenv(k, raising=False)
            for k, v in env.items():
                mp.setenv(k, v)
            assert address_file(env) == Path(get_ray_address_file(None))


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): one fault of a local instance's record
@pytest.mark.slow
def test_a_dead_recorded_cluster_does_not_stop_a_run(tmp_path):
    """A `ray start` (or a test Cluster) killed without `ray stop` leaves its address recorded; a bare
    ray.init() then retries it (20 s to minutes) and fails. Tidal starts a local instance and says why."""
    short = Path(tempfile.mkdtemp(prefix="tr-", dir="/tmp"))  # Ray's socket paths have a length limit
    try:
        (short / "ray").mkdir()
        dead = f"127.0.0.1:{free_port()}"  # nobody listens there
        (short / "ray" / "ray_current_cluster").write_text(dead)
        proc = driver_in(short)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert "no longer answers" in proc.stderr and "ray_current_cluster" in proc.stderr
        assert "starting a local Ray instance" in proc.stdout and "gcs " in proc.stdout
        assert f"gcs {dead}" not in proc.stdout, "connected to a local instance, not the dead address"
    finally:
        shutil.rmtree(short, ignore_errors=True)


@pytest.mark.parametrize("env, hooked", [
    ({}, True),
    ({"RAY_JOB_CONFIG_JSON_ENV_VAR": '{"runtime_env": {"working_dir": "gcs://_ray_pkg_x.zip"}}'}, True),
    ({"RAY_JOB_CONFIG_JSON_ENV_VAR": '{"runtime_env": {"worker_process_setup_hook": "mine.setup"}}'}, False),
    ({"TIDAL_DEBUG": "1"}, False),
])
def test_on_a_cluster_the_cleaner_hook_is_added_unless_the_job_has_its_own(env, hooked):
    """A cluster without a dashboard makes the cleaner warn every second too; a submitted job's own
    setup hook would make ray.init refuse to merge, so it wins."""
    from tidal.launch.connect import cluster_ray_options

    options = cluster_ray_options(env)
    assert (options.get("runtime_env", {}).get("worker_process_setup_hook") == QUIET) is hooked
