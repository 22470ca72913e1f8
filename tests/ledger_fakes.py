"""Fakes around the tracking core (tracking/ledger.py) for its tests: a real MLflow sink that can
be made unreachable or slow, a clock a test moves, and events emitted as a job's workers do."""

from __future__ import annotations

from tests.conftest import tiny_spec
from tidal.storage import RunDir
from tidal.tracking.buffer import MetricsBuffer
from tidal.tracking.emitter import Emitter
from tidal.tracking.ledger import Ledger
from tidal.tracking.writer import RunWriter

STEP = {"loss": 1.0, "lr": 0.1, "tokens_per_s": 100.0, "samples_per_s": 1.0, "mfu": 0.1, "world_size": 2}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Server(RunWriter):
    """The real MLflow sink, with a switch that makes the server unreachable, a gate that makes it
    slow, and a record of the batches it received."""

    def __init__(self, spec, down: bool = False) -> None:
        super().__init__(spec)
        self.down, self.gate, self.attempts, self.batches = down, None, 0, []

    def open(self, run_id):
        self.attempts += 1
        if self.down:
            raise ConnectionError("connection refused")
        return super().open(run_id)

    def send(self, run_id, entries):
        if self.gate is not None:
            self.gate.wait()
        super().send(run_id, entries)
        self.batches.append(len(entries))


def setup(tmp_path, uri, name="ledger", **overrides):
    spec = tiny_spec(tmp_path, name=name, **{"tracking.uri": uri, **overrides})
    run = RunDir(spec.checkpoint.storage, spec.name)
    return spec, run, MetricsBuffer(run.fs, run.path)


def ledger(spec, run, server, run_id, clock=None, printed=None):
    return Ledger(MetricsBuffer(run.fs, run.path), run, server, run_id, retry_s=5.0, clock=clock or Clock(),
                  subscribers=[printed.append] if printed is not None else [])


def emit(spec, steps, loss=lambda s: 10.0 - s / 10, checkpoints=()):
    events = Emitter(spec.checkpoint.storage, spec.name)
    for s in steps:
        events.metrics({"step": s, **STEP, "loss": loss(s)})
        if s in checkpoints:
            events.checkpointed(s, {"checkpoint_bytes": 1e6, "checkpoint_save_s": 0.1, "checkpoint_blocked_s": 0.1})
    assert events.drain(timeout_s=30)
    return events
