"""A silent rank found in seconds: every rank beats from a side thread, and watches one peer's beat.

The step deadline (worker/health/watchdog.py) must allow for the job's slowest step, so a stopped
rank took 30 s to find at its floor. A heartbeat needs no such margin: it comes from a thread of its
own, which a slow step does not stop (a collective, a save or a long kernel releases the GIL) and
a stopped process (SIGSTOP, a frozen VM) or one wedged holding the GIL does. Each rank adds one to
its counter in the group's rendezvous store (the c10d TCPStore torch's process group already runs
in rank 0's process, reached as a client at MASTER_ADDR:MASTER_PORT; with failure.replace_in_place,
the rendezvous actor's, which no rank's loss takes down: worker/health/rendezvous.py) once a second, and reads the
counter of the next rank (a ring: one read per rank, at any world size). A counter unchanged for
`failure.heartbeat_timeout_s` names its rank silent; so does a store that stops answering within
that time (its host, rank 0, is stopped). A store whose connection fails at once has lost its host
for good (a killed process): that is no hang, Ray Train restarts the group for it.

What a healthy process can do that looks like silence is never judged. A rank whose own process
stalled (a long GC pass, a long C call holding the GIL) cannot tell what its peer did meanwhile:
its clock for the peer restarts at its next read, and it judges nothing until that read (found in
review: a 2.3 s hold in the watching process named a healthy peer). A rank about to hold the GIL on
purpose for long (the memory tier's serialisation of a large state: about 0.35 s per 512 MB) says
so first (tidal/gil.py): its watcher does not judge it meanwhile, and gives it a whole deadline after.
The store's host is named once a call to it has waited the whole deadline (a stopped host never
answers); the asking thread's own stall is seen too, and it judges nothing then.

A silence is a hang only once the silent rank's process is seen stopped on its node (`stopped`): under
load a running process's beat went unheard for 5 s (a false hang that ended a healthy job), and a rank
that died with its node was declared hung. Anything else is left to the step deadline.

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

from tidal import gil

BEAT_S = 1.0  # how often a rank beats and reads its peer's counter
HOST = 0  # the rank whose process runs the store
FRESH_BEATS = 2  # a read older than this many beats (and a second) means this rank itself stalled
# failure.replace_in_place: the generation of the group this process is in (worker/health/rendezvous.py
# sets it), which names the group's counters here and its hang folder (worker/health/hang.py)
GENERATION_ENV = "TIDAL_GROUP_GENERATION"


def generation_suffix() -> str:
    """`-gen<N>` in a group formed through the rendezvous (one store for all its generations: each
    names its own keys), "" in a group Ray Train formed (a store of its own)."""
    generation = os.environ.get(GENERATION_ENV)
    return f"-gen{generation}" if generation else ""



def stopped(state: str) -> bool:
    """Whether a silent rank's process, as its node's kernel shows it (stacks.process_state's text),
    is stopped (SIGSTOP, a debugger): the one silence a heartbeat declares a hang. A process that runs
    but whose beat got no CPU (a loaded node), or that is gone (Ray Train sees a death), is not; a rank
    wedged holding the GIL is left to the step deadline, which the other ranks' waits still meet."""
    return state.startswith(("state T", "state t"))


@dataclass(frozen=True)
class Seen:
    """The last counter read of a rank, and when (monotonic) it last changed."""

    count: int
    changed: float


def watched(rank: int, world: int) -> int:
    """The rank this one watches: the next, round the ring."""
    return (rank + 1) % world


def silent(seen: Mapping[int, Seen], last_reply: float | None, calling_since: float | None, now: float,
           deadline_s: float, rank: int, fresh_s: float) -> list[int]:
    """The ranks found silent at `now` (pure). `seen`: the watched ranks' counters; a rank that never
    beat (count 0) is not judged, nor any peer while this rank's own last reply (`last_reply`,
    None: none yet) is older than `fresh_s` (this process stalled: what it saw is stale).
    `calling_since`: when the store call in flight began (None: none); one waiting longer than the
    deadline is its host's silence, unless this rank is the host (a stopped host never answers: the
    call does not time out)."""
    fresh = last_reply is not None and now - last_reply <= fresh_s
    out = sorted(r for r, s in seen.items() if fresh and s.count > 0 and now - s.changed > deadline_s)
    if rank != HOST and calling_since is not None and now - calling_since > deadline_s and HOST not in out:
        out.insert(0, HOST)
    return out


def group_store(deadline_s: float) -> Any:
    """A client of the group's rendezvous store (torch's, hosted in rank 0's process), its replies
    awaited at most `deadline_s`."""
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=deadline_s), wait_for_workers=False)
    return dist.PrefixStore(f"tidal-pulse-{os.environ['MASTER_PORT']}{generation_suffix()}", store)


