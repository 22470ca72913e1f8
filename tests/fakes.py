"""Stand-ins that several test files share (a test file never imports another): a pickle that runs
code when it is loaded, and a pyarrow filesystem that counts the requests made through it."""

from __future__ import annotations

import os
import pickle
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs


class RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def evil(marker: Path, size: int = 0) -> bytes:
    data = pickle.dumps({"param": RunsCode(marker)})
    return data + b"\0" * max(0, size - len(data))


class Counting(pafs.FileSystemHandler):
    """A local filesystem that counts requests by kind (each path of a batched info is one)."""

    def __init__(self) -> None:
        self.inner, self.calls = pafs.LocalFileSystem(), Counter()

    def get_type_name(self) -> str:
        return "counting"

    def normalize_path(self, path: str) -> str:
        return path

    def equals(self, other: Any) -> bool:
        return self is other

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        self.calls["info"] += len(paths)
        return self.inner.get_file_info(paths)

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        self.calls["list"] += 1
        return self.inner.get_file_info(selector)

    def open_input_stream(self, path: str) -> Any:
        self.calls["read"] += 1
        return self.inner.open_input_stream(path)

    def open_input_file(self, path: str) -> Any:
        self.calls["read"] += 1
        return self.inner.open_input_file(path)

    def create_dir(self, path: str, recursive: bool) -> None:
        self.inner.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        self.inner.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self.inner.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        raise OSError("not here")

    def delete_file(self, path: str) -> None:
        self.inner.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        self.inner.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        self.inner.copy_file(src, dest)

    def open_output_stream(self, path: str, metadata: Any = None) -> Any:
        return self.inner.open_output_stream(path)

    def open_append_stream(self, path: str, metadata: Any = None) -> Any:
        return self.inner.open_append_stream(path)
