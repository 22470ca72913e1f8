"""Submitting to Ray's Jobs API through a head's passing refusals: a head whose job agent has not
registered yet answers `500: No available agent to submit job, please try again later` (Ray's own
advice), and a busy dashboard can drop the connection. Every face that submits (`tidal submit`,
the SDK, `tidal queue`'s view job, the test heads' warm-up) tries again here, for a bounded time.

Why by hand: Ray's JobSubmissionClient raises on the first refusal and has no retry of its own."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

# Ray's Jobs API before the head's node agent is up (Ray 2.60's message), and how long a submission
# tries again through that or dropped connections.
NO_AGENT = "No available agent to submit job"
AGENT_WAIT_S = 120


def submit_accepted(client: Any, wait_s: float, say: Callable[[str], None] | None = None, **job: Any) -> None:
    """`client.submit_job(**job)` (a `submission_id` among them), tried again with a growing pause
    (1, 2, 4, then 8 s) for up to `wait_s` while `retry_submission` says nothing was accepted,
    saying so once; Ray's error otherwise. A retry told that the id already exists had its
    earlier attempt accepted (its answer was lost)."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    deadline, tried, pause = time.time() + wait_s, False, 1.0
    while True:
        try:
            client.submit_job(**job)
            return
        except Exception as e:
            if tried and "already exists" in str(e):
                return
            if not (retry_submission(str(e)) and time.time() < deadline):
                raise
            if not tried:
                why = "the head is still starting (its job agent is not up yet)" if NO_AGENT in str(e) \
                    else "the head's dashboard dropped the connection"
                say(f"[tidal] {why}: trying the submission again for up to {wait_s:.0f}s")
            tried = True
            _pause(min(pause, max(0.0, deadline - time.time())))
            pause = min(pause * 2, 8.0)


def _pause(seconds: float) -> None:
    time.sleep(seconds)


def retry_submission(error: str) -> bool:
    """Whether a failed submit_job may be tried again: a head whose node agent has not registered
    yet (Ray says to try again; nothing was accepted), or a connection a busy dashboard dropped
    (the same submission id then tells whether it was accepted)."""
    return any(s in error for s in (NO_AGENT, "Connection aborted", "RemoteDisconnected", "Connection reset"))