class Pulse:
    """One per rank: its beat, its watch over one peer, and the group's hang flag."""

    def __init__(self, rank: int, world: int, deadline_s: float, store: Callable[[], Any] | None = None,
                 beat_s: float = BEAT_S) -> None:
        self.rank, self.world, self.deadline_s, self.beat_s = rank, world, deadline_s, beat_s
        self.peer = watched(rank, world)
        self.seen: dict[int, Seen] = {}
        self.last_reply: float | None = None
        self.calling_since: float | None = None  # when the beat's store calls in flight began
        self._looked: float | None = None  # when the watchdog's thread last asked who is silent
        self.fresh_s = FRESH_BEATS * beat_s + 1.0
        self._busy = 0  # gil.holding sections open in this process
        self._published = threading.Event()  # the beat thread said the current `_busy` in the store
        self._busy_lock = threading.Lock()
        self.flagged = False  # another rank raised the hang flag
        self.gone = False  # the store's host is gone for good (a dead process: Ray's fault, not a hang)
        self.watching = True
        self._flag = False  # set by announce(), raised in the store by the beating thread
        self._store = store or (lambda: group_store(deadline_s))
        self._stop = threading.Event()
        self._wake = threading.Event()  # a section opened: say it now, not at the next beat
        threading.Thread(target=self._run, name="tidal-heartbeat", daemon=True).start()
        gil.listen(self)  # sections that hold the GIL on purpose (tidal/gil.py) are said to the watcher

    def silent(self) -> list[int]:
        """The ranks silent now; none once training ended or the store's host is gone."""
        now = time.monotonic()
        looked, self._looked = self._looked, now
        if not self.watching or self.gone:
            return []
        if looked is not None and now - looked > self.fresh_s:
            return []  # the asking thread itself stalled (the GIL held elsewhere): judge at its next look
        return silent(dict(self.seen), self.last_reply, self.calling_since, now, self.deadline_s, self.rank,
                      self.fresh_s)

    def busy(self, delta: int, wait_s: float) -> None:
        """Open (+1) or close (-1) a section that holds the GIL; on opening, wait until it is said."""
        with self._busy_lock:
            self._published.clear()
            self._busy += delta
        self._wake.set()  # the beat thread says it at once: a snapshot waits milliseconds, not a beat
        if wait_s > 0 and not self.gone:
            self._published.wait(wait_s)

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
        self._wake.set()
        if gil.current() is self:
            gil.listen(None)

    def _run(self) -> None:
        try:
            store = self._store()
        except Exception:  # noqa: BLE001 - no store, no heartbeat: the step deadline still guards the group
            self.gone = True
            return
        said = 0  # this rank's open gil.holding sections, as the store has them
        while not self._stop.is_set():
            t0 = self.calling_since = time.monotonic()
            try:
                if self._flag:
                    store.set("hang", "1")
                busy = self._busy
                if busy != said:
                    store.add(f"busy-{self.rank}", busy - said)
                    said = busy
                with self._busy_lock:
                    if self._busy == said:  # not a section opened since the read above: it waits for the next beat
                        self._published.set()
                store.add(f"beat-{self.rank}", 1)
                count = store.add(f"beat-{self.peer}", 0)
                peer_busy = store.add(f"busy-{self.peer}", 0) > 0
                flagged = store.check(["hang"])
            except Exception:  # noqa: BLE001 - a timeout is the host's silence; a fast failure, its death
                if time.monotonic() - t0 < self.deadline_s / 2:
                    self.gone = True
                    self._published.set()
                    return
                continue
            now = time.monotonic()
            # This process stalled since its last reply: the peer's clock restarts (what it did meanwhile is unknown).
            stalled = self.last_reply is not None and now - self.last_reply > self.fresh_s
            self.last_reply, self.flagged, self.calling_since = now, bool(flagged), None
            before = self.seen.get(self.peer)
            if before is None or before.count != count or stalled or peer_busy:
                self.seen[self.peer] = Seen(int(count), now)
            self._wake.wait(self.beat_s)
            self._wake.clear()
