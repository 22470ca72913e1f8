"""Only damaged bytes condemn a checkpoint file: a flipped bit, a truncation, garbage; a file that
is fine, or one that cannot be read right now, is never called damaged. No Ray instance."""

from __future__ import annotations

import pytest
import torch

from tidal.worker.checkpoint import _damage


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"state": torch.arange(1000, dtype=torch.float32)}, path)
    return path


def test_a_sound_file_is_not_damaged(saved):
    assert _damage(saved) is None


def test_one_flipped_bit_inside_a_tensor_is_caught_by_the_checksum(saved):
    data = bytearray(saved.read_bytes())
    data[len(data) // 2] ^= 0x01
    saved.write_bytes(bytes(data))
    assert "checksum" in _damage(saved)


@pytest.mark.parametrize("damage", ["truncated", "zeros"])
def test_truncated_or_overwritten_files_do_not_unpickle(saved, damage):
    data = saved.read_bytes()
    saved.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\0" * len(data))
    assert "does not unpickle" in _damage(saved)


def test_a_file_that_cannot_be_read_is_not_proof(tmp_path):
    with pytest.raises(OSError):  # the caller keeps the checkpoint: nothing is proven
        _damage(tmp_path / "gone.pt")
