"""A ZeRO-3 rank's share of a universal checkpoint, read by byte range: bytes about state / world.

DeepSpeed's ZeRO-3 universal loader (`stage3.load_hp_checkpoint_state`, checked against 0.19.8)
reads each parameter's `zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt` whole and keeps the slice
`[r*p, (r+1)*p)` of its flattened tensor (p = ceil(numel / world)): every rank downloaded the
whole optimizer state (about 84 GB per node at 7B). These files are uncompressed zip archives
(torch.save) holding one tensor record, so a rank's slice is one byte range. Each rank reads the
archive's directory and small records whole and, of the tensor, only its slice, into a sparse
local file of the original's size and layout: every other byte is a hole (no disk; zeros when
read). torch checks no record's CRC when it loads, so DeepSpeed loads that file as it would the
whole one and keeps the same slice, which holds the stored bytes. A file of any other layout
(more than one tensor record, a view) is fetched whole.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs
import torch
from torch import _weights_only_unpickler as weights_only

from tidal.errors import CheckpointError

SLICED = ("fp32.pt", "exp_avg.pt", "exp_avg_sq.pt")  # what the ZeRO-3 loader slices by rank
CHUNK = 64 * 2**20
EDGE = 16 * 2**10  # read once from each end: the pickle and headers, the directory (requests, not bytes, cost)


class Edges(io.RawIOBase):
    """A storage file read through two blocks fetched once (its first and last EDGE bytes): the
    archive's records around its tensor and its directory come from them, so finding the layout
    and copying them takes two requests, not one per record. Reads elsewhere go to storage."""

    def __init__(self, f: Any, size: int) -> None:
        super().__init__()
        self.f, self.size, self.pos = f, size, 0
        self.head = f.read_at(min(EDGE, size), 0)
        tail_at = max(len(self.head), size - EDGE)
        self.tail_at, self.tail = tail_at, f.read_at(size - tail_at, tail_at) if size > tail_at else b""
        self.fetched = len(self.head) + len(self.tail)

    def read_at(self, n: int, at: int) -> bytes:
        if at + n <= len(self.head):
            return self.head[at:at + n]
        if at >= self.tail_at:
            return self.tail[at - self.tail_at:at - self.tail_at + n]
        block = self.f.read_at(n, at)
        self.fetched += len(block)
        return block

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: pos, 1: self.pos + pos, 2: self.size + pos}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.size - self.pos if n is None or n < 0 else min(n, self.size - self.pos)
        out = self.read_at(n, self.pos)
        self.pos += len(out)
        return out


def sliced(rel: str) -> bool:
    """Whether `rel` (relative to a universal tag folder) is a file the ZeRO-3 loader slices."""
    parts = rel.split("/")
    return len(parts) == 3 and parts[0] == "zero" and parts[2] in SLICED


def partition(numel: int, world: int, rank: int) -> tuple[int, int]:
    """The elements `[lo, hi)` of a flattened parameter that ZeRO-3 rank `rank` of `world` holds
    (DeepSpeed pads the last partition; its padding is not in the file)."""
    per = math.ceil(numel / world)
    lo = min(rank * per, numel)
    return lo, min(lo + per, numel)


@dataclass(frozen=True)
class Layout:
    """Where the parts of one archive lie: byte ranges copied whole, and the tensor's record."""

    size: int
    whole: list[tuple[int, int]]
    data_start: int  # the first byte of the tensor's storage in the file
    offset: int  # the tensor's first element within its storage
    numel: int
    itemsize: int


class NotSliceable(Exception):
    """An archive whose tensor cannot be read as one byte range: fetch it whole."""


