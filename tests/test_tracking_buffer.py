"""A driver that dies between sending buffered points and forgetting them: the next tracker sends
the rest once and none twice, with the buffer on a local path or on S3. No Ray."""

from __future__ import annotations

import pytest

from tests.conftest import metric_history, tiny_spec
from tidal.storage import RunDir
from tidal.tracking import mlflow as tracking
from tidal.tracking.buffer import MetricsBuffer


@pytest.mark.parametrize("where", ["local", "s3"])
def test_recovered_buffer_is_sent_once(tmp_path, where, request):
    storage = str(tmp_path / "runs") if where == "local" else request.getfixturevalue("bucket") + "/runs"
    spec = tiny_spec(tmp_path, name="recover", **{"checkpoint.storage": storage})
    run_id = tracking.start_run(spec, None, {})
    run = RunDir(spec.checkpoint.storage, spec.name)
    buffer = MetricsBuffer(run.fs, run.path)
    for step in range(1, 6):
        buffer.append({"step": step, "values": {"loss": 10.0 - step, "tokens_per_s": 100.0}, "ts": step})
    # The dead driver had sent steps 1-3 in one batch and died before forgetting them.
    tracking._send(spec, run_id, [{"step": s, "values": {"loss": 10.0 - s, "tokens_per_s": 100.0}, "ts": s}
                                  for s in (1, 2, 3)])

    tracker = tracking.Tracker(spec, run_id)
    tracker.log({"step": 6, "loss": 4.0, "tokens_per_s": 100.0, "samples_per_s": 1.0, "mfu": 0.1, "world_size": 2})
    _, _, left = tracker.close()

    assert left == 0
    assert metric_history(spec, run_id, "loss") == {s: 10.0 - s for s in range(1, 7)}
    assert metric_history(spec, run_id, "tokens_per_s").keys() == set(range(1, 7))
    assert buffer.load() == []  # everything sent is forgotten


def test_a_new_driver_knows_what_mlflow_holds_while_mlflow_is_down(tmp_path):
    """The mark beside the buffer says how far MLflow holds the run, so steps replayed after a
    driver's death are not buffered again even when MLflow cannot be asked."""
    spec = tiny_spec(tmp_path, name="down", **{"tracking.uri": "http://127.0.0.1:9"})  # nothing listens there
    run = RunDir(spec.checkpoint.storage, spec.name)
    run.write_json(tracking.SENT_FILE, {"run_id": "r" * 32, "step": 5, "checkpoint_step": 4})

    tracker = tracking.Tracker(spec, "r" * 32, retry_s=60, system_metrics=False)
    for step in (4, 5, 6):  # resumed from the checkpoint at 4: 5 is a replay, 6 is new
        tracker.log({"step": step, "loss": 1.0, "tokens_per_s": 1.0, "samples_per_s": 1.0, "mfu": 0.1,
                     "world_size": 2})
    tracker.checkpointed(4, {"checkpoint_bytes": 1.0, "checkpoint_save_s": 0.1, "checkpoint_blocked_s": 0.1})
    buffered = MetricsBuffer(run.fs, run.path).load()
    tracker.stopped.set()  # MLflow stays down: leave the points buffered for the next driver
    assert [e["step"] for e in buffered] == [6]
