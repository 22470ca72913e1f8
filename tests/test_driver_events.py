"""The driver's goodput events are a side channel: a storage error writing one is a warning, never the
end of the driver (it may be at the job's end, or already handed to its successor by admission)."""

from __future__ import annotations

from tidal.launch.trainer import record_event
from tidal.storage import RunDir
from tidal.tracking.buffer import MetricsBuffer
from tidal.tracking.events import GroupEnded, Launched


def test_a_refused_event_write_is_a_warning_not_a_dead_driver(tmp_path, capsys):
    blocker = tmp_path / "storage"
    blocker.write_text("a file where the job's folder must go: every write under it fails")
    run_dir = RunDir(str(blocker), "job")
    record_event(run_dir, GroupEnded(0))  # raised FileExistsError/NotADirectoryError before: the driver ended
    out = capsys.readouterr().out
    assert "goodput account misses the driver's GroupEnded event" in out


def test_an_event_is_written_where_the_account_reads_it(tmp_path):
    run_dir = RunDir(str(tmp_path), "job")
    record_event(run_dir, Launched(0, {"t0": 1.0, "queue_s": 2.0}))
    [entry] = MetricsBuffer(run_dir.fs, run_dir.path).load()
    assert entry["values"] == {"t0": 1.0, "queue_s": 2.0} and "ts" in entry
