"""Ray Train controller callbacks (they run in Ray's controller process, not in the workers)."""

from __future__ import annotations

import logging
from typing import Any

from ray.train import UserCallback

from tidal.eval_best import spared
from tidal.spec.job import JobSpec
from tidal.storage import RunDir
from tidal.tracking.emitter import Emitter

log = logging.getLogger("tidal")


class FailureNotifier(UserCallback):
    """Ray Train controller callback: records in the job's event log that the worker group failed
    (the tracker counts and prints it), written at once so a dead tracker cannot lose it."""

    def __init__(self, spec: JobSpec) -> None:
        self.storage, self.name = spec.checkpoint.storage, spec.name

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        events = Emitter(self.storage, self.name)
        events.failed({r: _last_line(e) for r, e in worker_exceptions.items()})
        events.drain(timeout_s=10.0)  # a storage outage must not hold up Ray's restart


def _last_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[-1][:300] if text else type(e).__name__


class Retention(UserCallback):
    """After every checkpoint, delete old ones Ray never registered (so its num_to_keep never sees
    them: reported just before a crash, or written by an earlier driver). Runs in Ray's controller."""

    def __init__(self, spec: JobSpec) -> None:
        self.spec, self.storage, self.name, self.keep = spec, spec.checkpoint.storage, spec.name, spec.checkpoint.keep

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
        if checkpoint is None:
            return
        try:
            run_dir = RunDir(self.storage, self.name)
            run_dir.prune(self.keep, spare=spared(self.spec, run_dir))
        except OSError as e:  # retention can wait for the next checkpoint; training must not
            log.warning("checkpoint retention skipped this time: %s", e)
