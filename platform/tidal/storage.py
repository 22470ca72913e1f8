"""The run folder on shared storage: which checkpoints exist and which are complete.

Ray registers a checkpoint once every rank has reported it, but a driver or worker that dies
right after a report can leave a newer checkpoint that Ray's controller never recorded, or a
half-copied one. So every rank writes a manifest of its files (name -> size) into its part
of the checkpoint; a checkpoint counts as complete only when the manifests of all the ranks
that wrote it are present, all of the attempt (worker-group start) that wrote rank 0's state
file, and every listed file has its listed size. It is those listed files and nothing else in
its folder (`listed_files`). Needs pyarrow, not torch.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs

from tidal import fs
from tidal.errors import CheckpointError
from tidal.fs import UnsafeName, checked_files
from tidal.spec.job import JobSpec

log = logging.getLogger("tidal")

CKPT_RE = re.compile(r"^checkpoint_(\d{9})$")
CKPT_NAME = re.compile(r"checkpoint_\d{9}")
RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's list of registered checkpoints
STATE_FILE = "tidal-state.json"  # written by rank 0: step, world size, ZeRO stage, fingerprint, attempt
JOB_FILE = "tidal-job.json"  # written by the driver at start: MLflow run id, fingerprint
QUARANTINE_FILE = "tidal-quarantined.json"  # a checkpoint proven corrupt; never tried again
TRUNCATED = "(truncated save)"
# A manifest naming a file outside its checkpoint (absolute, `..`): never read, condemned like a
# truncated save (tidal.fs.check_name).
UNSAFE = "(unsafe name)"
DAMAGED = (TRUNCATED, UNSAFE)  # problems that prove a checkpoint damaged
# A storage error while checking (a flaky mount, a 503): nothing is known about the checkpoint, so
# it is skipped for now but never cleared or condemned for it.
UNREADABLE = "could not read"


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
    # The files its manifests list (relative path -> size), names checked; None: not read yet
    # (`listed_files` reads them). Rank 0 reads them once and hands them to every rank.
    files: dict[str, int] | None = field(default=None, compare=False)

    @property
    def step(self) -> int:
        return int(self.state["step"])

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]


class RunDir:
    """`<checkpoint.storage>/<job name>` on a local path or any pyarrow filesystem URI."""

    def __init__(self, storage: str, name: str) -> None:
        self.fs, root = fs.resolve(storage)
        self.path = f"{root}/{name}"

    def read_json(self, rel: str) -> dict[str, Any] | None:
        return fs.read_json(self.fs, f"{self.path}/{rel}")

    def write_json(self, rel: str, data: dict[str, Any]) -> None:
        fs.write_json(self.fs, f"{self.path}/{rel}", data)

    def exists(self) -> bool:
        return fs.exists(self.fs, self.path)

    def checkpoints(self) -> list[str]:
        """Checkpoint folder paths, newest step first."""
        names = [i.base_name for i in fs.list_dir(self.fs, self.path)
                 if i.type == pafs.FileType.Directory and CKPT_RE.match(i.base_name)]
        return [f"{self.path}/{n}" for n in sorted(names, reverse=True)]

    def latest_complete(self, warn: bool = True, condemn_truncated: bool = False) -> Found | None:
        """The newest checkpoint whose every rank finished writing; warns about each one skipped.

        `condemn_truncated` quarantines one whose every rank listed its files but a file's size
        differs: proven damaged. Only the driver at start asks for it, when no save can be in flight.
        """
        for path in self.checkpoints():
            problem, state, files = complete_listing(self.fs, path)
            if problem is None:
                return Found(path, self.fs, state, files)
            if warn:
                log.warning("Skipping checkpoint %s: %s. Falling back to an older one.", path, problem)
            if condemn_truncated and problem.endswith(DAMAGED):
                quarantine(Found(path, self.fs, {}), problem)
        return None

    def set_aside(self) -> str | None:
        """--restart: keep the old run folder under a new name rather than deleting anyone's work."""
        if not self.exists():
            return None
        aside = f"{self.path}.replaced-{time.strftime('%Y%m%d-%H%M%S')}"
        n = 1
        while fs.exists(self.fs, aside):  # two restarts within a second
            aside, n = f"{self.path}.replaced-{time.strftime('%Y%m%d-%H%M%S')}-{n}", n + 1
        try:
            fs.set_aside(self.fs, self.path, aside)
        except OSError as e:
            raise CheckpointError(f"could not set {self.path} aside for --restart ({e}); nothing was deleted "
                                  "(a partial copy may sit beside it). Run the same command again.") from e
        return aside

    def prune(self, keep: int, spare: Collection[str] = ()) -> list[str]:
        """Delete the checkpoints Ray's retention never sees, those it did not register and never
        will (reported just before a crash, or written by an earlier driver), once `keep` newer
        complete ones exist, except those in `spare` (the best, under keep_best); returns the
        folders deleted.

        Only checkpoints older than the one Ray registered last count as never registered: Ray
        registers in report order, and with asynchronous uploads it registers a checkpoint only
        once every rank's write has ended and its controller has polled the reports, which can be
        several checkpoints behind at short intervals. A newer complete one is on its way; deleting
        it would make Ray's own retention fail on it later, and the job with it."""
        registered, latest = self._ray_registered()
        if latest is None:
            return []  # Ray has registered nothing yet: nothing is known to be behind it
        plan = prune_plan(self.checkpoints(), lambda p: check_complete(self.fs, p)[0] is None, keep)
        names = {p: p.rsplit("/", 1)[-1] for p in plan}
        doomed = [p for p in plan if names[p] not in registered and names[p] < latest and p not in spare]
        for path in doomed:
            try:
                fs.delete_dir(self.fs, path)
            except OSError as e:  # e.g. Ray deleting the same folder: the next prune tries again
                log.debug("could not delete %s: %s", path, e)
        return doomed

    def _ray_registered(self) -> tuple[set[str], str | None]:
        """From Ray's snapshot of its checkpoint manager: the checkpoints it registered (it deletes
        those itself, num_to_keep, and refuses to resume a run whose registered checkpoint is
        gone, so Tidal leaves them be) and the one it registered last (None: none yet)."""
        try:
            with self.fs.open_input_stream(f"{self.path}/{RAY_SNAPSHOT}") as f:
                text = f.read().decode(errors="replace")
            latest = (json.loads(text).get("latest_checkpoint_result") or {}).get("checkpoint_dir_name")
        except (FileNotFoundError, OSError, ValueError, AttributeError):
            return set(), None
        return set(CKPT_NAME.findall(text)), latest if isinstance(latest, str) else None


