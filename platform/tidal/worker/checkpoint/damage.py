"""Which failed loads condemn a checkpoint: only proven damage (a size off its manifest, bytes that do not unpickle).

A checkpoint that fails to load is quarantined only when it is proven corrupt (a size that
differs from its manifest, a file that does not unpickle, an archive entry that fails its CRC);
any other failure (out of memory, a network error, a bug) fails the attempt and Ray's restart
tries the same checkpoint again. A pickle naming a type outside the allow-list of
tidal.worker.checkpoint.safe_load is refused rather than run, and proves nothing against the
checkpoint (an entry removed from the spec, a library upgrade that moved a type): the job ends
with what to do, and nothing is condemned. Rank 0 checks the whole listing once; every other rank
only the files it read, so a failed load's requests per rank do not grow with the world that
wrote the checkpoint. Storage is read, not a node's copy, streamed, never whole into memory.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import zipfile
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import torch.distributed as dist

from tidal import fs
from tidal.errors import CheckpointError
from tidal.storage import DAMAGED, TRUNCATED, Found, check_complete, quarantine
from tidal.worker.checkpoint import safe_load, universal
from tidal.worker.checkpoint.save import libraries_changed

log = logging.getLogger("tidal")
CHUNK = 8 * 2**20  # a damage check holds at most this much of a file at once


def load_failed(found: Found, files: dict[str, int], step_tag: str, error: BaseException) -> Exception:
    """Condemn a checkpoint only when it is proven corrupt; any other failure (out of memory, a
    network error, a bug) fails this attempt, and Ray's restart tries the same checkpoint again. A
    pickle refused by the allow-list condemns nothing and ends the job (`safe_load.refusal`)."""
    why = f"{type(error).__name__}: {error}"
    if (refusal := refused(error)) is not None:
        return safe_load.refusal(refusal, found.path, libraries_changed(found.state))
    try:
        corrupt = _safe_corruption(found, files, step_tag)
    except safe_load.UnsafeCheckpointFile as e:  # the check met a refused pickle this rank did not load
        return safe_load.refusal(e, found.path, libraries_changed(found.state))
    if corrupt is None:
        return CheckpointError(
            f"loading {found.name} failed ({why}). Its files are intact (every size matches its manifest and "
            "every file unpickles), so it is kept: the next attempt loads it again.")
    if step_tag.endswith("_universal"):
        with contextlib.suppress(FileNotFoundError):  # another rank may have discarded it first
            found.fs.delete_file(f"{found.path}/{universal.marker(step_tag)}")
        return CheckpointError(f"the universal conversion of {found.name} is damaged ({corrupt}); it is "
                               "discarded and made again on the next attempt")
    quarantine(found, corrupt)
    return CheckpointError(f"{found.name} is corrupt ({corrupt}) and was quarantined; the next attempt "
                           "resumes from the checkpoint before it")


def refused(error: BaseException) -> safe_load.UnsafeCheckpointFile | None:
    """The allow-list refusal behind `error`, if one is: raised here, or by another rank of a spread
    conversion (which reports it as text, tidal.worker.checkpoint.universal_spread)."""
    seen: BaseException | None = error
    for _ in range(8):
        if seen is None:
            break
        if isinstance(seen, safe_load.UnsafeCheckpointFile):
            return seen if seen.refused else None
        seen = seen.__cause__ or seen.__context__
    text = str(error)
    if f"{safe_load.UnsafeCheckpointFile.__name__}: " in text:
        told = text.split(f"{safe_load.UnsafeCheckpointFile.__name__}: ", 1)[1]
        if named := re.search(r"its pickle names ([\w.]+), a type", told):
            return safe_load.UnsafeCheckpointFile(told, named[1])
    return None


def _checks_listing() -> bool:
    """Whether this rank checks the whole listing after a failed load (rank 0, once); every other
    rank checks the files it read, so its requests do not grow with the world that wrote them."""
    return dist.get_rank() == 0


def _safe_corruption(found: Found, files: dict[str, int], step_tag: str) -> str | None:
    try:
        return _corruption(found, files, step_tag)
    except safe_load.UnsafeCheckpointFile:
        raise  # not damage: the caller says what to do (`safe_load.refusal`)
    except Exception as e:  # noqa: BLE001 - the check could not run: nothing is proven
        log.warning("could not check %s for damage (%s: %s); keeping it", found.name, type(e).__name__, e)
        return None


def _corruption(found: Found, files: dict[str, int], step_tag: str) -> str | None:
    """What proves the checkpoint's files damaged: a size that differs from its manifest, an
    unsafe name, or one of `files` (those this rank read, all listed) whose bytes in storage do
    not unpickle. Rank 0 checks the whole listing (every manifest, or the conversion's marker)
    once; every other rank the sizes of the files it read. None when none holds: a read error, a missing import or a lack of memory says
    nothing about the checkpoint, so it is not condemned for them. Storage is read, not a local
    copy: a copy damaged on this node proves nothing about the checkpoint. Each file is streamed
    (its archive's entries checked in chunks, its pickle read without the tensors' bytes), never
    read whole into memory."""
    if not _checks_listing():
        if (problem := _sizes_differ(found, files, step_tag)) is not None:
            return problem
    elif step_tag.endswith("_universal"):
        if not fs.published(found.fs, f"{found.path}/{step_tag}", f"{found.path}/{universal.marker(step_tag)}"):
            return "its files differ from the conversion's manifest"
    else:
        problem, _ = check_complete(found.fs, found.path)
        if problem is not None and problem.endswith(DAMAGED):
            return problem
    for rel in sorted(r for r in files if r.endswith(".pt")):
        with found.fs.open_input_file(fs.join(f"{found.path}/{step_tag}", rel)) as f:
            damage = file_damage(f)
        if damage is not None:
            return f"{rel} {damage}"
    return None


def _sizes_differ(found: Found, files: dict[str, int], step_tag: str) -> str | None:
    """A file of `files` (those this rank read, relative to the tag folder -> listed size) that
    storage holds at another size, or not at all: one request per file."""
    names = sorted(files)
    infos = found.fs.get_file_info([fs.join(f"{found.path}/{step_tag}", rel) for rel in names])
    for info, rel in zip(infos, names, strict=True):
        if info.type != pafs.FileType.File or info.size != files[rel]:
            got = "missing" if info.type != pafs.FileType.File else f"{info.size} bytes"
            return f"{step_tag}/{rel} is {got}, expected {files[rel]} bytes {TRUNCATED}"
    return None


def file_damage(f: Any) -> str | None:
    """What is wrong with the bytes of one checkpoint file (`f`: a seekable binary file), or None.

    The zip archive's CRCs are checked where it has them, entry by entry in chunks (torch.save
    writes one per entry by default, which catches flipped bits inside tensors too; Tidal's own
    saves write none, see tidal.worker.checkpoint.snapshot._without_crc32), then the pickle is unpickled
    weights-only onto the meta device, which reads the records' headers, not the tensors' bytes.
    A read error propagates rather than counting as damage; a missing class (a library upgrade)
    or a lack of memory is no proof either."""
    if zipfile.is_zipfile(f):
        try:
            f.seek(0)
            bad = _failed_crc(zipfile.ZipFile(f))
        except zipfile.BadZipFile as e:
            return f"is not a readable archive ({e})"
        if bad is not None:
            return f"fails its checksum (entry {bad})"
    f.seek(0)
    if isinstance(f, pa.NativeFile):  # torch's non-zip reader needs readline, which pyarrow's files lack
        f = io.BufferedReader(f)
    try:
        # Weights-only: a pickle naming a type outside the allow-list is refused, never run, and is
        # no proof of damage (it propagates: the caller ends the job); a pickle torch.save never
        # writes (an opcode the weights-only unpickler does not know, no type named) is damage.
        safe_load.safe_load(f, map_location="meta")
    except safe_load.UnsafeCheckpointFile as e:
        if e.refused:  # a type torch named: the allow-list's verdict, not the bytes'
            raise
        return f"does not unpickle ({str(e)[:200]})"  # no global named: bytes torch.save never writes
    except (ImportError, AttributeError, MemoryError, OSError):
        raise
    except Exception as e:  # noqa: BLE001 - any other failure is the bytes'
        return f"does not unpickle ({type(e).__name__}: {str(e)[:200]})"
    return None


def _failed_crc(archive: zipfile.ZipFile) -> str | None:
    """The first entry whose bytes differ from their CRC-32, skipping entries written without
    one (0, as torch.save writes them with its CRCs turned off; a real CRC of 0 is 1 in 2**32)."""
    for info in archive.infolist():
        if info.CRC == 0:
            continue
        try:
            with archive.open(info) as entry:  # zipfile checks the CRC-32 as it reads
                while entry.read(CHUNK):
                    pass
        except zipfile.BadZipFile:
            return info.filename
    return None


def conversion_failed(found: Found, step_tag: str, listed: Callable[[], dict[str, int]],
                      error: CheckpointError) -> Exception | None:
    """What a failed universal conversion of `step_tag` proves: an allow-list refusal (the job ends
    with what to do), damage in the files it read (rank 0, which read them, quarantines the
    checkpoint), or nothing (None: the failure stands and the next attempt converts again).
    `listed`: the tag folder's files, listed only when rank 0 checks them."""
    if (refusal := refused(error)) is not None:
        return safe_load.refusal(refusal, found.path, libraries_changed(found.state))
    if dist.get_rank() != 0:
        return None
    try:
        corrupt = _safe_corruption(found, listed(), step_tag)
    except safe_load.UnsafeCheckpointFile as refused_here:
        return safe_load.refusal(refused_here, found.path, libraries_changed(found.state))
    if corrupt is None:
        return None
    quarantine(found, corrupt)
    return CheckpointError(f"converting {found.name} to a universal checkpoint failed ({corrupt}; "
                           f"quarantined): {error}")
