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


class UsageError(TidalError):
    """A command line that cannot work as given (the CLI exits 2, as argparse does)."""


class CheckpointError(TidalError):
    """A checkpoint that cannot be resumed from (changed model, unsupported resize...)."""


class ClusterError(TidalError):
    """The Ray cluster cannot be reached or refused the request."""


class JobAlreadyRunning(TidalError):
    """A second start of a job whose driver is alive (tidal/lease.py): nothing was started or written."""
