"""A waiting job holds no driver: it parks, and admission starts its driver once it is admitted.

Why: a driver waiting for its seat is a Python process with Ray's core worker on the head (154 MB
of RSS measured, docs/benchmarks.md "Head memory per queued job"): a thousand queued jobs would
need about 150 GB of the head. Ray has no job queue and Kueue needs Kubernetes (admission/actor.py);
the Jobs API keeps each job's record (its entrypoint, its runtime environment with its package),
which is all a later start needs. So:
- a driver that runs as a Ray Job and still waits `PARK_AFTER_S` after registering (a short wait
  keeps its driver: parking costs one driver start) asks the actor to park its job, naming the Ray
  job id its driver will have next (`successor_id`: its own id and `-p`). The actor records it in the queue document,
  saved before the driver is told; the driver prints where the job goes on (a record that `Job`
  follows: launch/chain.py) and ends, SUCCEEDED;
- once admitted, the actor submits that successor from the parked driver's own record
  (admission/relaunch.py: the same step that starts a lost head's jobs again), under the job's key:
  the job keeps its place, its size and its MLflow run;
- the successor id is the job's ticket: stopping a parked job (`Job.stop`) takes the id first with
  a job that does nothing, marked `CANCELLED`; admission, finding the id taken so, drops the entry.
  Whoever comes first wins, at the Jobs API, which refuses a second job under one id.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from tidal.admission.queue_doc import Entry, Queue
from tidal.errors import TidalError
from tidal.redact import redact_text

log = logging.getLogger("tidal")
PARK_VAR = "TIDAL_PARK_AFTER_S"  # seconds a submitted job waits with its driver before parking; < 0: never
PARK_AFTER_S = 30.0
# A parked job's package is pinned in the GCS this long, and pinned again half way (admission/actor.py).
PIN_S = 3600.0
Pinner = Callable[[str, float], int]  # pins the packages of a submission's runtime env; how many
SUFFIX = "-p"
CANCELLED = "tidal.cancelled"  # metadata of the no-op job that takes a stopped parked job's ticket
# A successor that cannot be submitted (the Jobs API down) is tried again every RETRY_S, ATTEMPTS
# times in all (5 minutes: an outage, not the job, is the likely cause), then its entry leaves the
# queue, its successor id marked DROPPED where the Jobs API takes it (the log says to submit it again).
ATTEMPTS = 30
RETRY_S = 10.0
DROPPED = "tidal.dropped"  # metadata of the no-op job that takes a dropped parked job's id: why
CHECK_S, CHECK_FIRST = 10.0, 10  # how often, and for how many of the first parked jobs, a stop is looked for


class Cancelled(Exception):
    """The parked job was stopped: its successor id is taken by a CANCELLED job."""


class Gone(Exception):
    """A driver's Jobs API record is gone (`ray job delete`): nothing to start its job from again."""


class Parked(Exception):
    """Raised out of the seat's wait: the job waits in the queue with no driver, and starts as Ray
    job `successor` once admitted. Not an error: the driver ends, its job stays queued."""

    def __init__(self, successor: str, position: int | None = None) -> None:
        super().__init__(successor)
        self.successor, self.position = successor, position


def park_after_s(environ: Mapping[str, str]) -> float | None:
    """How long a submitted job waits with its driver before parking; None: never parks. A value
    that is not a number is refused at once, naming the variable."""
    raw = environ.get(PARK_VAR, "")
    try:
        after = float(raw) if raw else PARK_AFTER_S
    except ValueError:
        raise TidalError(f"{PARK_VAR}={raw!r} is not a number of seconds (a negative one: never park)") from None
    return None if after < 0 else after


def may_park(environ: Mapping[str, str], submission: str, waited_s: float) -> bool:
    """Whether this waiting driver may leave: it is a Ray Job's driver (a `tidal run` in a terminal
    or a notebook is the person's own process, not the head's), and it has waited long enough."""
    after = park_after_s(environ)
    return bool(submission) and after is not None and waited_s >= after


def successor_id(submission: str) -> str:
    """The id a parked driver's job goes on as: that driver's own submission id and `-p`, within a
    key's length. Fixed, so that anyone holding the id can find it (launch/chain.py) or take it
    (a stop) without reading the parked driver's logs, which a head restart loses."""
    return submission[:128 - len(SUFFIX)] + SUFFIX


