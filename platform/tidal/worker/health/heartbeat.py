"""A silent rank found in seconds: every rank beats from a side thread, and watches one peer's beat.

The step deadline (worker/health/watchdog.py) must allow for the job's slowest step, so a stopped
rank took 30 s to find at its floor. A heartbeat needs no such margin: it comes from a thread of its
own, which a slow step does not stop (a collective, a save or a long kernel releases the GIL) and
a stopped process (SIGSTOP, a frozen VM) or one wedged holding the GIL does. Each rank adds one to
its counter in the group's rendezvous store (the c10d TCPStore torch's process group already runs
in rank 0's process, reached as a client at MASTER_ADDR:MASTER_PORT) once a second, and reads the
counter of the next rank (a ring: one read per rank, at any world size). A counter unchanged for
`failure.heartbeat_timeout_s` names its rank silent; so does a store that stops answering within
that time (its host, rank 0, is stopped). A store whose connection fails at once has lost its host
for good (a killed process): that is no hang, Ray Train restarts the group for it.

A rank that finds one silent raises the store's `hang` flag before declaring the hang (the court,
worker/health/hang.py), so that every other live rank answers it at its next beat instead of when
its own step deadline is half gone. Nothing is judged before the watching rank's first finished step
(the group's start), nor from a peer that never beat, nor after training ended.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

BEAT_S = 1.0  # how often a rank beats and reads its peer's counter
HOST = 0  # the rank whose process runs the store


@dataclass(frozen=True)
class Seen:
    """The last counter read of a rank, and when (monotonic) it last changed."""

    count: int
    changed: float


def watched(rank: int, world: int) -> int:
    """The rank this one watches: the next, round the ring."""
    return (rank + 1) % world


def silent(seen: Mapping[int, Seen], last_reply: float | None, now: float, deadline_s: float,
           rank: int) -> list[int]:
    """The ranks found silent at `now` (pure). `seen`: the watched ranks' counters; a rank that never
    beat (count 0) is not judged. `last_reply`: when the store last answered this rank (None: it
    has not yet); a store silent for the deadline is its host's silence, unless this rank is the host."""
    out = sorted(r for r, s in seen.items() if s.count > 0 and now - s.changed > deadline_s)
    if rank != HOST and last_reply is not None and now - last_reply > deadline_s and HOST not in out:
        out.insert(0, HOST)
    return out


def group_store(deadline_s: float) -> Any:
    """A client of the group's rendezvous store (torch's, hosted in rank 0's process), its replies
    awaited at most `deadline_s`."""
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=deadline_s), wait_for_workers=False)
    return dist.PrefixStore(f"tidal-pulse-{os.environ['MASTER_PORT']}", store)


class Pulse:
    """One per rank: its beat, its watch over one peer, and the group's hang flag."""

    def __init__(self, rank: int, world: int, deadline_s: float, store: Callable[[], Any] | None = None,
                 beat_s: float = BEAT_S) -> None:
        self.rank, self.world, self.deadline_s, self.beat_s = rank, world, deadline_s, beat_s
        self.peer = watched(rank, world)
        self.seen: dict[int, Seen] = {}
        self.last_reply: float | None = None
        self.flagged = False  # another rank raised the hang flag
        self.gone = False  # the store's host is gone for good (a dead process: Ray's fault, not a hang)
        self.watching = True
        self._flag = False  # set by announce(), raised in the store by the beating thread
        self._store = store or (lambda: group_store(deadline_s))
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="tidal-heartbeat", daemon=True).start()

    def silent(self) -> list[int]:
        """The ranks silent now; none once training ended or the store's host is gone."""
        if not self.watching or self.gone:
            return []
        return silent(dict(self.seen), self.last_reply, time.monotonic(), self.deadline_s, self.rank)

    def declared(self) -> bool:
        """Whether another rank found one silent and is declaring a hang."""
        return self.flagged and self.watching

    def announce(self) -> None:
        """Raise the group's hang flag: every live rank answers the declaration at its next beat."""
        self._flag = True

    def end(self) -> None:
        """Training ended on this rank: judge no one (the others' processes may end first); the beat goes on."""
        self.watching = False

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        try:
            store = self._store()
        except Exception:  # noqa: BLE001 - no store, no heartbeat: the step deadline still guards the group
            self.gone = True
            return
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                if self._flag:
                    store.set("hang", "1")
                store.add(f"beat-{self.rank}", 1)
                count = store.add(f"beat-{self.peer}", 0)
                flagged = store.check(["hang"])
            except Exception:  # noqa: BLE001 - a timeout is the host's silence; a fast failure, its death
                if time.monotonic() - t0 < self.deadline_s / 2:
                    self.gone = True
                    return
                continue
            now = time.monotonic()
            self.last_reply, self.flagged = now, bool(flagged)
            before = self.seen.get(self.peer)
            if before is None or before.count != count:
                self.seen[self.peer] = Seen(int(count), now)
            self._stop.wait(self.beat_s)
