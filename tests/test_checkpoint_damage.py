"""Only damaged bytes condemn a checkpoint file: a flipped bit, a truncation, garbage; a file that
is fine, or one that cannot be read right now, is never called damaged. No Ray instance."""

from __future__ import annotations

import pyarrow.fs as pafs
import pytest
import torch

from tidal.worker.restore import _damage
from tidal.worker.snapshot import write_checkpoint

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


def test_a_file_that_cannot_be_read_is_not_proof(tmp_path):
    with pytest.raises(OSError):  # the caller keeps the checkpoint: nothing is proven
        _damage(tmp_path / "gone.pt")
