"""A submitted job's output as it comes: Ray's log stream, and polling where it cannot stream.

`Job.follow` (tidal/launch/jobs.py) streams first and polls from where the stream stopped: in a
running event loop (a Jupyter kernel), after a stream that broke off, or once the job has ended
while Ray still holds its stream open.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Generator, Iterator
from typing import Any

from tidal.launch.chain import TERMINAL


def stream(client: Any, submission_id: str, poll_s: float) -> Generator[str, None, int | None]:
    """Stream the logs; returns None when the stream ended with the job, else how many characters
    were yielded: the rest is polled. Ray 2.60 closes the stream about 5 s after a job ended
    (`tidal submit` waited that long at the end of every job: benchmarks/follow_end.py), so the
    job of a quiet stream is asked for its status every `poll_s`; once it has ended, the rest is
    read at once. Needs an asyncio loop of its own: not inside a running one."""
    seen = 0
    loop, tail, ahead = asyncio.new_event_loop(), None, None
    try:
        tail = client.tail_job_logs(submission_id)
        while True:
            ahead = ahead or loop.create_task(tail.__anext__())
            loop.run_until_complete(asyncio.wait({ahead}, timeout=poll_s))
            if not ahead.done():
                if str(client.get_job_status(submission_id).value) in TERMINAL:
                    return seen
                continue
            chunk, ahead = ahead.result(), None
            seen += len(chunk)
            yield chunk
    except StopAsyncIteration:  # the server closed the stream: the job ended
        return None
    except Exception:  # noqa: BLE001 - no websocket (a proxy, an old server): poll from where the stream stopped
        return seen
    finally:
        with contextlib.suppress(Exception):
            if ahead is not None and not ahead.done():
                ahead.cancel()
                loop.run_until_complete(asyncio.wait({ahead}))
            if tail is not None:
                loop.run_until_complete(tail.aclose())
        loop.close()


def poll(client: Any, submission_id: str, poll_s: float, seen: int) -> Iterator[str]:
    """The logs past the first `seen` characters, read every `poll_s` until the job has ended."""
    while True:
        state = str(client.get_job_status(submission_id).value)  # before the logs: none missed
        text = client.get_job_logs(submission_id)
        if len(text) > seen:
            yield text[seen:]
            seen = len(text)
        if state in TERMINAL:
            return
        time.sleep(poll_s)
