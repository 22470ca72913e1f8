"""The run folder on shared storage: which checkpoints exist and which are complete.

Ray registers a checkpoint once every rank has reported it, but a driver or worker that dies
right after a report can leave a newer checkpoint that Ray's controller never recorded, or a
half-copied one. So every rank writes a manifest of its files (name -> size) into its part
of the checkpoint; a checkpoint counts as complete only when the manifests of all the ranks
that wrote it are present and every listed file has its listed size. Needs pyarrow, not torch.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs

from tidal.errors import CheckpointError
from tidal.spec.job import JobSpec

log = logging.getLogger("tidal")

CKPT_RE = re.compile(r"^checkpoint_(\d{9})$")
STATE_FILE = "tidal-state.json"  # written by rank 0: step, world size, fingerprint, MLflow run id
JOB_FILE = "tidal-job.json"  # written by the driver at start: MLflow run id, fingerprint
QUARANTINE_FILE = "tidal-quarantined.json"  # a checkpoint that failed to load; never tried again


def checkpoint_dir_name(step: int) -> str:
    return f"checkpoint_{step:09d}"


def manifest_name(rank: int) -> str:
    return f"tidal-manifest-rank{rank:05d}.json"


@dataclass(frozen=True)
class Found:
    """A complete checkpoint: where it is and what rank 0 recorded in it."""

    path: str  # path within `fs`
    fs: pafs.FileSystem
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]


class RunDir:
    """`<checkpoint.storage>/<job name>` on a local path or any pyarrow filesystem URI."""

    def __init__(self, storage: str, name: str) -> None:
        self.fs, root = pafs.FileSystem.from_uri(storage) if "://" in storage else (pafs.LocalFileSystem(), storage)
        self.path = f"{root.rstrip('/')}/{name}"

    def read_json(self, rel: str) -> dict[str, Any] | None:
        try:
            with self.fs.open_input_stream(f"{self.path}/{rel}") as f:
                return json.loads(f.read())
        except (FileNotFoundError, OSError, json.JSONDecodeError):
            return None

    def write_json(self, rel: str, data: dict[str, Any]) -> None:
        self.fs.create_dir(self.path, recursive=True)
        tmp = f"{self.path}/.{rel}.tmp"
        with self.fs.open_output_stream(tmp) as f:
            f.write(json.dumps(data, indent=2).encode())
        self.fs.move(tmp, f"{self.path}/{rel}")

    def checkpoints(self) -> list[str]:
        """Checkpoint folder paths, newest step first."""
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.path, allow_not_found=True))
        except OSError:
            return []
        names = [i.base_name for i in infos if i.type == pafs.FileType.Directory and CKPT_RE.match(i.base_name)]
        return [f"{self.path}/{n}" for n in sorted(names, reverse=True)]

    def latest_complete(self, warn: bool = True) -> Found | None:
        """The newest checkpoint whose every rank finished writing; warns about each one skipped."""
        for path in self.checkpoints():
            problem, state = check_complete(self.fs, path)
            if problem is None:
                return Found(path, self.fs, state)
            if warn:
                log.warning("Skipping checkpoint %s: %s. Falling back to an older one.", path, problem)
        return None


def check_complete(fs: pafs.FileSystem, path: str) -> tuple[str | None, dict[str, Any]]:
    """(None, state) when complete, else (what is wrong, {})."""
    try:
        with fs.open_input_stream(f"{path}/{QUARANTINE_FILE}") as f:
            return f"quarantined after it failed to load ({json.loads(f.read()).get('error', '?')})", {}
    except (FileNotFoundError, OSError, ValueError):
        pass
    try:
        with fs.open_input_stream(f"{path}/{STATE_FILE}") as f:
            state = json.loads(f.read())
        world_size = int(state["world_size"])
    except (FileNotFoundError, OSError, ValueError, KeyError):
        return f"{STATE_FILE} is missing or unreadable (the save did not finish)", {}
    for rank in range(world_size):
        try:
            with fs.open_input_stream(f"{path}/{manifest_name(rank)}") as f:
                files: dict[str, int] = json.loads(f.read())["files"]
        except (FileNotFoundError, OSError, ValueError, KeyError):
            return f"rank {rank} of {world_size} never finished writing its files", {}
        infos = fs.get_file_info([f"{path}/{name}" for name in files])
        for info, (name, size) in zip(infos, files.items(), strict=True):
            if info.type != pafs.FileType.File or info.size != size:
                got = "missing" if info.type != pafs.FileType.File else f"{info.size} bytes"
                return f"{name} is {got}, expected {size} bytes (truncated save)", {}
    return None, state


def quarantine(found: Found, error: BaseException) -> None:
    """Mark a checkpoint that failed to load so no resume picks it again (its files stay for a person)."""
    with found.fs.open_output_stream(f"{found.path}/{QUARANTINE_FILE}") as f:
        f.write(json.dumps({"error": f"{type(error).__name__}: {error}"[:500]}).encode())
    log.warning("Quarantined %s: it failed to load (%s); the next attempt uses an older checkpoint.", found.path, error)


def find_resume_point(spec: JobSpec) -> Found | None:
    """The newest complete checkpoint of this job, checked against the spec (driver or worker)."""
    found = RunDir(spec.checkpoint.storage, spec.name).latest_complete()
    if found is not None:
        check_compatible(spec, found.state)
    return found


def check_compatible(spec: JobSpec, state: dict[str, Any]) -> None:
    saved, now = state.get("fingerprint", {}), spec.resume_fingerprint()
    diffs = [f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    if diffs:
        raise CheckpointError(
            f"cannot resume job {spec.name!r} from step {state.get('step')}: these fields changed "
            f"since its checkpoints were written:\n  " + "\n  ".join(diffs)
            + "\nRestore them, pick another job name, or start over with `tidal run --restart`."
        )
    stages, written = spec.parallelism.pipeline_stages, state.get("world_size")
    if stages > 1 and written != spec.scaling.max_workers:
        raise CheckpointError(
            f"cannot resume pipeline job {spec.name!r} from step {state.get('step')} with {spec.scaling.max_workers} "
            f"workers: its checkpoints were written by {written}, and pipeline checkpoints load only at the world size "
            f"that wrote them. Set scaling.min_workers = scaling.max_workers = {written}, or start over with `tidal run --restart`."
        )
