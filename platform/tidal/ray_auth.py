"""The Ray cluster token, found the way Ray 2.60 finds it, and the header that carries it.

Ray's own Jobs client sends the token only when RAY_AUTH_MODE=token is set in the caller's
environment; Tidal's callers (the CLI, the SDK, the admission actor relaunching jobs after a head
restart) always send it when one is found, so a laptop or a worker need not set the mode too.
"""

from __future__ import annotations

import os
from pathlib import Path


def auth_token() -> str | None:
    """RAY_AUTH_TOKEN, else the file in RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token; None if none."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
    try:
        return Path(path).read_text().strip() or None
    except OSError:
        return None


def auth_headers(token: str | None) -> dict[str, str] | None:
    """The bearer header for the Jobs API, or None without a token."""
    return {"Authorization": f"Bearer {token}"} if token else None


__all__ = ["auth_headers", "auth_token"]
