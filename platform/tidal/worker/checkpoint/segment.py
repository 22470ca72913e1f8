"""Shared-memory segments a node's keeper owns and its ranks write snapshots into: made, sized against the node, mapped.

A segment is an anonymous shared-memory file (`memfd_create`) that the keeper creates, sizes and
pre-faults (`posix_fallocate`: the pages exist before the first snapshot, which then pays a copy,
not page faults), and keeps open. A rank on the same node maps it through the keeper's descriptor
(`/proc/<keeper pid>/fd/<fd>`, `Ref`) and copies its state straight in. Nothing is named in
/dev/shm: a keeper that dies, however (its expiry, `ray.kill`, SIGKILL, a lost node), frees its
segments with its process, and /dev/shm's size does not bound them (a Kubernetes pod's /dev/shm is
64 MiB unless a memory-backed emptyDir is mounted there; a memfd is not under that mount). What
bounds them is the node's memory, and the pod's cgroup limit where there is one (`room`).

A segment's first bytes are its header: the `stamp` of the snapshot it holds (0 while a rank is
writing it). A reader checks the stamp before and after it copies out (a slot reused under it is
seen), and the keeper lists only slots whose stamp is still the one it recorded.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

HEADER = 64  # bytes before the block: the stamp, and the block's cache-line alignment
_STAMP = struct.Struct("<Q")
CGROUP_LIMIT = "/sys/fs/cgroup/memory.max"  # cgroup v2: the pod's (container's) memory limit


class NoRoom(Exception):
    """The node cannot give a segment its memory; the message names the setting."""


@dataclass(frozen=True)
class Ref:
    """Where a rank maps a segment: the keeper's process and its descriptor, and the segment's size."""

    pid: int
    fd: int
    size: int


def stamp(attempt: str, step: int, rank: int) -> int:
    """A snapshot's stamp: nonzero, the same for the same shard of the same attempt and step."""
    digest = hashlib.blake2b(f"{attempt}:{step}:{rank}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") & (2**63 - 1)) or 1


def create(size: int, label: str) -> int:
    """A new segment of `size` bytes of data (plus the header), every page allocated; its descriptor.
    NoRoom when the memory is not there (posix_fallocate's ENOSPC/ENOMEM)."""
    fd = os.memfd_create(label[:200], os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, HEADER + size)
        os.posix_fallocate(fd, 0, HEADER + size)
    except OSError as e:
        os.close(fd)
        raise NoRoom(f"could not allocate {size / 2**30:.2f} GiB of shared memory for a snapshot ({e.strerror})") from e
    return fd


def mapped(ref: Ref, populate: bool = True) -> tuple[mmap.mmap, np.ndarray]:
    """Map `ref` (another process's segment on this node) read-write; the map and a uint8 array over
    its block (after the header). `populate`: the page tables are filled now, once, not at each
    first touch of a snapshot's copy."""
    fd = os.open(f"/proc/{ref.pid}/fd/{ref.fd}", os.O_RDWR)
    try:
        return map_fd(fd, ref.size, populate)
    finally:
        os.close(fd)


def map_fd(fd: int, size: int, populate: bool = False) -> tuple[mmap.mmap, np.ndarray]:
    """Map a segment's descriptor: the map and a uint8 array over its block (numpy: the driver,
    which imports the keeper, never imports torch)."""
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    mm = mmap.mmap(fd, HEADER + size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return mm, np.frombuffer(mm, dtype=np.uint8, count=size, offset=HEADER)


def read_stamp(mm: mmap.mmap) -> int:
    return int(_STAMP.unpack_from(mm, 0)[0])


def write_stamp(mm: mmap.mmap, value: int) -> None:
    _STAMP.pack_into(mm, 0, value)


def room(want: int, held: int, limit: int, reserve: int) -> str | None:
    """Why a node cannot give `want` more bytes of segments (None: it can), where its keeper already
    holds `held` under `limit` (checkpoint.memory.max_gb, or its default share of the node) and must
    leave `reserve` of the node's (or the pod's) memory free."""
    if held + want > limit:
        return (f"the memory tier would hold {(held + want) / 2**30:.2f} GiB on this node, over its limit of "
                f"{limit / 2**30:.2f} GiB (checkpoint.memory.max_gb; two snapshots of each rank here and of the "
                "peer node's ranks): raise it, or set checkpoint.memory: null to turn the tier off")
    free = available()
    if free - want < reserve:
        return (f"this node has {free / 2**30:.2f} GiB of memory free, too little for {want / 2**30:.2f} GiB of "
                f"snapshots and the {reserve / 2**30:.2f} GiB kept free: lower checkpoint.memory.max_gb or give "
                "the node (pod) more memory, or set checkpoint.memory: null")
    return None


def available() -> int:
    """Memory this process's node can still give: the lesser of the machine's available memory and
    what its cgroup (a Kubernetes pod's limit) has left."""
    import psutil

    free = int(psutil.virtual_memory().available)
    with contextlib.suppress(OSError, ValueError):
        limit = _read(CGROUP_LIMIT)
        if limit != "max":
            free = min(free, int(limit) - int(_read(os.path.join(os.path.dirname(CGROUP_LIMIT), "memory.current"))))
    return free


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def total_memory() -> int:
    """The node's (or the pod's, where a cgroup limit is lower) memory."""
    import psutil

    total = int(psutil.virtual_memory().total)
    with contextlib.suppress(OSError, ValueError):
        limit = _read(CGROUP_LIMIT)
        if limit != "max":
            total = min(total, int(limit))
    return total


def close_quietly(obj: Any) -> None:
    with contextlib.suppress(Exception):
        obj.close()
