"""A streamed source, tokenized once into fixed-size shards that training reads by window index.

Why shards, not a live Ray Data stream into the workers: a window read from a live stream is
identified only by where Ray Data happened to cut its blocks (read heuristics, block size, Ray
version), so a restarted or resized job cannot know which windows it already trained on. Here the
driver has Ray Data read and tokenize the source in parallel, in the source's own order (file,
then row: `preserve_order`), once, before any worker starts; the packed token stream is cut into
windows of `seq_len + 1` tokens and written to the job's storage as `.npy` shards of
`data.shard_windows` windows each, with an index, published by a marker written last
(`tidal.fs.published`), so an interrupted build is never read. A window's identity is then its
place in the source, the workers read windows by global index (`tidal.worker.stream`), and the
data position is the step number, as for sources read whole. This is MosaicML Streaming's MDS
design (shards + index, elastic determinism) kept on Ray Data and pyarrow, which the job already
uses for reading and storage; MDS itself would add a second writer, reader and cache format.

The index is cached under the job's folder, keyed by everything that changes its tokens (source
path, size and mtime, text field, tokenizer, seq_len, shard size): a restart, a resize or a new
driver reuses it. Reading before `fit` also means Ray Data never competes with the workers for
CPUs (a streamed job once waited forever on a 2-CPU node whose workers held both).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from tidal import fs
from tidal.errors import TidalError
from tidal.spec.job import JobSpec
from tidal.storage import RunDir

STREAM_DIR = "tidal-stream"
INDEX_FILE = "index.json"
MARKER = "_published.json"
CURRENT = "current.json"  # the key the job trained on: a changed source must not resume silently
FORMAT = 1
SHARD_BYTES = 4 << 20  # default shard size: small enough to fetch quickly, large enough to list few

TokenChunks = Callable[[JobSpec], Iterator[np.ndarray]]


def shard_windows(spec: JobSpec) -> int:
    return spec.data.shard_windows or max(1, SHARD_BYTES // (4 * (spec.model.seq_len + 1)))


def index_key(spec: JobSpec, info: pafs.FileInfo) -> dict[str, Any]:
    """What the tokens depend on; a change in any makes a new index."""
    d = spec.data
    return {"format": FORMAT, "source": d.source, "size": info.size, "mtime_ns": info.mtime_ns,
            "text_field": d.text_field, "tokenizer": d.tokenizer, "seq_len": spec.model.seq_len,
            "shard_windows": shard_windows(spec)}


def key_hash(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def prepare(spec: JobSpec, chunks: TokenChunks | None = None) -> str:
    """The URI of the job's shard index for `spec.data.source`, built now unless already published.

    `chunks` yields the source's tokens in order (default: read and tokenized by Ray Data)."""
    src_fs, src_path = fs.resolve(spec.data.source)
    info = src_fs.get_file_info(src_path)
    if info.type != pafs.FileType.File:
        raise TidalError(f"data.source {spec.data.source!r} is not a file: streaming reads one .txt, .jsonl or "
                         ".parquet file (a path or a URI)")
    key = index_key(spec, info)
    run_dir = RunDir(spec.checkpoint.storage, spec.name)
    path = f"{run_dir.path}/{STREAM_DIR}/{key_hash(key)}"
    _check_same_source(spec, run_dir, key)
    if not fs.published(run_dir.fs, path, f"{path}/{MARKER}"):
        print(f"[tidal] tokenizing {spec.data.source} into shards of {key['shard_windows']} windows "
              f"(once; reused by restarts and resizes)", flush=True)
        build(run_dir.fs, path, (chunks or ray_token_chunks)(spec), spec.model.seq_len + 1, key)
    run_dir.write_json(f"{STREAM_DIR}/{CURRENT}", key)
    return path if fs.is_local(run_dir.fs) else _uri(spec.checkpoint.storage, path)


def _uri(storage: str, path: str) -> str:
    """`path` (inside the storage filesystem) as a URI the workers resolve the way the storage is
    (kept as written: it may carry the endpoint or credentials pyarrow needs)."""
    root = fs.resolve(storage)[1]
    return storage.rstrip("/") + path[len(root):]


def _check_same_source(spec: JobSpec, run_dir: RunDir, key: dict[str, Any]) -> None:
    """Checkpoints count steps of one index: another index under them would train other windows."""
    before = run_dir.read_json(f"{STREAM_DIR}/{CURRENT}")
    if before is None or before == key or not run_dir.checkpoints():
        return
    changed = ", ".join(f"{k}: {before.get(k)!r} -> {key[k]!r}" for k in key if before.get(k) != key[k])
    raise TidalError(f"cannot resume job {spec.name!r}: its streamed source changed since its checkpoints were "
                     f"written ({changed}); its steps would no longer name the same windows. Restore the source, "
                     "pick another job name, or start over with `tidal run --restart`.")


