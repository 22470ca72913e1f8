"""Typed events (tracking/events.py): the log's wire format is what it was, and the console reads
every kind by its type."""

from __future__ import annotations

import pytest

from tidal.storage import RunDir
from tidal.tracking.buffer import MetricsBuffer
from tidal.tracking.console import Console
from tidal.tracking.emitter import Emitter
from tidal.tracking.events import Resumed, StepMetrics, WorkersFailed, parse


def test_the_event_log_keeps_its_format(tmp_path):
    events = Emitter(str(tmp_path), "job")
    events.metrics({"step": 3, "loss": 1.5, "preempted": False})
    events.checkpointed(3, {"checkpoint_bytes": 10})
    events.resumed("checkpoint_000003", 3, 2, 1)
    events.say("hello", 3)
    events.failed({1: "gone"}, 4)
    assert events.drain(timeout_s=30)
    run = RunDir(str(tmp_path), "job")
    stored = [{k: v for k, v in e.items() if k not in ("id", "ts")} for e in MetricsBuffer(run.fs, run.path).load()]
    # As an older Tidal wrote it (the buffer gives every entry `values`), so either reads the other's log.
    assert stored == [
        {"kind": "metrics", "step": 3, "values": {"loss": 1.5}},
        {"kind": "checkpoint", "step": 3, "values": {"checkpoint_bytes": 10.0}},
        {"values": {}, "kind": "resumed", "step": 3, "checkpoint": "checkpoint_000003", "old_world": 2, "world": 1},
        {"values": {}, "kind": "note", "step": 3, "text": "hello"},
        {"values": {}, "kind": "failure", "step": 4, "failures": {"1": "gone"}},
    ]
    assert parse(stored[2]) == Resumed(3, "checkpoint_000003", 2, 1)


def test_the_last_failure_names_the_jobs_max_restarts_not_its_restarts_so_far():
    """Restarts count over the job's whole life (groups a resize or a relaunch started included),
    failure.max_restarts over one group's: 3 restarts so far and a limit of 1 say the limit as it is."""
    line = Console(10, max_restarts=1).line(WorkersFailed(4, {"0": "gone"}, final=True, restarts=3))
    assert line.endswith("the worker group failed again after 3 restart(s) (failure.max_restarts 1): "
                         "Ray Train gives up on it"), line


def test_the_console_reads_each_kind_and_skips_unknown_ones(capsys):
    console = Console(10)
    console({"kind": "failure", "step": 4, "failures": {"1": "gone"}, "restarts": 2, "reported": 7, "id": "x"})
    console({"kind": "resized", "step": 8, "old_world": 2, "world": 1, "after_failure": True})
    console({"kind": "sink_down", "error": "ConnectionError", "where": "/runs/job/tidal-mlflow-buffer"})
    console({"kind": "from_a_newer_tidal", "step": 9})
    console({"kind": "checkpoint", "step": 5, "values": {}, "replay": True})
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "[tidal] worker rank 1 failed: gone",
        "[tidal] restart 2: restarting the worker group from the latest complete checkpoint (last step reached: 7)",
        "[tidal] resized: world size 2 -> 1 (after a failure), training again at step 8",
        "[tidal] WARNING: MLflow is unreachable (ConnectionError); training continues and metrics wait in "
        "/runs/job/tidal-mlflow-buffer until it is back",
    ]
    assert parse({"kind": "metrics", "step": 1, "values": {}}) == StepMetrics(1, {})
    assert isinstance(parse({"kind": "failure", "step": 1, "failures": {}}), WorkersFailed)


def test_a_worker_replaced_alone_is_not_announced_as_a_group_restart():
    """failure.replace_in_place: Ray Train replaces the lost worker alone and the survivors keep their
    processes; the console said the worker group restarts from the latest complete checkpoint."""
    line = Console(10).line(WorkersFailed(13, {"1": "gone"}, restarts=1, reported=13, in_place=True))
    assert "restart 1: replacing rank(s) 1 alone" in line and "restarting the worker group" not in line, line


@pytest.mark.parametrize("in_place, workers, failed, alone", [
    (True, 2, 1, True),  # one of two lost: Ray Train replaces it in its bundle
    (True, 4, 3, True),
    (True, 2, 2, False),  # every worker failed: Ray Train restarts the group
    (True, (1, 2), 1, False),  # an elastic group: Ray Train 2.60 replaces only at a fixed size
    (True, 1, 1, False),  # a group of one has no survivor
    (False, 2, 1, False),  # the switch off: the group restarts
])
def test_which_failures_ray_train_replaces_alone(in_place, workers, failed, alone):
    from tidal.launch.callbacks import replaced_alone

    assert replaced_alone(in_place, workers, failed) is alone
