"""DeepSpeed only ever reads files Tidal checked, on every storage. Its universal loader lists each
`zero/<param>/` folder and unpickles every `*.pt` in it without weights-only; here a loader that
does the same (stricter: every `*.pt` under the folder it is handed) stands in for it inside the
real restore (a process group of one, gloo). A pickle planted in a published universal folder on
a local filesystem never runs; a listed file swapped in storage right after Tidal's check (as a
writer on a shared filesystem could) is never what the loader reads. No Ray."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow.fs as pafs
import torch

from tests.fakes import evil
from tidal import fs
from tidal.storage import Found
from tidal.worker.checkpoint import fetch, restore, safe_load, universal
from tidal.worker.checkpoint.route import Convert, Load, Route


class UnsafeLoader:
    """Loads as DeepSpeed's universal loader does: `torch.load(weights_only=False)` of every file
    it finds in the folder (where DeepSpeed lists `zero/<param>/`, this lists everything)."""

    optimizer = None

    def __init__(self) -> None:
        self.read: dict[str, object] = {}
        self.checkpoint_engine = object()

    def load_checkpoint(self, load_dir: str, tag: str, **_: object) -> tuple[str, dict]:
        for folder, _dirs, names in os.walk(os.path.join(load_dir, tag)):
            for name in names:
                path = os.path.join(folder, name)
                self.read[os.path.relpath(path, os.path.join(load_dir, tag))] = torch.load(path, weights_only=False)
        return load_dir, {}


def published_universal(tmp_path: Path) -> Found:
    """A checkpoint written at 2 ranks whose universal conversion an earlier attempt published,
    on a local (or shared) filesystem."""
    path = tmp_path / "runs" / "job" / "checkpoint_000000008"
    out = tmp_path / "made"
    (out / "zero" / "w").mkdir(parents=True)
    torch.save({"module": {"w": torch.ones(3)}}, out / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": {"state": {}}}, out / "zero" / "optimizer_state.pt")
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        torch.save({"param": torch.full((3,), 2.0)}, out / "zero" / "w" / f"{key}.pt")
    local = pafs.LocalFileSystem()
    fs.publish_dir(str(out), local, f"{path}/global_step8_universal", f"{path}/{universal.marker('global_step8')}",
                   id="conversion-1")
    return Found(str(path), local, {"step": 8, "world_size": 2, "zero_stage": 2, "attempt": "a"}, files={})


def test_a_pickle_planted_in_a_published_universal_folder_never_runs(tmp_path, group, monkeypatch):
    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "cache"))
    found = published_universal(tmp_path)
    marker = tmp_path / "ran"
    planted = Path(found.path) / "global_step8_universal" / "zero" / "w"
    (planted / "evil.pt").write_bytes(evil(marker))
    (planted / "exp_avg.pt.bak").write_bytes(evil(marker))

    engine = UnsafeLoader()
    restore.restore(engine, found, Route(Load.UNIVERSAL, Convert.SPREAD))

    assert not marker.exists(), "the planted pickle ran"
    assert sorted(engine.read) == ["mp_rank_00_model_states.pt", "zero/optimizer_state.pt", "zero/w/exp_avg.pt",
                                   "zero/w/exp_avg_sq.pt", "zero/w/fp32.pt"], "only the listed files were there"
    assert torch.equal(engine.read["zero/w/fp32.pt"]["param"], torch.full((3,), 2.0))


def test_a_listed_file_swapped_after_the_check_is_never_loaded(tmp_path, group, monkeypatch):
    """The swap happens right after Tidal's weights-only check, before DeepSpeed reads: what it
    reads is the private copy that was checked, not the storage file."""
    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "cache"))
    found = published_universal(tmp_path)
    marker = tmp_path / "ran"
    target = Path(found.path) / "global_step8_universal" / "zero" / "w" / "fp32.pt"
    checked = safe_load.check_files

    def check_then_swap(folder: str, files: object) -> None:
        checked(folder, files)
        target.write_bytes(evil(marker, target.stat().st_size))  # same size: only unpickling could tell

    monkeypatch.setattr(safe_load, "check_files", check_then_swap)
    engine = UnsafeLoader()
    restore.restore(engine, found, Route(Load.UNIVERSAL, Convert.SPREAD))

    assert not marker.exists(), "the swapped file was loaded"
    assert torch.equal(engine.read["zero/w/fp32.pt"]["param"], torch.full((3,), 2.0)), "the checked bytes were read"


def test_a_checkpoint_on_a_local_filesystem_is_loaded_from_a_private_copy(tmp_path, group, monkeypatch):
    """Same-size restores too: DeepSpeed is handed the node's private folder, never storage."""
    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "cache"))
    path = tmp_path / "runs" / "job" / "checkpoint_000000008"
    (path / "global_step8").mkdir(parents=True)
    torch.save({"module": {"w": torch.ones(3)}}, path / "global_step8" / "mp_rank_00_model_states.pt")
    (path / "global_step8" / "zero_pp_rank_0_evil.pt").write_bytes(evil(tmp_path / "ran"))  # unlisted
    size = (path / "global_step8" / "mp_rank_00_model_states.pt").stat().st_size
    found = Found(str(path), pafs.LocalFileSystem(), {"step": 8, "world_size": 1, "zero_stage": 2, "attempt": "a"},
                  files={"global_step8/mp_rank_00_model_states.pt": size})

    engine = UnsafeLoader()
    restore.restore(engine, found, Route(Load.AS_SAVED))
    assert list(engine.read) == ["mp_rank_00_model_states.pt"] and not (tmp_path / "ran").exists()
    folders = os.listdir(tmp_path / "cache")
    assert len(folders) == 1 and (os.stat(tmp_path / "cache" / folders[0]).st_mode & 0o077) == 0, "private"
