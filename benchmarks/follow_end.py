"""How long `tidal submit` (Job.follow) keeps following after the job has ended, against Ray's own log stream.

    python -m benchmarks.follow_end [--pairs 4]     # writes a section of docs/benchmarks.md

One token-auth Ray head on this machine. Each round submits two jobs whose entrypoint prints one
line and exits, and follows each to its end, in alternating order:
- ray: iterates Ray's `JobSubmissionClient.tail_job_logs` until Ray closes the stream (what
  `ray job logs --follow` does, and `Job.follow` did before);
- tidal: `Job.follow()`, which asks a quiet stream's job for its status and, once it has ended,
  reads the rest of the logs at once (tidal/launch/jobs.py).
The figure: seconds from the job's end (the Jobs API's end time) to the follower's return.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from benchmarks.common import median, paired_rounds, pairs_main
from tidal.launch.jobs import Job, connect
from tidal.testing.heads import ray_head

SECTION = "Following a job to its end: Tidal's follow against Ray's log stream"
ENTRYPOINT = "python -c \"print('one line', flush=True)\""


def ray_stream(client: Any, sid: str) -> str:
    async def read() -> str:
        return "".join([chunk async for chunk in client.tail_job_logs(sid)])

    return asyncio.run(read())


def one(client: Any, address: str, kind: str) -> float:
    """Seconds from the job's end to the follower's return."""
    sid = client.submit_job(entrypoint=ENTRYPOINT)
    text = ray_stream(client, sid) if kind == "ray" else "".join(Job(sid, address).follow())
    returned = time.time()
    if "one line" not in text:
        raise RuntimeError(f"{kind}: the job's line was not followed: {text[-2000:]!r}")
    return returned - client.get_job_info(sid).end_time / 1000


def run(pairs: int, tmp: Path) -> list[dict[str, float]]:
    (tmp / "head").mkdir()
    with ray_head(tmp / "head", 2, {}) as head:
        client = connect(head.address)
        one(client, head.address, "tidal")  # the head's first job starts its agent's job machinery: not timed
        return paired_rounds(pairs, ("ray", "tidal"), lambda i, kind: one(client, head.address, kind), lambda r: {},
                             lambda i, r: f"round {i + 1}: Ray's stream {r['ray']:.2f} s after the end, Tidal's follow "
                             f"{r['tidal']:.2f} s")


def report(rounds: list[dict[str, float]], pairs: int) -> str:
    rows = "\n".join(f"| {i + 1} | {r['ray']:.2f} s | {r['tidal']:.2f} s | {r['ray'] - r['tidal']:+.2f} s |"
                     for i, r in enumerate(rounds))
    return f"""Command: `python -m benchmarks.follow_end --pairs {pairs}` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, CPU only)

Work: one token-auth Ray head; each round submits two jobs that print one line and exit, and follows one
with Ray's own log stream (`tail_job_logs`, to its close) and one with Tidal's `Job.follow()` (what
`tidal submit` runs), the order alternating by round. Seconds from the job's end (the Jobs API's end time)
to the follower's return.

| round | Ray's stream | Tidal's follow | saved |
|---|---|---|---|
{rows}

Medians: Ray's stream **{median([r['ray'] for r in rounds]):.2f} s** after the job's end, Tidal's follow
**{median([r['tidal'] for r in rounds]):.2f} s**.
"""


def main() -> None:
    pairs_main(__doc__, SECTION, "tidal-follow-", run, report)


if __name__ == "__main__":
    main()
