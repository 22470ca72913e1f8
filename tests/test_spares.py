"""Warm spares' decisions (tidal/worker/spares.py): how many a node keeps and how many to start."""

from __future__ import annotations

import sys
import threading

import pytest

from tidal.worker import spares


@pytest.mark.parametrize("local_workers, setting, idle_cpus, want", [
    (1, None, 1, 4),  # the worker a restart replaces, and the three actors Ray Train starts with each group
    (2, None, 6, 5),
    (8, None, 32, 11),  # a full restart replaces every worker on the node at once
    (2, None, 0, 0),  # the workers take every CPU (a laptop's quickstart): the spares' imports would slow training
    (2, None, 0.5, 0),
    (2, 0, 6, 0),  # failure.warm_spares: 0 turns them off
    (2, 5, 0, 5),  # the user's count wins, even on a full node
])
def test_a_node_keeps_a_spare_per_local_worker_and_per_group_actor(local_workers, setting, idle_cpus, want):
    assert spares.wanted(local_workers, setting, idle_cpus) == want


@pytest.mark.parametrize("want, idle, start", [
    (3, 0, 3),  # the first refill
    (3, 1, 2),  # a restart took two
    (3, 3, 0),  # nothing taken
    (3, 5, 0),  # more than wanted (a user lowered the count): none ended, none started
    (0, 2, 0),
])
def test_only_what_is_missing_is_started(want, idle, start):
    assert spares.to_start(want, idle) == start


ENV = '{"env_vars":{"A":"1","B":"2"},"worker_process_setup_hook":"h"}'


@pytest.mark.parametrize("environ, job, runtime_env, fits", [
    ({"RAY_JOB_ID": "01000000", "A": "1", "B": "2", "PATH": "/bin"}, "01000000", ENV, True),
    ({"RAY_JOB_ID": "02000000", "A": "1", "B": "2"}, "01000000", ENV, False),  # another job's
    ({"RAY_JOB_ID": "01000000", "A": "1"}, "01000000", ENV, False),  # another runtime env (B missing)
    ({"RAY_JOB_ID": "01000000", "A": "1", "B": "3"}, "01000000", ENV, False),
    ({"RAY_JOB_ID": "ffffffff"}, "01000000", "{}", False),  # prestarted at the raylet's start: no job
    ({"RAY_JOB_ID": "01000000"}, "01000000", "{}", True),
    ({"RAY_JOB_ID": "01000000"}, "01000000", "not json", False),
])
def test_an_idle_process_counts_as_a_spare_only_for_its_job_and_runtime_env(environ, job, runtime_env, fits):
    assert spares.fits(environ, job, runtime_env) is fits


def test_a_driver_running_the_setup_hook_never_preloads(monkeypatch):
    """Ray runs the job's setup hook in a driver too: only a Ray worker process may become a spare."""
    monkeypatch.setattr(sys, "argv", ["pytest"])
    before = {t.name for t in threading.enumerate()}
    spares.setup_worker()
    assert "tidal-spare-preload" not in {t.name for t in threading.enumerate()} - before


def test_spares_that_cannot_be_counted_are_asked_for_at_most_twice_over(monkeypatch):
    """Where the idle processes cannot be counted (a runtime env whose variables Ray expands, a
    container), the refill saw 0 forever and asked for `want` more every 10 s for 2 minutes: up to
    12 x want idle torch processes per node (found in review)."""
    import types

    import ray

    import tidal.ray_private

    asked: list[int] = []
    ctx = types.SimpleNamespace(get_job_id=lambda: "01000000", get_runtime_env_string=lambda: "{}",
                                get_node_id=lambda: "n1")
    monkeypatch.setattr(ray, "get_runtime_context", lambda: ctx)
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeID": "n1", "NodeManagerAddress": "127.0.0.1",
                                                "NodeManagerPort": 1}])
    monkeypatch.setattr(tidal.ray_private, "prestart_workers", lambda raylet, job, env, n, keep: asked.append(n))
    monkeypatch.setattr(spares, "idle_spares", lambda job, env: [])  # never counted
    monkeypatch.setattr(spares.time, "sleep", lambda s: None)
    spares.refill(5, patience_s=0.5, ask_every_s=0.0)
    assert 0 < sum(asked) <= 10, asked
