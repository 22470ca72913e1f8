"""Work that holds the GIL for long on purpose, said beforehand to whatever watches this process.

A rank's heartbeat (worker/health/heartbeat.py) beats from a side thread, which a process holding
the GIL stops as surely as a SIGSTOP. Serialising a large state into memory does hold it
(`torch.save` into a buffer: about 0.35 s per 512 MB, seconds for a large model's partition), and
the code that does it (the memory tier, worker/checkpoint/memory.py) sits below the heartbeat's
layer. So it says so here (`holding`), and the heartbeat, when one runs, listens (`listen`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol


class Listener(Protocol):
    def busy(self, delta: int, wait_s: float) -> None:
        """A section opens (+1, said before it starts: wait at most `wait_s`) or closes (-1)."""


_listener: Listener | None = None


def listen(listener: Listener | None) -> None:
    """`listener` hears of every section of this process from now on (None: nobody)."""
    global _listener
    _listener = listener


def current() -> Listener | None:
    return _listener


@contextlib.contextmanager
def holding(wait_s: float = 2.0) -> Iterator[None]:
    """Around work that holds the GIL for long: the listener is told first (waiting at most `wait_s`
    until it has passed it on) and again after; a no-op with no listener."""
    listener = _listener
    if listener is None:
        yield
        return
    listener.busy(+1, wait_s)
    try:
        yield
    finally:
        listener.busy(-1, 0.0)
