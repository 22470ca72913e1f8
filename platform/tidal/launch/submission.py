"""What one submission is made of, apart from the Jobs API calls (launch/jobs.py): the package of
its working directory, its own per submission, and how a job that never started reads."""

from __future__ import annotations

import os
import secrets
import sys
import zipfile
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from tidal.ray_private import walk_working_dir
from tidal.redact import redact_text

# Where a job tracks and stores is the cluster's to say; the submitter's own settings travel
# with the job when set, as Ray's and MLflow's users expect of their environment.
FORWARDED_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "TIDAL_STORAGE")
# In every package `submit` uploads: a value of its own per submission (see package_working_dir).
SUBMISSION_MARKER = ".tidal-submission"
# The Jobs API's error types for a job whose entrypoint ran (and failed on its own): its output says why.
ENTRYPOINT_ERRORS = {"JOB_ENTRYPOINT_COMMAND_ERROR"}


class JobState(str):
    """A submitted job's state: equal to its name ('FAILED'...), so it compares as a string does.
    `reason` is the Jobs API's message, redacted, when the job failed before its entrypoint ran
    (its runtime environment or its supervisor failed: the job printed nothing), else None."""

    reason: str | None

    def __new__(cls, state: str, reason: str | None = None) -> JobState:
        obj = super().__new__(cls, state)
        obj.reason = reason
        return obj

    def __repr__(self) -> str:
        return f"JobState({str(self)!r}, reason={self.reason!r})" if self.reason else repr(str(self))


def start_failure(state: str, error_type: Any, message: str | None) -> str | None:
    """Why a job failed before its entrypoint ran (Ray's message, redacted: it quotes the runtime
    env), or None for any other job: one whose entrypoint ran says why in its own output."""
    kind = getattr(error_type, "value", error_type)
    if state != "FAILED" or not kind or kind in ENTRYPOINT_ERRORS:
        return None
    return redact_text((message or str(kind)).strip())


def package_working_dir(root: Path, excludes: list[str], dest: Path) -> Path:
    """`root` zipped as Ray zips a working_dir (its own walk: .gitignore, .rayignore, `excludes`),
    plus SUBMISSION_MARKER holding a random value, so that the package's name (Ray names an
    uploaded package by the hash of its bytes) is this submission's own.

    Why (ray#36703, #46625): Ray does not upload an unchanged working_dir again when the GCS says
    it holds its package, and the GCS deletes a package once no job references it; a job submitted
    from a folder as another job from that folder ends finds its package gone before its runtime
    env is set up, and fails before its entrypoint runs. A package of its own is referenced by this
    job only (and pinned by its upload until the job holds it): no other job's end can delete it.
    Not a retry on that error: the failed submission id is final (the retry would be another job,
    under an id the user was not shown) and could lose the same race; not a check-and-upload: the
    check is Ray's own, and the package can go between check and setup. The cost: one upload per
    submission (Ray's limit keeps it under 100 MiB), freed when the job ends.
    """
    path = dest / "working_dir.zip"
    with zipfile.ZipFile(path, "w", strict_timestamps=False) as z:

        def add(p: Path) -> None:  # files and empty folders, as Ray's own packaging does
            if p.is_file() or (p.is_dir() and next(p.iterdir(), None) is None):
                z.write(p, p.relative_to(root))

        walk_working_dir(root, excludes, add)
        z.writestr(SUBMISSION_MARKER, secrets.token_hex(16) + "\n")
    return path


def forwarded_env(environ: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """The laptop's storage and tracking settings that mean the same on the cluster: a relative path,
    a local SQLite file or a loopback server would name a place on the head, not this laptop's."""
    out, skipped = {}, []
    for key in FORWARDED_ENV:
        value = environ.get(key, "")
        if not value:
            continue
        host = urlparse(value).hostname if "://" in value else None
        local = ("://" not in value and not os.path.isabs(value)) or value.startswith("sqlite:") or (
            host in ("localhost", "127.0.0.1", "::1", "0.0.0.0"))
        if key == "MLFLOW_EXPERIMENT_NAME" or not local:
            out[key] = value
        else:
            skipped.append(f"{key}={redact_text(value)}")  # printed by the SDK too, where no stream redacts
    if skipped:
        print(f"note: not sent to the cluster, as they name places on this machine: {', '.join(skipped)}; "
              "the cluster's own settings apply", file=sys.stderr)
    return out