def prune_plan(newest_first: list[str], complete: Callable[[str], bool], keep: int) -> list[str]:
    """Everything older than the `keep` newest complete checkpoints. Nothing newer than the oldest
    kept is touched (a save may be in flight there), and nothing older is checked at all."""
    found = 0
    for i, path in enumerate(newest_first):
        found += complete(path)
        if found == keep:
            return newest_first[i + 1:]
    return []


def check_complete(fs: pafs.FileSystem, path: str) -> tuple[str | None, dict[str, Any]]:
    """(None, state) when complete, else (what is wrong, {}); see `complete_listing`."""
    problem, state, _ = complete_listing(fs, path)
    return problem, state


def complete_listing(fs: pafs.FileSystem, path: str) -> tuple[str | None, dict[str, Any], dict[str, int]]:
    """(None, state, listed files) when complete, else (what is wrong, {}, {}).

    Complete: rank 0's state file names the world size and the attempt (one worker-group start)
    that wrote it, and every rank below that world size has a manifest of the same attempt and
    step whose files are all there at their sizes, every name a plain relative one
    (tidal.fs.check_name). A folder written into by two attempts (a save that died, then the
    same step saved again after a resume) holds files of both; only the manifests of the state
    file's attempt say which are this checkpoint's."""
    try:
        with fs.open_input_stream(f"{path}/{QUARANTINE_FILE}") as f:
            return f"quarantined as corrupt ({json.loads(f.read()).get('error', '?')})", {}, {}
    except (FileNotFoundError, OSError, ValueError):
        pass
    try:
        with fs.open_input_stream(f"{path}/{STATE_FILE}") as f:
            state = json.loads(f.read())
        world_size = int(state["world_size"])
    except (FileNotFoundError, ValueError, KeyError):
        return f"{STATE_FILE} is missing or unreadable (the save did not finish)", {}, {}
    except OSError as e:
        return f"{UNREADABLE} {STATE_FILE} ({e})", {}, {}
    listed: dict[str, int] = {}
    for rank in range(world_size):
        try:
            manifest = fs_read_manifest(fs, path, rank)
            files = checked_files(manifest["files"])
        except UnsafeName as e:
            return f"rank {rank}'s manifest lists {e} {UNSAFE}", {}, {}
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return f"rank {rank} of {world_size} never finished writing its files", {}, {}
        except OSError as e:
            return f"{UNREADABLE} rank {rank}'s manifest ({e})", {}, {}
        if (other := other_attempt(state, manifest)) is not None:
            return f"rank {rank}'s manifest is {other}: the save of this attempt did not finish", {}, {}
        infos = fs.get_file_info([f"{path}/{name}" for name in files])
        for info, (name, size) in zip(infos, files.items(), strict=True):
            if info.type != pafs.FileType.File or info.size != size:
                got = "missing" if info.type != pafs.FileType.File else f"{info.size} bytes"
                return f"{name} is {got}, expected {size} bytes {TRUNCATED}", {}, {}
        listed.update(files)
    return None, state, listed


