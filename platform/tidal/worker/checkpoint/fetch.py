"""Fetch only what a rank loads, once per node, into a private, bounded local cache.

DeepSpeed (0.19, `engine._get_all_zero_checkpoint_state_dicts`) loads a rank's own ZeRO partition
and the model states file, not its peers' partitions; from a universal folder a ZeRO-1/2 rank
reads `zero/optimizer_state.pt` and the `zero/<param>/` folders of the parameters whose
fragments it holds. Downloading the whole checkpoint on every rank (what `fs.local_copy` does)
costs world-size times the egress and every partition's bytes of local disk on each rank.

Why files are fetched before loading rather than on demand through a DeepSpeed
`CheckpointEngine`: DeepSpeed finds the model states by `glob` in the local folder, and its
universal loader reads `zero/` with `os.listdir`, `os.path.isfile` and `torch.load` directly,
past any checkpoint engine. So the files a rank needs are chosen by name (`rank_files`, a pure
function) and placed where DeepSpeed looks; a name this module does not recognise is fetched.

DeepSpeed reads only this private folder, never storage itself, on every filesystem: its
universal loader and converter unpickle every `*.pt` they find without weights-only, so a file
planted in a storage folder, or swapped there after Tidal checked it (a shared filesystem), must
never be where they look. Files are copied (from a local or shared filesystem too, never linked)
into a folder only this user can write, and checked there. Every name is checked before it is
joined (tidal.fs.check_name): a manifest's name cannot place a file outside the folder.

Ranks on one node share one cache folder: a file is downloaded by whichever rank takes its
lock first (`fcntl.flock`, released by the kernel if that process dies) into a `.part` file
renamed into place once whole, and the others reuse it (locks and parts sit in a folder of their
own: DeepSpeed lists the data folders by file-name prefix). The free disk is checked before any
download: too little is a `LocalDiskFull` naming the folder and the bytes, never a retry, and
never held against the checkpoint.

The folder outlives the restore: a worker that fails on a node that lives restores from it, not
from storage. Its name holds the checkpoint's identity (its folder, the attempt that wrote it and
the list of its files with their sizes), so a copy of another attempt's save of the same step is
never taken for it, and each file is reused only at its listed size. The cache is bounded: each
restore removes every other cache folder under the root that no process holds, so a node keeps
the copy of one checkpoint (the newest restored) and any a live process still reads.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs

from tidal import fs
from tidal.errors import CheckpointError
from tidal.worker.checkpoint.share import NotSliceable, fetch_share, sliced

log = logging.getLogger("tidal")

CACHE_ENV = "TIDAL_RESTORE_CACHE"  # a node-local folder for restores (default: the temp dir)
PREFIX = "tidal-restore-"
INUSE = ".inuse"  # every process using a cache folder holds a shared lock on this file
WORK = ".tidal-fetch"  # download locks and partial files, apart from what DeepSpeed reads
_PARTITION = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_")


class LocalDiskFull(CheckpointError):
    """Too little local disk to fetch a checkpoint: a fault of the node, not of the checkpoint."""


def rank_files(listed: dict[str, int], dp_rank: int, params: set[str] | None = None) -> dict[str, int]:
    """Of a tag folder's files (path relative to the folder -> size), those a rank loads.

    `dp_rank`: the rank's data-parallel rank; its peers' `zero_pp_rank_<r>_*` files (ZeRO
    partitions; ZeRO-3 model states too) are left out. `params`: in a universal folder, the
    parameters whose fragments the rank holds (None: all of them, as ZeRO-3 needs); other
    parameters' `zero/<name>/` folders are left out. Everything else is kept.
    """
    out = {}
    for rel, size in listed.items():
        parts = fs.check_name(rel).split("/")
        if len(parts) == 1 and (m := _PARTITION.match(rel)) and int(m.group(1)) != dp_rank:
            continue
        if params is not None and len(parts) == 3 and parts[0] == "zero" and parts[1] not in params:
            continue
        out[rel] = size
    return out


@dataclass
class Fetched:
    """What a rank took from storage: files and bytes it downloaded, and those another rank of
    its node had already downloaded."""

    downloaded: dict[str, int] = field(default_factory=dict)
    reused: dict[str, int] = field(default_factory=dict)

    def took(self, rel: str, size: int, read: int | None) -> None:
        """`rel` (of `size` bytes) made by `write_once`: `read` bytes from storage, None if this node had it."""
        if read is None:
            self.reused[rel] = size
        else:
            self.downloaded[rel] = read

    def line(self) -> str:
        mb = sum(self.downloaded.values()) / 2**20
        return (f"downloaded {len(self.downloaded)} file(s), {mb:.1f} MiB; reused {len(self.reused)} "
                f"fetched by another rank of this node")


class NodeCache:
    """A cache folder shared by the ranks of one node for one checkpoint folder (`key`: what
    identifies its content). `keep`: leave it for later restores (False: removed by the last
    process out, for scratch such as a conversion's)."""

    def __init__(self, key: str, name: str = "", root: str | None = None, keep: bool = True) -> None:
        root = root or os.environ.get(CACHE_ENV) or tempfile.gettempdir()
        tag = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[-60:]
        self.root, self.keep = root, keep
        self.dir = os.path.join(root, f"{PREFIX}{tag}-{hashlib.sha1(key.encode()).hexdigest()[:16]}")
        self._lock: Any = None

    def __enter__(self) -> NodeCache:
        os.makedirs(self.root, exist_ok=True)
        sweep(self.root, keep=self.dir)
        self._lock = _hold_shared(self.dir)
        return self

    def __exit__(self, *exc: object) -> None:
        lock, self._lock = self._lock, None
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()
        if not self.keep:
            _remove_if_unused(self.dir)

    def fetch(self, storage: pafs.FileSystem, src: str, files: dict[str, int]) -> Fetched:
        """Make `files` (relative to `src` in `storage` -> size) present under `self.dir`."""
        files = fs.checked_files(files)
        missing = {rel: size for rel, size in files.items() if not _present(self.path(rel), size)}
        need = sum(missing.values())
        free = shutil.disk_usage(self.dir).free
        if need > free:
            raise LocalDiskFull(
                f"restoring {src} needs {need:,} bytes of local disk in {self.dir} and {free:,} are free. "
                f"Free space there, or point {CACHE_ENV} at a larger node-local folder; the checkpoint "
                "itself is sound and is kept.")
        got = Fetched()
        for rel, size in sorted(files.items()):
            where = fs.join_in(storage, src, rel)
            if self._fetch_one(storage, where, rel, size):
                got.downloaded[rel] = size
            else:
                got.reused[rel] = size
        return got

    def fetch_share(self, storage: pafs.FileSystem, src: str, rel: str, size: int, into: str,
                    share: tuple[int, int], got: Fetched) -> None:
        """Make `into/rel` this rank's sparse copy of `src/rel` (tidal.worker.checkpoint.share.fetch_share),
        unless an earlier restore of the same rank and world made it; a file that cannot be
        sliced is fetched whole into the node's copy and linked."""
        dst = _link_path(into, rel)  # a link to the node's whole copy, when the file could not be sliced
        where = fs.join_in(storage, src, rel)
        try:
            read = write_once(dst, size, where, lambda part: fetch_share(storage, where, part, size, *share))
        except NotSliceable:
            got.downloaded.update(self.fetch(storage, src, {rel: size}).downloaded)
            _link(dst, self.path(rel))
            return
        got.took(rel, size, read)

    def path(self, rel: str) -> str:
        return fs.join_local(self.dir, rel)

    def _fetch_one(self, storage: pafs.FileSystem, src: str, rel: str, size: int) -> bool:
        """Download one file unless another rank did; True when this process downloaded it.

        Its lock and partial download live in a folder of their own, never beside the data files:
        DeepSpeed lists a step folder by file-name prefix, and took `mp_rank_00_model_states.pt.lock`
        for a model file."""
        dst = self.path(rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        work = os.path.join(self.dir, WORK)
        os.makedirs(work, exist_ok=True)
        flat = rel.replace("/", "%")
        with open(os.path.join(work, f"{flat}.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one downloader per file; a dead one's lock is released
            if _present(dst, size):
                return False
            part = os.path.join(work, f"{flat}.{os.getpid()}.part")
            try:
                pafs.copy_files(src, part, source_filesystem=storage,
                                destination_filesystem=pafs.LocalFileSystem())
            except OSError as e:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(part)
                if e.errno == errno.ENOSPC or "No space left" in str(e):
                    raise LocalDiskFull(f"the local disk under {self.dir} filled up while fetching {rel} "
                                        f"({size:,} bytes); the checkpoint itself is sound and is kept") from e
                raise
            got = os.path.getsize(part)
            if got != size:
                os.remove(part)
                raise CheckpointError(f"{src} is {got:,} bytes in storage, its manifest says {size:,}")
            os.rename(part, dst)  # atomic: a reader sees no file or the whole file
            return True


def write_once(dst: str, size: int, source: str, write: Callable[[str], int]) -> int | None:
    """Make `dst` (a rank's own file of `size` bytes, made from `source`) by `write(part)`, which
    returns the bytes it read from storage, unless an earlier restore on this node made it (None).
    Written to a `.part` and renamed once whole and at its size: a process killed while writing
    leaves no `dst`, and the next restore writes it again."""
    if _present(dst, size):
        return None
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    part = f"{dst}.{os.getpid()}.part"
    try:
        read = write(part)
        if not _present(part, size):
            raise CheckpointError(f"{source}'s size differs from its manifest's {size:,} bytes")
        os.rename(part, dst)
        return read
    finally:
        if os.path.exists(part):
            os.remove(part)


def _present(path: str, size: int) -> bool:
    try:
        return os.path.getsize(path) == size
    except OSError:
        return False


def _hold_shared(folder: str) -> Any:
    """A shared lock on `folder`'s in-use file, created if need be. A folder removed between
    opening and locking its file (by `_remove_if_unused`) is made again."""
    while True:
        os.makedirs(folder, mode=0o700, exist_ok=True)  # private: only this user can place a file there
        _check_private(folder)
        f = open(os.path.join(folder, INUSE), "a")  # noqa: SIM115 - held until __exit__
        fcntl.flock(f, fcntl.LOCK_SH)
        try:
            if os.stat(f.name).st_ino == os.fstat(f.fileno()).st_ino:
                return f
        except FileNotFoundError:
            pass
        f.close()


def _check_private(folder: str) -> None:
    """A cache folder another user made (a shared temp dir, a guessed name) could hold their files."""
    st = os.stat(folder)
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise CheckpointError(f"the restore cache {folder} belongs to another user or others can write to it; "
                              f"remove it, or point {CACHE_ENV} at a folder of this user's")


def _remove_if_unused(folder: str) -> bool:
    """Remove `folder` when no process holds it (an exclusive lock is then free). The in-use
    file goes last, so a process that opened it meanwhile sees it gone and starts over."""
    try:
        f = open(os.path.join(folder, INUSE), "a")  # noqa: SIM115
    except FileNotFoundError:
        return False
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        for entry in os.listdir(folder):
            if entry != INUSE:
                p = os.path.join(folder, entry)
                shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else os.remove(p)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(folder, INUSE))
        with contextlib.suppress(OSError):
            os.rmdir(folder)
    return True


def sweep(root: str, keep: str = "") -> list[str]:
    """Remove this user's cache folders under `root` that no process holds (left by killed processes).

    The default root is the temp dir every user of the node shares: another user's folder there
    (private to them: its lock file refuses this user) is theirs, and so is a link named like a
    cache folder, which is not followed; neither fails this restore, and root removes neither."""
    gone = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.listdir(root):
            path = os.path.join(root, entry)
            if not entry.startswith(PREFIX) or path == keep:
                continue
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            try:
                if _remove_if_unused(path):
                    gone.append(path)
            except PermissionError as e:  # ours, but made unreadable: left, said, never a failed restore
                log.warning("could not sweep the restore cache folder %s (%s)", path, e)
    return gone


@contextlib.contextmanager
def tag_folder(storage: pafs.FileSystem, root: str, tag: str, files: dict[str, int], name: str,
               identity: str = "", share: tuple[int, int] | None = None) -> Iterator[tuple[str, Fetched]]:
    """A private local folder holding copies of `files` of `root/tag` (relative to the tag folder),
    laid out as DeepSpeed expects (`<dir>/<tag>/...`), on every filesystem; yields (`<dir>`, what
    was fetched). `identity` names the checkpoint's content (see the module's docstring).

    `share` (world, rank): a ZeRO-3 rank's load of a universal folder, which slices each
    parameter's optimizer files by rank: those are read by byte range (tidal.worker.checkpoint.share) into
    a folder of this rank's own, beside links to the node's whole copies of the rest."""
    with NodeCache(f"{root}/{tag}#{identity}", name=f"{name}-{tag}") as cache:
        whole = {rel: size for rel, size in files.items() if share is None or not sliced(rel)}
        got = cache.fetch(storage, root, {f"{tag}/{rel}": size for rel, size in whole.items()})
        load_dir = cache.dir
        if share is not None:
            load_dir = cache.path(f".share-{share[0]}-{share[1]}")
            for rel, size in sorted(files.items()):
                if rel not in whole:
                    cache.fetch_share(storage, root, f"{tag}/{rel}", size, load_dir, share, got)
                else:
                    _link(_link_path(load_dir, f"{tag}/{rel}"), cache.path(f"{tag}/{rel}"))
        log.info("Restore: %s/%s (pid %d): %s", name, tag, os.getpid(), got.line())
        yield load_dir, got


def _link_path(root: str, rel: str) -> str:
    """Where the link to `rel` goes under `root`: its folder checked as `fs.join_local` checks any
    path, the link itself not followed (an earlier restore's link leads into the node's copy, by design)."""
    folder, _, name = fs.check_name(rel).rpartition("/")
    return os.path.join(fs.join_local(root, folder) if folder else root, name)


def _link(link: str, target: str) -> None:
    """`link` leading to `target`, whatever was there (an earlier restore's link is kept as it is)."""
    os.makedirs(os.path.dirname(link), exist_ok=True)
    if os.path.islink(link) and os.readlink(link) == target:
        return
    if os.path.lexists(link):
        os.remove(link)
    os.symlink(target, link)
