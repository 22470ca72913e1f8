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
