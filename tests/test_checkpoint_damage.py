"""Only damaged bytes condemn a checkpoint file: a flipped bit, a truncation, garbage; a file that
is fine, or one that cannot be read right now, is never called damaged. No Ray instance."""

from __future__ import annotations

import io

import pyarrow.fs as pafs
import pytest
import torch

from tidal.worker.checkpoint.damage import file_damage
from tidal.worker.checkpoint.snapshot import write_checkpoint

NAME = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


@pytest.fixture
def saved(tmp_path):
    """A file as torch.save writes it by default, with a CRC-32 per record."""
    path = tmp_path / NAME
    torch.save({"state": torch.arange(1000, dtype=torch.float32)}, path)
    return path


@pytest.fixture
def written(tmp_path):
    """The same state as Tidal's checkpoint writer writes it: without CRCs."""
    (tmp_path / "small").mkdir()
    state = {"state": torch.arange(1000, dtype=torch.float32)}
    write_checkpoint(tmp_path / "small", {NAME: state}, pafs.LocalFileSystem(), str(tmp_path / "ckpt"), 0, 1, True)
    assert torch.serialization.get_crc32_options(), "torch's own default is left as it was"
    return tmp_path / "ckpt" / NAME


@pytest.fixture(params=["saved", "written"])
def either(request):
    return request.getfixturevalue(request.param)


def _damage(path):
    with open(path, "rb") as f:
        return file_damage(f)


def test_a_sound_file_is_not_damaged(either):
    assert _damage(either) is None
    assert torch.load(either)["state"].equal(torch.arange(1000, dtype=torch.float32))


def test_one_flipped_bit_inside_a_tensor_is_caught_by_the_checksum(saved):
    data = bytearray(saved.read_bytes())
    data[len(data) // 2] ^= 0x01
    saved.write_bytes(bytes(data))
    assert "checksum" in _damage(saved)


@pytest.mark.parametrize("damage", ["truncated", "zeros"])
def test_truncated_or_overwritten_files_do_not_unpickle(either, damage):
    data = either.read_bytes()
    either.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\0" * len(data))
    assert "does not unpickle" in _damage(either)


def test_a_file_that_cannot_be_read_is_not_proof(tmp_path, saved):
    class Flaky(io.FileIO):
        def read(self, *a):  # a dropped connection half-way through
            if self.tell() > 100:
                raise OSError("connection reset")
            return super().read(*a)

        def readinto(self, b):
            if self.tell() > 100:
                raise OSError("connection reset")
            return super().readinto(b)

    with pytest.raises(OSError), Flaky(saved) as f:  # the caller keeps the checkpoint: nothing is proven
        file_damage(f)


def test_the_check_reads_the_headers_not_the_tensors(tmp_path):
    """After a load failure every file a rank read is checked: a 40 MB file is not read whole
    into memory (Tidal's own saves carry no CRCs, so only the pickle and zip headers are read)."""
    write_checkpoint(tmp_path / "w", {NAME: {"state": torch.zeros(10_000_000)}}, pafs.LocalFileSystem(),
                     str(tmp_path / "ck"), 0, 1, True)
    path = tmp_path / "ck" / NAME

    class Counting(io.FileIO):
        got = 0

        def read(self, *a):
            out = super().read(*a)
            Counting.got += len(out)
            return out

        def readinto(self, b):
            n = super().readinto(b)
            Counting.got += n or 0
            return n

    with Counting(path) as f:
        assert file_damage(f) is None
    assert Counting.got < path.stat().st_size / 100, (Counting.got, path.stat().st_size)
