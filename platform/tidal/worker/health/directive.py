"""What the cluster's admission wants of this job's size, as rank 0 sees it (admission/actor.py).

Rank 0 asks the admission actor in a background thread, once a second, and the log step's one
collective (worker/logsync.py) carries its latest answer to every rank, so all of them stop at
the same step. A target other than the size this group was launched for (fewer workers for a
more urgent job, more when capacity frees, 0 to suspend) makes that step a checkpoint (written
before the group ends) and the group's last: the driver restarts it at the new size
(admission/seat.py); what each answer does is the group's health decision (worker/health/decide.py). The thread never holds a step: while the actor cannot be reached, the
group trains on at its size (admission down is never a reason to stop).
"""

from __future__ import annotations

import threading
from typing import Any

from tidal.worker.health.decide import (
    NONE,  # no word from admission: not under it, or it cannot be reached now
)

POLL_S = 1.0


class Directive:
    """Rank 0's background poll of the admission actor for job `job`."""

    def __init__(self, job: str, world: int, poll_s: float = POLL_S) -> None:
        self.job, self.world, self.poll_s = job, world, poll_s
        self.target = NONE
        self._stop = threading.Event()
        threading.Thread(target=self._poll, daemon=True, name="tidal-directive").start()

    def _poll(self) -> None:
        import ray

        from tidal.admission.handle import admitter

        handle: Any = None
        while not self._stop.wait(self.poll_s):
            try:
                handle = handle or admitter()
                entry = ray.get(handle.status.remote(self.job, self.world), timeout=10) if handle else {}
                self.target = float(entry["workers"]) if entry.get("state") in ("RUNNING", "SUSPENDED") else NONE
            except Exception:  # noqa: BLE001 - admission restarting or gone: train on, ask again
                handle, self.target = None, NONE

    def close(self) -> None:
        self._stop.set()


__all__ = ["Directive"]
