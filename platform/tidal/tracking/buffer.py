"""The durable buffer of metric points not yet in MLflow, on the job's own storage.

It lives in the run folder (local path, shared filesystem or object store alike) so that a
driver that dies, on any node, loses no point: the next driver finds what was never sent.
One small object per entry, because an object store cannot append: adding a point is one
write, forgetting sent points is one delete each, and nothing is ever rewritten in place.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any

import pyarrow.fs as pafs

from tidal import fs

BUFFER_DIR = "tidal-mlflow-buffer"


class MetricsBuffer:
    """Entries `{"step", "values", "ts"}` kept at `<run folder>/tidal-mlflow-buffer/`."""

    def __init__(self, filesystem: pafs.FileSystem, run_path: str) -> None:
        self.fs, self.path = filesystem, f"{run_path}/{BUFFER_DIR}"

    def append(self, entry: dict[str, Any]) -> dict[str, Any]:
        """Store `entry` durably; returns it with the `id` that `forget` takes."""
        # Names sort by step, so a recovered buffer is sent in training order.
        entry = {**entry, "id": f"{int(entry['step']):012d}-{uuid.uuid4().hex[:12]}"}
        fs.write_json(self.fs, f"{self.path}/{entry['id']}.json", entry)
        return entry

    def load(self) -> list[dict[str, Any]]:
        """Every entry still buffered, oldest step first (unreadable leftovers are skipped)."""
        entries = []
        for info in sorted(fs.list_dir(self.fs, self.path), key=lambda i: i.base_name):
            if info.type == pafs.FileType.File and info.base_name.endswith(".json"):
                entry = fs.read_json(self.fs, info.path)
                if isinstance(entry, dict) and {"step", "values", "ts", "id"} <= entry.keys():
                    entries.append(entry)
        return entries

    def forget(self, entries: list[dict[str, Any]]) -> None:
        """Delete entries MLflow now holds."""
        for e in entries:
            with contextlib.suppress(FileNotFoundError):
                self.fs.delete_file(f"{self.path}/{e['id']}.json")
