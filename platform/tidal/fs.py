"""Filesystem operations that work the same on a local path, a shared filesystem and an object store.

Everything Tidal keeps (checkpoints, the job file, the metrics buffer, universal conversions)
goes through a pyarrow filesystem, never through POSIX calls, because cloud-burst nodes share
only object storage with on-prem ones. pyarrow covers reads, writes, listing and deletion
everywhere; what it does not do on an object store is rename a folder (S3 has no folders:
`move` of a prefix fails with NO_SUCH_KEY), so the two operations that need one are written
here: `set_aside` copies object by object (server-side CopyObject) and deletes the original
only once every copy is made, and publication of a folder relies on a marker written last
(see `publish_dir`), never on a rename.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import pyarrow.fs as pafs


def resolve(uri_or_path: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path within it) for a local path or any URI pyarrow knows (s3://, gs://, file://;
    abfs:// with the key, SAS token and endpoint Azure's tools read from the environment: azure_blob.py)."""
    from tidal import azure_blob

    if azure_blob.is_azure_uri(uri_or_path):
        fs, path = azure_blob.resolve(uri_or_path)
        return fs, path.rstrip("/")
    if "://" in uri_or_path:
        fs, path = pafs.FileSystem.from_uri(uri_or_path)
        return fs, path.rstrip("/")
    return pafs.LocalFileSystem(), os.path.abspath(uri_or_path)


def ray_storage(uri_or_path: str) -> dict[str, Any]:
    """Ray Train's `RunConfig` storage arguments for the job's storage: the URI itself, which Ray
    resolves as pyarrow does; for abfs:// the filesystem `resolve` builds and the path in it, since
    pyarrow alone would not find the key or the endpoint Azure's tools read (azure_blob.py)."""
    from tidal import azure_blob

    if not azure_blob.is_azure_uri(uri_or_path):
        return {"storage_path": uri_or_path}
    store, path = resolve(uri_or_path)
    return {"storage_path": path, "storage_filesystem": store}


class UnsafeName(ValueError):
    """A file name read from storage (a manifest, a marker, an index) that could reach outside
    the folder it is joined to: absolute, with a `..` or `.` part, empty, or not a string."""


def check_name(rel: object) -> str:
    """`rel` when it is a plain relative name (`a/b.pt`); else UnsafeName saying why.

    Every name Tidal reads from storage goes through this before it is joined to a path, local or
    remote: pyarrow's S3 client normalises `..` inside keys (`ck/global_step4/../../x` names
    `x` two levels up, an object that exists), and a local join would write or read there."""
    if not isinstance(rel, str) or not rel:
        raise UnsafeName(f"{rel!r} is not a file name")
    if rel.startswith(("/", "~")) or "\\" in rel or "\0" in rel or (len(rel) > 1 and rel[1] == ":"):
        raise UnsafeName(f"{rel!r} is not a relative file name")
    if any(part in ("", ".", "..") for part in rel.split("/")):
        raise UnsafeName(f"{rel!r} has an empty, '.' or '..' part")
    return rel


def join(root: str, rel: str) -> str:
    """`root/rel` for a storage path (any filesystem), `rel` checked first (`check_name`)."""
    return f"{root.rstrip('/')}/{check_name(rel)}"


def join_local(root: str, rel: str) -> str:
    """`root/rel` on this machine, `rel` checked (`check_name`) and the result, links resolved,
    inside `root`: a link planted in the folder cannot lead a read or write elsewhere."""
    path = os.path.join(root, check_name(rel))
    base = os.path.realpath(root)
    if not os.path.realpath(path).startswith(base.rstrip(os.sep) + os.sep):
        raise UnsafeName(f"{rel!r} leads outside {root}")
    return path


def checked_files(files: object) -> dict[str, int]:
    """A manifest's `files` (name -> size) with every name checked and every size a non-negative
    int; UnsafeName otherwise."""
    if not isinstance(files, dict):
        raise UnsafeName(f"a file list must map names to sizes, not {type(files).__name__}")
    for rel, size in files.items():
        check_name(rel)
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise UnsafeName(f"{rel!r} has size {size!r}, not a byte count")
    return dict(files)


def is_local(fs: pafs.FileSystem) -> bool:
    return isinstance(fs, pafs.LocalFileSystem)


def join_in(fs: pafs.FileSystem, root: str, rel: str) -> str:
    """`root/rel` in `fs`, `rel` checked: on this machine links resolved too (`join_local`)."""
    return join_local(root, rel) if is_local(fs) else join(root, rel)