def layout(f: Any, size: int) -> Layout:
    """The layout of the archive `f` (a seekable binary file of `size` bytes), from its directory
    and its pickle: a few small reads."""
    archive = zipfile.ZipFile(f)
    infos = archive.infolist()
    records = [i for i in infos if "/data/" in i.filename and not i.filename.endswith(".pkl")]
    pickles = [i for i in infos if i.filename.endswith("/data.pkl")]
    if len(records) != 1 or len(pickles) != 1 or any(i.compress_type != zipfile.ZIP_STORED for i in infos):
        raise NotSliceable(f"{len(records)} tensor records")
    tensor = _tensor(archive.read(pickles[0]))
    starts = {i.filename: _data_start(f, i) for i in infos}
    record = records[0]
    whole = [(i.header_offset, starts[i.filename] + i.compress_size) for i in infos if i is not record]
    whole += [(record.header_offset, starts[record.filename]), (archive.start_dir, size)]
    return Layout(size, whole, starts[record.filename], tensor.storage_offset(), tensor.numel(), tensor.element_size())


def _tensor(pkl: bytes) -> torch.Tensor:
    """The tensor a universal file holds (`{"param": t, ...}` or `t`), on the meta device: the
    pickle is read weights-only and no storage byte is."""
    try:
        obj, _ = meta_tree(pkl)
    except (pickle.UnpicklingError, IndexError, TypeError) as e:
        raise NotSliceable(str(e)) from e
    tensor = obj.get("param") if isinstance(obj, dict) else obj
    if not isinstance(tensor, torch.Tensor) or not tensor.is_contiguous():
        raise NotSliceable("no contiguous tensor")
    return tensor


def meta_tree(pkl: bytes) -> tuple[Any, dict[int, str]]:
    """An archive's object from its pickle `pkl`, read by torch's weights-only unpickler (with the
    allow-list in force, if the caller set one) with every tensor on the meta device, no storage
    byte read; and each storage's record key, by the storage's identity (`untyped_storage()._cdata`)."""
    keys: dict[int, str] = {}

    def storage(pid: Any) -> Any:
        dtype = pid[1].dtype if hasattr(pid[1], "dtype") else torch.uint8
        untyped = torch.UntypedStorage(int(pid[4]) * _itemsize(dtype), device="meta")
        keys[untyped._cdata] = str(pid[2])
        return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)

    unpickler = weights_only.Unpickler(io.BytesIO(pkl), encoding="utf-8")
    unpickler.persistent_load = storage
    return unpickler.load(), keys


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _data_start(f: Any, info: zipfile.ZipInfo) -> int:
    """The first byte of a stored entry's data: after its local header, whose name and extra
    field lengths may differ from the directory's."""
    f.seek(info.header_offset)
    header = f.read(30)
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len


def fetch_share(storage: pafs.FileSystem, src: str, dst: str, size: int, world: int, rank: int) -> int:
    """Write into `dst` a sparse copy of the archive `src` holding rank `rank`'s slice of its
    tensor (of `world`) and every other record whole; returns the bytes read from storage.
    NotSliceable: fetch it whole instead. About four requests: the size, both ends, the slice."""
    with storage.open_input_file(src) as f:
        if f.size() != size:
            raise CheckpointError(f"{src} is {f.size():,} bytes in storage, its manifest says {size:,}")
        edges = Edges(f, size)
        lay = layout(edges, size)
        lo, hi = partition(lay.numel, world, rank)
        first = lay.data_start + (lay.offset + lo) * lay.itemsize
        write_sparse(edges, dst, lay.size, [*lay.whole, (first, first + (hi - lo) * lay.itemsize)])
    return edges.fetched


def write_sparse(edges: Edges, dst: str, size: int, ranges: list[tuple[int, int]]) -> None:
    """`dst`: a file of `size` bytes holding `edges`'s bytes in `ranges` and holes (no disk; zeros
    when read) everywhere else, fsynced."""
    with open(dst, "wb") as out:
        out.truncate(size)
        for start, end in ranges:
            for at in range(start, end, CHUNK):
                out.seek(at)
                out.write(edges.read_at(min(CHUNK, end - at), at))
        out.flush()
        os.fsync(out.fileno())
