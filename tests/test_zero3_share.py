"""A ZeRO-3 rank fetches only its share of a universal checkpoint: through the real restore (a
process group of one, the rank and world of a larger group set per simulated rank), each rank
reads about 1/world of the parameters' optimizer files by byte range (counted by a filesystem
that counts the bytes it returns, as S3 bills ranged GETs), and what DeepSpeed's ZeRO-3 loader
keeps of each file (the flattened tensor, padded, narrowed to the rank's partition: the lines of
`stage3.load_hp_checkpoint_state` in 0.19.8) equals what it keeps from the whole file. No Ray."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pytest
import torch

from tests.fakes import Counting
from tidal import fs
from tidal.storage import Found
from tidal.worker.checkpoint import fetch, restore, share, universal
from tidal.worker.checkpoint.route import Convert, Load, Route

PARAMS = {"tok.weight": (1024, 512), "blocks.0.w": (512, 512), "blocks.0.b": (7,), "ln_f.bias": (1,)}


class CountingBytes(Counting):
    """Counts the bytes each opened file returns too."""

    def __init__(self) -> None:
        super().__init__()
        self.read_bytes = 0

    def open_input_file(self, path: str) -> Any:
        self.calls["read"] += 1
        outer = self

        class Reader:
            def __init__(self) -> None:
                self.f = open(path, "rb")  # noqa: SIM115 - closed by pyarrow's PythonFile
                self.closed = False

            def read(self, n: int = -1) -> bytes:
                out = self.f.read(n)
                outer.read_bytes += len(out)
                return out

            def seek(self, pos: int, whence: int = 0) -> int:
                return self.f.seek(pos, whence)

            def tell(self) -> int:
                return self.f.tell()

            def close(self) -> None:
                self.closed = True
                self.f.close()

            def readable(self) -> bool:
                return True

            def seekable(self) -> bool:
                return True

        return pa.PythonFile(Reader(), mode="r")

    def open_input_stream(self, path: str) -> Any:
        return self.open_input_file(path)


def universal_folder(tmp: Path) -> tuple[Found, dict[str, torch.Tensor]]:
    path = tmp / "runs" / "job" / "checkpoint_000000008"
    out = tmp / "made"
    saved = {}
    (out / "zero").mkdir(parents=True)
    torch.save({"module": {}}, out / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": {"state": {0: {"step": 8}}}}, out / "zero" / "optimizer_state.pt")
    for name, shape in PARAMS.items():
        (out / "zero" / name).mkdir()
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            saved[f"{name}/{key}"] = torch.randn(shape)
            torch.save({"param": saved[f"{name}/{key}"], "cat_dim": 0}, out / "zero" / name / f"{key}.pt")
        torch.save(torch.tensor(8.0), out / "zero" / name / "step.pt")
    local = pafs.LocalFileSystem()
    fs.publish_dir(str(out), local, f"{path}/global_step8_universal", f"{path}/{universal.marker('global_step8')}", id="c")
    return Found(str(path), local, {"step": 8, "world_size": 3, "zero_stage": 3, "attempt": "a"}, files={}), saved


class Zero3Loader:
    """Keeps, of each parameter's optimizer file, what DeepSpeed's ZeRO-3 loader keeps."""

    optimizer = None
    checkpoint_engine = None

    def __init__(self, world: int, rank: int) -> None:
        self.world, self.rank, self.kept = world, rank, {}

    def zero_optimization_stage(self) -> int:
        return 3

    def load_checkpoint(self, load_dir: str, tag: str, **_: Any) -> tuple[str, dict]:
        for name in PARAMS:
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                loaded = torch.load(os.path.join(load_dir, tag, "zero", name, f"{key}.pt"), weights_only=False)
                flat = loaded["param"].view(-1)
                per = math.ceil(flat.numel() / self.world)
                padded = torch.cat([flat, torch.zeros(self.world * per - flat.numel())])
                self.kept[f"{name}/{key}"] = padded.narrow(0, self.rank * per, per)
        return load_dir, {}


@pytest.mark.parametrize("world", [2, 4])
def test_a_zero3_rank_reads_its_share_and_loads_what_the_whole_file_gives(tmp_path, group, monkeypatch, world):
    found, saved = universal_folder(tmp_path)
    handler = CountingBytes()
    found = Found(found.path, pafs.PyFileSystem(handler), found.state)  # as an object store: ranged reads
    optimizer_bytes = sum(size for rel, size in fs.files_under(pafs.LocalFileSystem(), f"{found.path}/global_step8_universal").items()
                          if share.sliced(rel))
    tensor_bytes = sum(t.numel() * 4 for t in saved.values())
    reads = []
    for rank in range(world):
        monkeypatch.setattr(restore, "_dp_share", lambda engine, r=rank: (world, r))
        monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / f"node-{rank}"))
        engine = Zero3Loader(world, rank)
        handler.read_bytes = 0
        restore.restore(engine, found, Route(Load.UNIVERSAL_ZERO3, Convert.SPREAD))
        reads.append(handler.read_bytes)
        for key, whole in saved.items():
            per = math.ceil(whole.numel() / world)
            expected = torch.cat([whole.view(-1), torch.zeros(world * per - whole.numel())]).narrow(0, rank * per, per)
            assert torch.equal(engine.kept[key], expected), (rank, key)

    listed = fs.files_under(pafs.LocalFileSystem(), f"{found.path}/global_step8_universal")
    whole = sum(size for rel, size in listed.items() if not share.sliced(rel))  # read whole by every rank
    print(f"world {world}: bytes read per rank {reads}; the optimizer files hold {optimizer_bytes} "
          f"({tensor_bytes} of tensors), the rest {whole}")
    # A rank's tensor bytes: its partition of each (ceil(numel / world) elements), plus each
    # archive's two ends, read once to find the tensor and its records (share.EDGE each).
    for got in reads:
        assert got - whole <= tensor_bytes / world + len(saved) * 2 * share.EDGE, (got, tensor_bytes, world)
    assert max(reads) < (0.5 + 0.1) * (whole + optimizer_bytes) * 2 / world, "about half at 2 ranks, a quarter at 4"
    sparse = [p for p in (tmp_path / "node-1").rglob("fp32.pt") if not p.is_symlink()]
    assert sparse, "the rank's slices are files of its own"


def test_a_second_restore_of_the_same_share_on_a_node_reuses_its_links(tmp_path, monkeypatch):
    """A ZeRO-3 rank restarting on its node after a resize (the same checkpoint, world and rank) finds
    its share's folder from the first restore, whose links lead into the node's copy: it must take
    them, not refuse them as leading outside the folder (every such restart failed)."""
    found, _ = universal_folder(tmp_path)
    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "node"))
    tag = "global_step8_universal"
    files = fs.files_under(pafs.LocalFileSystem(), f"{found.path}/{tag}")
    for attempt in range(2):
        with fetch.tag_folder(found.fs, found.path, tag, files, "job", "same", share=(2, 0)) as (load_dir, got):
            loaded = torch.load(os.path.join(load_dir, tag, "zero", "optimizer_state.pt"), weights_only=False)
            assert loaded["optimizer_state_dict"]["state"][0]["step"] == 8
            if attempt:
                assert got.downloaded == {}, "the node's copies and this rank's slices are reused"
