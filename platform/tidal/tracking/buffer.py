"""The job's durable event log: metric points and notes not yet handled, on the job's own storage.

It lives in the run folder (local path, shared filesystem or object store alike) so that no
process that dies, on any node, loses a point: rank 0 writes each event here itself, and the
tracker (which sends to MLflow and prints) reads them back, whichever life of it is running.
One small object per entry, because an object store cannot append: adding an event is one
write, forgetting handled ones is one delete each, and nothing is ever rewritten in place.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Collection
from typing import Any

import pyarrow.fs as pafs

from tidal import fs

BUFFER_DIR = "tidal-mlflow-buffer"
FIELDS = {"step", "values", "ts", "id"}


class MetricsBuffer:
    """Entries `{"step", "values", "ts", "kind"?, ...}` kept at `<run folder>/tidal-mlflow-buffer/`."""

    def __init__(self, filesystem: pafs.FileSystem, run_path: str) -> None:
        self.fs, self.path = filesystem, f"{run_path}/{BUFFER_DIR}"

    def append(self, entry: dict[str, Any]) -> dict[str, Any]:
        """Store `entry` durably; returns it with the `id` that `forget` takes."""
        # Names sort by step (a recovered buffer is sent in training order), then by write time.
        entry = {"values": {}, **entry,
                 "id": f"{int(entry['step']):012d}-{time.time_ns():020d}-{uuid.uuid4().hex[:8]}"}
        fs.write_json(self.fs, f"{self.path}/{entry['id']}.json", entry)
        return entry

    def load(self, known: Collection[str] = ()) -> list[dict[str, Any]]:
        """Every entry still buffered whose id is not in `known`, oldest step first (unreadable
        leftovers, e.g. a write cut short on a local disk, are skipped)."""
        entries = []
        for info in sorted(fs.list_dir(self.fs, self.path), key=lambda i: i.base_name):
            if info.type != pafs.FileType.File or not info.base_name.endswith(".json"):
                continue
            if info.base_name[:-5] in known:
                continue
            entry = fs.read_json(self.fs, info.path)
            if isinstance(entry, dict) and entry.keys() >= FIELDS:
                entries.append(entry)
        return entries

    def forget(self, entries: list[dict[str, Any]]) -> None:
        """Delete entries that are handled (sent to MLflow, printed, or known to be duplicates)."""
        for e in entries:
            with contextlib.suppress(FileNotFoundError):
                self.fs.delete_file(f"{self.path}/{e['id']}.json")
