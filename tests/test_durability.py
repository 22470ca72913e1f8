"""write_json on a local filesystem fsyncs the new file before the rename and the directory after.

What fsync protects against (a power loss or kernel crash losing bytes the page cache held) cannot
be produced in a test, so these tests record the fsync calls themselves (os.fsync wrapped, the real
call still made) and check what each one was made on and in which order against the rename."""

from __future__ import annotations

import json
import os

import pyarrow.fs as pafs
import pytest

from tidal import fs


def record_fsyncs(monkeypatch) -> list[tuple[str, bool]]:
    """(path fsynced, whether it is a directory) per call."""
    calls: list[tuple[str, bool]] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        calls.append((path, os.path.isdir(path)))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return calls


def test_write_json_fsyncs_file_then_directory(tmp_path, monkeypatch):
    calls = record_fsyncs(monkeypatch)
    target = tmp_path / "run" / "manifest.json"
    fs.write_json(pafs.LocalFileSystem(), str(target), {"files": {"a": 1}})

    assert json.loads(target.read_text()) == {"files": {"a": 1}}
    assert len(calls) == 2, calls
    (file_path, file_is_dir), (dir_path, dir_is_dir) = calls
    # The file synced is the temporary one (renamed afterwards), so its bytes were on disk before
    # the name pointed at them; then the directory, which holds the rename.
    assert not file_is_dir and os.path.dirname(file_path) == str(target.parent)
    assert os.path.basename(file_path).startswith(".manifest.json.") and not os.path.exists(file_path)
    assert dir_is_dir and dir_path == str(target.parent)


def test_overwrite_is_synced_too(tmp_path, monkeypatch):
    target = tmp_path / "state.json"
    fs.write_json(pafs.LocalFileSystem(), str(target), {"v": 1})
    calls = record_fsyncs(monkeypatch)
    fs.write_json(pafs.LocalFileSystem(), str(target), {"v": 2})
    assert json.loads(target.read_text()) == {"v": 2}
    assert [is_dir for _, is_dir in calls] == [False, True]


@pytest.mark.slow
def test_no_fsync_on_object_store(bucket, monkeypatch):
    """An object store's PUT is durable when it returns; there is no file descriptor to sync."""
    calls = record_fsyncs(monkeypatch)
    store, path = fs.resolve(f"{bucket}/run/mark.json")
    fs.write_json(store, path, {"step": 3})
    assert fs.read_json(store, path) == {"step": 3}
    assert calls == []


def test_two_threads_of_one_process_write_one_document_at_once(tmp_path):
    """Seen at a job's clean end: the lease's renewal thread and the driver's release wrote the lease file at
    once, both through `.<name>.<pid>.tmp`, and one rename found its temporary file renamed away by the other
    ("could not renew job's lease ... Failed renaming ... .tmp"). Each write has a temporary file of its own."""
    import threading

    target = str(tmp_path / "lease.json")
    local = pafs.LocalFileSystem()
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        for i in range(200):
            try:
                fs.write_json(local, target, {"writer": n, "i": i, "pad": "x" * 4096})
            except BaseException as e:  # noqa: BLE001 - what the test looks for
                errors.append(e)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert json.loads((tmp_path / "lease.json").read_text())["i"] == 199
    assert not list(tmp_path.glob(".*.tmp")), "a temporary file left behind"
