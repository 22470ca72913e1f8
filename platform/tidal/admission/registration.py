"""A driver's registration with the cluster's admission, checked as untrusted input.

The actor takes from a caller only what it cannot know itself (the job's key, name, team,
priority, sizes, each worker's resources and the driver's Ray Jobs submission id) and checks
each; it computes the slots a worker takes and the submission time itself. A driver proves it holds a job's seat with a random token
of its own; the queue document keeps only the token's digest.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

from tidal.admission.queue_doc import JOB_KEY, is_submission_id
from tidal.admission.quotas import Quotas, resolve_scheduling
from tidal.errors import TidalError


def holder_digest(token: str) -> str:
    """What the document keeps of a driver's token: enough to check it, useless to reuse."""
    return hashlib.sha256(token.encode()).hexdigest()[:32] if token else ""


def checked_registration(reg: Any, quotas: Quotas) -> dict[str, Any]:
    """A driver's registration, checked as untrusted input: names, sizes and resources; the
    team and priority resolved against the quota file. The slots a worker takes are computed
    here from its resources, never taken from the caller."""
    if not isinstance(reg, Mapping):
        raise TidalError("a registration is a mapping")
    job, name = reg.get("job"), reg.get("name")
    if not isinstance(job, str) or not re.match(JOB_KEY, job) or not isinstance(name, str):
        raise TidalError(f"job key {job!r:.80} is not usable: letters, digits, '.', '_', ':' or '-'")
    counts = {k: reg.get(k) for k in ("min_workers", "max_workers")}
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in counts.values()) \
            or counts["max_workers"] < counts["min_workers"]:
        raise TidalError(f"job {job!r}: scaling.min_workers and max_workers must be whole numbers, 1 <= min <= max")
    shape = {k: reg.get(k, 0) for k in ("cpus_per_worker", "gpus_per_worker")}
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 for v in shape.values()):
        raise TidalError(f"job {job!r}: cpus_per_worker and gpus_per_worker must be numbers >= 0")
    team, priority = resolve_scheduling(reg.get("team"), reg.get("priority"), quotas)
    running_workers = reg.get("running_workers", 0)
    token, submission = reg.get("token", ""), reg.get("submission", "")
    if submission and not is_submission_id(submission):
        raise TidalError(f"job {job!r}: submission {submission!r:.80} is not a Ray Jobs submission id")
    return {"job": job, "name": name[:100], "team": team, "priority": priority, **counts,
            "slots_per_worker": quotas.slots_per_worker(shape["cpus_per_worker"], shape["gpus_per_worker"]),
            "running_workers": running_workers if isinstance(running_workers, int) and running_workers > 0 else 0,
            "holder": holder_digest(token if isinstance(token, str) else ""), "submission": submission or ""}


__all__ = ["checked_registration", "holder_digest"]
