"""A read-only pyarrow filesystem over files already in this process's memory.

A by-range resize (tidal.worker.checkpoint.repartition) reads a checkpoint through a pyarrow
filesystem: whole files into the node's cache, byte ranges into sparse copies. The memory tier's
snapshot arrives as buffers from the keepers (zero-copy views of Ray's object store), so serving
them through `pyarrow.fs.PyFileSystem` lets that reader take its ranges straight from memory.

Why by hand: pyarrow has no public in-memory filesystem (its mock one is private); `PyFileSystem`
with a `FileSystemHandler` is its public way to add one. Only what a reader calls is here; every
write is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs


def filesystem(files: Mapping[str, Any]) -> pafs.FileSystem:
    """`files` (path -> a bytes-like buffer) as a read-only filesystem; folders are implied by the paths."""
    return pafs.PyFileSystem(HeldFiles(files))


class HeldFiles(pafs.FileSystemHandler):
    def __init__(self, files: Mapping[str, Any]) -> None:
        self.files = {p.strip("/"): pa.py_buffer(b) for p, b in files.items()}
        self.dirs = {"/".join(p.split("/")[:i]) for p in self.files for i in range(1, p.count("/") + 1)}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HeldFiles) and other.files is self.files

    def __ne__(self, other: object) -> bool:
        return not self == other

    def get_type_name(self) -> str:
        return "tidal-held"

    def normalize_path(self, path: str) -> str:
        return path

    def _info(self, path: str) -> pafs.FileInfo:
        p = path.strip("/")
        if p in self.files:
            return pafs.FileInfo(path, pafs.FileType.File, size=self.files[p].size)
        if p in self.dirs or not p:
            return pafs.FileInfo(path, pafs.FileType.Directory)
        return pafs.FileInfo(path, pafs.FileType.NotFound)

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        return [self._info(p) for p in paths]

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        base = selector.base_dir.strip("/")
        if base and base not in self.dirs:
            if selector.allow_not_found:
                return []
            raise FileNotFoundError(selector.base_dir)
        prefix = f"{base}/" if base else ""
        below = [p for p in (*self.files, *self.dirs) if p.startswith(prefix) and p != base]
        if not selector.recursive:
            below = [p for p in below if "/" not in p[len(prefix):]]
        return [self._info(p) for p in sorted(below)]

    def _buffer(self, path: str) -> pa.Buffer:
        try:
            return self.files[path.strip("/")]
        except KeyError:
            raise FileNotFoundError(path) from None

    def open_input_stream(self, path: str) -> pa.NativeFile:
        return pa.BufferReader(self._buffer(path))

    def open_input_file(self, path: str) -> pa.NativeFile:
        return pa.BufferReader(self._buffer(path))

    def _read_only(self, *args: Any, **kwargs: Any) -> Any:
        raise OSError("a snapshot held in memory is read-only")

    create_dir = delete_dir = delete_dir_contents = delete_root_dir_contents = _read_only
    delete_file = move = copy_file = open_output_stream = open_append_stream = _read_only