def stopped_soon(queue: Queue, stopped: Callable[[str], bool], limit: int = CHECK_FIRST) -> list[str]:
    """The parked jobs, among the `limit` first in the queue, whose successor id a stop has taken
    (`stopped(successor)`): to drop now, before admission shrinks or suspends a running job to make
    room for a job nobody wants. Only the first few: one Jobs API call each, every CHECK_S; the
    rest are found when their turn comes (ParkedStarts)."""
    first = sorted((e for e in queue.entries if e.successor and e.state != "RUNNING"),
                   key=lambda e: (e.position is None, e.position or 0, e.submitted_at))[:limit]
    out = []
    for e in first:
        try:
            if stopped(e.successor):
                out.append(e.job)
        except Exception as ex:  # noqa: BLE001 - the Jobs API: looked at again next time
            log.debug("could not look at %s: %s", e.successor, ex)
    return out


class Pins:
    """Each parked job's package kept in the GCS (`pin`: the Jobs API's), for PIN_S, and pinned
    again half way through; `at`: when each was last pinned (an actor restarted knows none, and
    pins every parked job again at its first tick)."""

    def __init__(self, pin: Pinner) -> None:
        self.pin_for, self.at = pin, {}

    def pin(self, entry: Entry) -> float:
        """Pin `entry`'s package now (raises if it cannot be); when."""
        self.pin_for(entry.submission or entry.job, PIN_S)
        return time.time()

    def renew(self, queue: Queue, now: float) -> None:
        for e in queue.entries:
            if e.successor and now - self.at.get(e.job, 0.0) > PIN_S / 2:
                try:
                    self.pin(e)
                    self.at[e.job] = now
                except Exception as ex:  # noqa: BLE001 - pinned until PIN_S: try again next tick
                    log.warning("could not pin parked job %s's package (%s: %s)", e.job, type(ex).__name__, ex)


def admitted_parked(queue: Queue) -> list[Entry]:
    """The parked jobs admission has given workers: their drivers are to be submitted, oldest first."""
    return sorted((e for e in queue.entries if e.successor and e.state == "RUNNING" and e.workers > 0),
                  key=lambda e: e.submitted_at)


class ParkedStarts:
    """Submits each admitted parked job's driver (through `make()`'s starter, the Jobs API), trying
    a failed one again every RETRY_S, ATTEMPTS times in all."""

    def __init__(self, make: Callable[[], Callable[[Entry], str]],
                 make_mark: Callable[[], Callable[[str, str], None]] | None = None) -> None:
        self._make, self._start = make, None
        self._make_mark: Callable[[], Callable[[str, str], None]] = make_mark or (lambda: lambda successor, why: None)
        self._mark: Callable[[str, str], None] | None = None
        self.tries: dict[str, int] = {}
        self.retry_at: dict[str, float] = {}

    def run(self, queue: Queue, now: float | None = None) -> tuple[dict[str, str], list[str]]:
        """The jobs started (their new submission ids) and those to drop (stopped while parked, or
        never startable)."""
        now = time.time() if now is None else now
        started: dict[str, str] = {}
        dropped: list[str] = []
        for entry in admitted_parked(queue):
            if self.retry_at.get(entry.job, 0.0) > now:
                continue
            try:
                self._start = self._start or self._make()
                started[entry.job] = self._start(entry)
            except Cancelled:
                log.warning("job %s was stopped while it waited parked: it leaves the queue", entry.job)
                dropped.append(entry.job)
            except Gone as e:
                self._drop(entry, f"its Ray job's record is gone ({e}); submit it again", dropped)
            except Exception as e:  # noqa: BLE001 - the Jobs API or the record: try again, then give up saying so
                self.tries[entry.job] = tries = self.tries.get(entry.job, 0) + 1
                if tries < ATTEMPTS:
                    self.retry_at[entry.job] = now + RETRY_S
                    continue
                self._drop(entry, f"its driver could not be started after {ATTEMPTS} tries "
                           f"({type(e).__name__}: {redact_text(str(e))[:300]}); submit it again (it resumes from its "
                           "latest checkpoint)", dropped)
            self.tries.pop(entry.job, None)
            self.retry_at.pop(entry.job, None)
        return started, dropped

    def _drop(self, entry: Entry, why: str, dropped: list[str]) -> None:
        """The job leaves the queue; its successor id says why to whoever follows the job, where the
        Jobs API takes it (`Job.status()` then says FAILED with this reason, not QUEUED forever)."""
        log.error("job %s was admitted but leaves the queue: %s", entry.job, why)
        dropped.append(entry.job)
        try:
            self._mark = self._mark or self._make_mark()
            self._mark(entry.successor, why)
        except Exception as e:  # noqa: BLE001 - the Jobs API is what failed: the log says it
            log.debug("could not mark %s dropped: %s", entry.successor, e)


__all__ = ["ATTEMPTS", "CANCELLED", "DROPPED", "PARK_AFTER_S", "PARK_VAR", "PIN_S", "RETRY_S", "SUFFIX", "Cancelled", "Gone", "Parked", "ParkedStarts", "Pinner", "Pins",
           "admitted_parked", "may_park", "stopped_soon", "park_after_s", "successor_id"]
