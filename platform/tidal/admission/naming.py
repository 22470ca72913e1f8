"""How a job and its tools name the cluster's admission: the actor, the job's key in the queue,
whether the cluster runs admission, and where its queue document lives (no Ray needed)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping

from tidal.admission.queue_doc import queue_location
from tidal.admission.quotas import QUOTAS_VAR
from tidal.lease import submission_id

ACTOR = "tidal-admission"
NAMESPACE = "tidal"
QUEUE_VAR = "TIDAL_QUEUE"  # where the queue document lives, if not under TIDAL_STORAGE
# Set by admission's relaunch after a head restart: the relaunched driver takes its job's place
# (its key, state and size) under a new Ray submission id.
QUEUE_JOB_VAR = "TIDAL_QUEUE_JOB"


def job_key(name: str, environ: Mapping[str, str] | None = None, storage: str = "") -> str:
    """A job's id in the queue: the id its relaunch after a head restart names (QUEUE_JOB_VAR),
    else its Ray Jobs submission id when submitted (Ray's job supervisor passes it to the driver
    in the job config's metadata), else its name with a digest of its storage: a job is its name
    under its storage, so two jobs of one name on two storages (a `tidal run` each) never share
    one seat, while a second start of the same job is the lease's to refuse."""
    env = os.environ if environ is None else environ
    if key := env.get(QUEUE_JOB_VAR) or submission_id(env):
        return key
    if not storage:
        return name
    return f"{name}:{hashlib.sha256(storage.rstrip('/').encode()).hexdigest()[:8]}"


def admission_enabled(environ: Mapping[str, str]) -> bool:
    """Admission runs where the cluster names a quota file (the cluster's environment contract)."""
    return bool(environ.get(QUOTAS_VAR))


def queue_named(environ: Mapping[str, str]) -> bool:
    """Whether `environ` names the cluster's queue document (a machine off the head reads it only then)."""
    return bool(environ.get(QUEUE_VAR) or environ.get("TIDAL_STORAGE"))


def queue_document(environ: Mapping[str, str]) -> str:
    """TIDAL_QUEUE, else under the cluster's storage root, else on the head's disk."""
    if environ.get(QUEUE_VAR):
        return environ[QUEUE_VAR]
    if environ.get("TIDAL_STORAGE"):
        return queue_location(environ["TIDAL_STORAGE"])
    return os.path.expanduser("~/.tidal/queue.json")