def other_attempt(state: dict[str, Any], manifest: dict[str, Any]) -> str | None:
    """Why a rank's manifest belongs to another save than the state file's, or None.

    Checkpoints written before attempts were recorded carry none: their manifests are taken as
    they are (the step, which every manifest has, must still match)."""
    if "step" in manifest and int(manifest["step"]) != int(state.get("step", -1)):
        return f"of step {manifest['step']}, not {state.get('step')}"
    if state.get("attempt") is not None and manifest.get("attempt") != state["attempt"]:
        return f"of attempt {manifest.get('attempt')!r}, not {state['attempt']!r}"
    return None


def listed_files(fs: pafs.FileSystem, path: str) -> dict[str, int]:
    """The files that make up the checkpoint at `path` (relative path -> size): those the
    manifests of the attempt that wrote it list (see `complete_listing`). Whatever else sits in the
    folder (another attempt's files, a rank that no longer exists) is no part of it, and nothing
    reads it (conversion, export, damage checks). Empty when the checkpoint is not complete."""
    return complete_listing(fs, path)[2]


def fs_read_manifest(fs: pafs.FileSystem, path: str, rank: int) -> dict[str, Any]:
    with fs.open_input_stream(f"{path}/{manifest_name(rank)}") as f:
        return json.loads(f.read())


def stale_checkpoints(newest_first: list[str], problems: Callable[[str], str | None], first_step: int) -> list[str]:
    """The checkpoint folders an attempt whose first save is of `first_step` must clear before it
    writes: every one of that step or later that is neither complete nor quarantined. This
    attempt resumed from a checkpoint older than `first_step` (the newest complete one), so what
    lies there was left by saves that died; it would otherwise mix with this attempt's files when
    the same step is saved again. A complete or quarantined one is never touched, nor one that
    could not be read (a storage error proves nothing about it)."""
    out = []
    for path in newest_first:
        m = CKPT_RE.match(path.rstrip("/").rsplit("/", 1)[-1])
        if m is None or int(m.group(1)) < first_step:
            continue
        problem = problems(path)
        if problem is not None and not problem.startswith(("quarantined", UNREADABLE)):
            out.append(path)
    return out


def clear_stale(store: pafs.FileSystem, run_path: str, first_step: int) -> list[str]:
    """Delete the folders `stale_checkpoints` names under the run folder `run_path`; returns them.

    Rank 0 calls it at an attempt's first save, before any rank writes (the others wait for the
    attempt id it hands out then), and no rank of the attempt before is alive (Ray restarts the
    whole group), so nothing writes into these folders meanwhile. A deletion, not a rename: an
    object store has none for folders (see tidal.fs)."""
    names = [i.base_name for i in fs.list_dir(store, run_path)
             if i.type == pafs.FileType.Directory and CKPT_RE.match(i.base_name)]
    paths = [f"{run_path}/{n}" for n in sorted(names, reverse=True)]
    doomed = stale_checkpoints(paths, lambda p: check_complete(store, p)[0], first_step)
    for path in doomed:
        log.warning("Clearing %s: a save that died left it incomplete, and this attempt saves that step again", path)
        try:
            fs.delete_dir(store, path)
        except OSError as e:  # what is left counts for nothing (check_complete, listed_files): go on
            log.warning("could not clear %s (%s); its files stay, unread", path, e)
    return doomed


def quarantine(found: Found, reason: str) -> None:
    """Mark a checkpoint proven corrupt so no resume picks it again (its files stay for a person)."""
    with found.fs.open_output_stream(f"{found.path}/{QUARANTINE_FILE}") as f:
        f.write(json.dumps({"error": reason[:500]}).encode())
    log.warning("Quarantined %s: %s; the next attempt uses an older checkpoint.", found.path, reason)


def find_resume_point(spec: JobSpec, condemn_truncated: bool = False) -> Found | None:
    """The newest complete checkpoint of this job, checked against the spec (driver or rank 0)."""
    found = RunDir(spec.checkpoint.storage, spec.name).latest_complete(condemn_truncated=condemn_truncated)
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