def exists(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def read_json(fs: pafs.FileSystem, path: str) -> Any | None:
    """The JSON document at `path`, or None if it is missing or unreadable."""
    try:
        with fs.open_input_stream(path) as f:
            return json.loads(f.read())
    except (FileNotFoundError, OSError, ValueError):
        return None


def write_json(fs: pafs.FileSystem, path: str, data: Any, indent: int | None = 2) -> None:
    """Write `data` so a reader sees the old document or the new one, never half of one.

    An object store makes a single PUT visible whole; a local or shared filesystem needs a
    temporary file renamed over the target, with the file and then its directory fsynced, so
    that what a reader saw is also what is on disk after the machine crashes.
    """
    blob = json.dumps(data, indent=indent, separators=None if indent else (",", ":")).encode()
    parent = path.rsplit("/", 1)[0]
    fs.create_dir(parent, recursive=True)
    if not is_local(fs):
        with fs.open_output_stream(path) as f:
            f.write(blob)
        return
    # One temporary file per write, not per process: two threads writing one document at once (a lease's
    # renewal and its release) renamed each other's away when the name held the pid alone.
    tmp = f"{parent}/.{path.rsplit('/', 1)[1]}.{os.getpid()}-{threading.get_ident()}.tmp"
    with fs.open_output_stream(tmp) as f:
        f.write(blob)
    if DURABLE:
        fsync_path(tmp)  # the bytes reach the disk before the name points at them
    fs.move(tmp, path)
    if DURABLE:
        fsync_path(parent)  # and the rename itself survives a crash of the machine


# Whether write_json waits for the disk on a local or shared (NFS) filesystem. Without it a power
# loss or kernel crash after the rename can leave an empty or old file under the new name: a
# manifest naming files that are not there, or a mark past points MLflow never got. Off only for
# benchmarks/fsync_cost.py, which measures what it costs.
DURABLE = True


def fsync_path(path: str) -> None:
    """fsync a file or a directory by path. pyarrow's LocalFileSystem has no fsync (its output
    stream's close only closes), so this is plain os calls; a directory is opened read-only,
    which Linux and macOS accept for fsync."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class UploadsUnchecked(Exception):
    """The incomplete uploads under a prefix could not be listed or aborted; says why in one line."""


def abort_incomplete_uploads(storage: str, name: str) -> int:
    """Abort the S3 multipart uploads of checkpoint files left incomplete under the job folder
    `<storage>/<name>/`; returns how many. Anything but s3:// has none (0).

    A writer killed mid-upload (a rank of a failed attempt, a preempted node) leaves its parts
    stored, and billed, until the upload is aborted; nothing else ever aborts them unless the
    bucket has a lifecycle rule (docs/cluster.md). Called when an attempt starts, before it
    writes: every writer of the job's folder belongs to an attempt, and the earlier ones are
    dead. Except the tracker and the controller, which write small JSON documents (event log,
    mark, job file) at any time, and pyarrow 25 opens a multipart upload for every write however
    small (checked on moto): uploads of `.json` keys are left alone.

    pyarrow's S3FileSystem neither lists nor aborts uploads, so this uses boto3 when it is
    installed (it reads the same AWS_* environment as pyarrow, plus the URI's own
    endpoint_override, region and credentials); raises UploadsUnchecked otherwise.
    """
    parts = urllib.parse.urlsplit(storage)
    if parts.scheme != "s3":
        return 0
    try:
        import boto3
        import botocore.exceptions
    except ImportError:
        raise UploadsUnchecked("boto3 is not installed (pip install boto3)") from None
    bucket, prefix = parts.netloc.rsplit("@", 1)[-1], f"{parts.path.strip('/')}/{name}/".lstrip("/")
    try:
        s3 = boto3.client("s3", **_boto_options(parts))
        aborted = 0
        for page in s3.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=prefix):
            for upload in page.get("Uploads", []):
                if upload["Key"].endswith(".json"):
                    continue  # maybe a live write (see above); a dead one holds a few KB
                s3.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                aborted += 1
        return aborted
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
        raise UploadsUnchecked(str(e).splitlines()[0]) from None


def _boto_options(parts: urllib.parse.SplitResult) -> dict[str, str]:
    """What a pyarrow S3 URI says about where and as whom to connect, as boto3 client options."""
    query = dict(urllib.parse.parse_qsl(parts.query))
    options = {}
    if endpoint := query.get("endpoint_override"):
        options["endpoint_url"] = endpoint if "://" in endpoint else f"{query.get('scheme', 'https')}://{endpoint}"
    if region := query.get("region"):
        options["region_name"] = region
    if parts.username:
        options["aws_access_key_id"] = urllib.parse.unquote(parts.username)
        options["aws_secret_access_key"] = urllib.parse.unquote(parts.password or "")
    return options


def list_dir(fs: pafs.FileSystem, path: str, recursive: bool = False) -> list[pafs.FileInfo]:
    try:
        return fs.get_file_info(pafs.FileSelector(path, allow_not_found=True, recursive=recursive))
    except OSError:
        return []


def files_under(fs: pafs.FileSystem, path: str) -> dict[str, int]:
    """Relative path -> size of every file below `path`."""
    out = {}
    for info in list_dir(fs, path, recursive=True):
        if info.type == pafs.FileType.File:
            out[info.path[len(path.rstrip("/")) + 1:]] = info.size
    return out


def delete_dir(fs: pafs.FileSystem, path: str) -> None:
    with suppress(FileNotFoundError):
        fs.delete_dir(path)


def delete_file(fs: pafs.FileSystem, path: str) -> None:
    with suppress(FileNotFoundError):
        fs.delete_file(path)


def set_aside(fs: pafs.FileSystem, path: str, new_path: str) -> None:
    """Move the folder `path` to `new_path` without losing anything if interrupted.

    A rename where the filesystem has one; on an object store every object is copied
    server-side first and the original deleted only after the last copy, so an interruption
    leaves the original whole (and a partial copy beside it that a later try replaces).
    """
    if is_local(fs):
        fs.move(path, new_path)
        return
    for rel, size in files_under(fs, path).items():
        if size > SERVER_COPY_LIMIT:
            _stream_copy(fs, f"{path}/{rel}", f"{new_path}/{rel}")
        else:
            fs.copy_file(f"{path}/{rel}", f"{new_path}/{rel}")
    delete_dir(fs, path)


# S3's CopyObject (what pyarrow's copy_file sends) refuses sources over 5 GiB; larger shards are
# streamed through this process instead, which pyarrow uploads in parts.
SERVER_COPY_LIMIT = 5 * 2**30


def _stream_copy(fs: pafs.FileSystem, src: str, dst: str, chunk: int = 64 * 2**20) -> None:
    with fs.open_input_stream(src) as f, fs.open_output_stream(dst) as out:
        while block := f.read(chunk):
            out.write(block)


@contextmanager
def local_copy(fs: pafs.FileSystem, path: str) -> Iterator[str]:
    """A local directory holding the folder `path`: the folder itself on a local filesystem,
    else a private download removed afterwards (each process gets its own, so nothing one
    process writes there is seen by another: share results through storage instead)."""
    if is_local(fs):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="tidal-dl-") as tmp:
        local = os.path.join(tmp, path.rstrip("/").rsplit("/", 1)[-1])
        # Object stores hold no folders (prefixes written without marker objects, as Ray's upload
        # leaves them), and copy_files then makes no local parents: make them first.
        for rel in files_under(fs, path):
            os.makedirs(os.path.dirname(os.path.join(local, rel)), exist_ok=True)
        pafs.copy_files(path, local, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem(),
                        use_threads=True)
        yield local


@contextmanager
def local_files(fs: pafs.FileSystem, root: str, rels: list[str]) -> Iterator[str]:
    """A private local folder holding copies of exactly the files `rels` (paths relative to
    `root`, each checked by `check_name`), at the same relative paths, removed afterwards.

    For readers that glob a folder (DeepSpeed's converters count files) and unpickle without
    weights-only (zero_to_fp32): they must see only these files, and only the bytes Tidal checks.
    Copies on every filesystem, a local or shared one included: a link into a shared folder
    would let a writer swap a file between Tidal's check and DeepSpeed's read."""
    with tempfile.TemporaryDirectory(prefix="tidal-files-") as tmp:
        for rel in rels:
            dst = join_local(tmp, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            src = join_in(fs, root, rel)
            pafs.copy_files(src, dst, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
        yield tmp


def upload_dir(local: str, fs: pafs.FileSystem, path: str) -> dict[str, int]:
    """Copy the local folder `local` to `path` in `fs` (replacing what was there); returns its files' sizes."""
    delete_dir(fs, path)
    return upload_into(local, fs, path)


def upload_into(local: str, fs: pafs.FileSystem, path: str) -> dict[str, int]:
    """Copy the local folder `local` into `path` in `fs`, leaving what else is there (several
    writers fill one folder); returns the copied files' sizes."""
    fs.create_dir(path, recursive=True)
    pafs.copy_files(local, path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs,
                    use_threads=True)
    return files_under(pafs.LocalFileSystem(), local)


def publish_dir(local: str, fs: pafs.FileSystem, path: str, marker: str, **extra: Any) -> None:
    """Upload `local` to `path`, then write `marker` (a JSON manifest of its files, and `extra`) last.

    Readers trust the folder only when `published` finds the marker and every listed file at
    its size, so a copy interrupted half-way is never used, on any filesystem.
    """
    files = upload_dir(local, fs, path)
    write_json(fs, marker, {"files": files, **extra})


def published_files(fs: pafs.FileSystem, path: str, marker: str) -> dict[str, Any] | None:
    """The marker's document when every file it lists is in `path` at its size and every name is
    safe (`check_name`); else None: the folder does not count."""
    manifest = read_json(fs, marker)
    if not isinstance(manifest, dict) or "files" not in manifest:
        return None
    try:
        files = checked_files(manifest["files"])
    except UnsafeName:
        return None
    present = files_under(fs, path)
    if not all(present.get(rel) == size for rel, size in files.items()):
        return None
    return {**manifest, "files": files}


def published(fs: pafs.FileSystem, path: str, marker: str) -> bool:
    return published_files(fs, path, marker) is not None
