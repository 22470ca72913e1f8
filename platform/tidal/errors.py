"""User-facing errors: printed as plain messages by the CLI, with a traceback only under TIDAL_DEBUG=1."""

from __future__ import annotations

from tidal.redact import redact_text


class TidalError(Exception):
    """An error caused by input or environment the user can fix; its message says how. Shown
    redacted (tidal/redact.py): a message quoting a URI or a variable never shows a credential."""

    def __str__(self) -> str:
        return redact_text(super().__str__())


class SpecError(TidalError):
    """A job spec that cannot be run. `problems` holds one (field path, message) pair per problem."""

    def __init__(self, problems: list[tuple[str, str]], source: str | None = None) -> None:
        self.problems = problems
        self.source = source
        where = f" in {source}" if source else ""
        lines = [f"invalid job spec{where}: {len(problems)} problem(s)"]
        lines += [f"  {path or '<spec>'}: {msg}" for path, msg in problems]
        super().__init__("\n".join(lines))


class UserCodeError(SpecError):
    """The user's own code (a `module:function` the spec names), or what it returned, failed on a
    worker. `frames`: the traceback's frames in the user's files, formatted (none when the call
    itself failed: its arguments); `first_step`: it failed before the worker's first step returned a
    loss, so a restart would run the same code on the same inputs and fail the same way: the job is
    not restarted (tidal/launch/recovery.py). One line as a string: Ray Train logs a worker's
    error as its traceback, whose last line is then this error's (tidal/tracking/quiet.py reads it)."""

    def __init__(self, field: str, message: str, frames: str = "", first_step: bool = True) -> None:
        super().__init__([(field, message)])
        self.field, self.message, self.frames, self.first_step = field, message, frames, first_step

    def __str__(self) -> str:
        return redact_text(f"{self.field}: {' '.join(self.message.split())}")

    def __reduce__(self) -> tuple[type, tuple[str, str, str, bool]]:  # carried from a worker to the controller
        return (type(self), (self.field, self.message, self.frames, self.first_step))


class UsageError(TidalError):
    """A command line that cannot work as given (the CLI exits 2, as argparse does)."""


class CheckpointError(TidalError):
    """A checkpoint that cannot be resumed from (changed model, unsupported resize...)."""


class ClusterError(TidalError):
    """The Ray cluster cannot be reached or refused the request."""


class JobAlreadyRunning(TidalError):
    """A second start of a job whose driver is alive (tidal/lease.py): nothing was started or written."""