def build(sfs: pafs.FileSystem, path: str, chunks: Iterator[np.ndarray], window: int, key: dict[str, Any]) -> None:
    """Pack `chunks` into windows of `window` tokens, write them as shards, then the index and the
    marker. The tail shorter than one window is dropped (less than one window per source)."""
    per_shard = key["shard_windows"] * window
    fs.delete_dir(sfs, path)
    sfs.create_dir(path, recursive=True)
    files: dict[str, int] = {}
    counts: list[int] = []
    pending: list[np.ndarray] = []
    held = 0
    for chunk in chunks:
        pending.append(chunk.astype(np.int32, copy=False))
        held += len(chunk)
        while held >= per_shard:
            flat = np.concatenate(pending)
            _write_shard(sfs, path, files, counts, flat[:per_shard].reshape(-1, window))
            pending, held = [flat[per_shard:]], len(flat) - per_shard
    flat = np.concatenate(pending) if pending else np.empty(0, np.int32)
    if len(flat) >= window:
        _write_shard(sfs, path, files, counts, flat[: len(flat) // window * window].reshape(-1, window))
    if not counts:
        raise TidalError(f"data.source {key['source']!r} holds {len(flat)} tokens, fewer than one window of "
                         f"{window} (model.seq_len + 1)")
    index = {"key": key, "window": window, "shards": sorted(files), "counts": counts}
    blob = json.dumps(index).encode()
    with sfs.open_output_stream(f"{path}/{INDEX_FILE}") as f:
        f.write(blob)
    files[INDEX_FILE] = len(blob)
    fs.write_json(sfs, f"{path}/{MARKER}", {"files": files})  # last: the index is whole from here on


def _write_shard(sfs: pafs.FileSystem, path: str, files: dict[str, int], counts: list[int], windows: np.ndarray) -> None:
    name = f"shard_{len(counts):06d}.npy"
    buf = io.BytesIO()
    np.save(buf, windows)
    with sfs.open_output_stream(f"{path}/{name}") as f:
        f.write(buf.getvalue())
    files[name], counts[len(counts):] = buf.tell(), [len(windows)]


def ray_token_chunks(spec: JobSpec, num_blocks: int | None = None) -> Iterator[np.ndarray]:
    """The source's tokens, tokenized by Ray Data tasks in parallel, yielded in source order.

    Each batch becomes one chunk of its documents' tokens (each ending in a separator): packing
    is concatenation, so where Ray Data cuts batches or blocks changes nothing."""
    source = spec.data.source
    field = spec.data.text_field if source.endswith((".jsonl", ".parquet")) else "text"
    with _data_context():
        ds = _read(source, num_blocks).map_batches(
            encode_batch, batch_format="numpy", fn_kwargs={"text_field": field, "tokenizer": spec.data.tokenizer})
        for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            for blob in batch.column("tokens").to_pylist():
                yield np.frombuffer(blob, dtype=np.int32)


def encode_batch(batch: dict[str, np.ndarray], text_field: str, tokenizer: str | None) -> pa.Table:
    from tidal.worker.tokens import encode  # numpy only; a Hugging Face tokenizer loads in the task

    flat = encode([str(t) for t in batch[text_field]], tokenizer)
    return pa.table({"tokens": pa.array([flat.tobytes()], pa.large_binary())})


def _read(source: str, num_blocks: int | None) -> Any:
    import ray.data

    blocks = {"override_num_blocks": num_blocks} if num_blocks else {}
    if source.endswith(".parquet"):
        return ray.data.read_parquet(source, **blocks)
    if source.endswith(".jsonl"):
        return ray.data.read_json(source, lines=True, **blocks)
    return ray.data.read_text(source, **blocks)  # one row per line, in column "text"


@contextmanager
def _data_context() -> Iterator[None]:
    """Source order, and Ray Data's progress bars and per-dataset log lines only on a terminal or
    with TIDAL_DEBUG=1 (in a log the bars are thousands of lines; Tidal says what it builds)."""
    from ray.data import DataContext

    ctx, logger = DataContext.get_current(), logging.getLogger("ray.data")
    before = ctx.execution_options.preserve_order, ctx.enable_progress_bars, logger.level
    verbose = sys.stderr.isatty() or os.environ.get("TIDAL_DEBUG") == "1"
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = verbose
    if not verbose:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        ctx.execution_options.preserve_order, ctx.enable_progress_bars = before[:2]
        logger.setLevel(before[2])
