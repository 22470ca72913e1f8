"""Where a job's data comes from: the check shared by `data.source` and `eval.source` (its own
module so that neither `consistency` nor `evaluation` imports the other)."""

from __future__ import annotations

import os
from pathlib import Path

DATA_SUFFIXES = (".txt", ".jsonl", ".parquet")


def source_problem(src: str) -> str | None:
    """What is wrong with a data source ('synthetic', a file or a URI), or None."""
    if src == "synthetic" or "://" in src:
        return None
    if not src.endswith(DATA_SUFFIXES):
        return f"{src!r}: use 'synthetic' or a file ending in {', '.join(DATA_SUFFIXES)}"
    if not Path(src).is_file():
        return f"file not found: {src} (relative paths are read from {os.getcwd()})"
    return None
