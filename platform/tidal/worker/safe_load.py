"""Loading a checkpoint file never runs code: `torch.load(weights_only=True)` with an allow-list
of exactly the types DeepSpeed puts in the files Tidal's trainer saves.

A pickle can name any callable; whoever can write one object under a run's prefix would run code
on every rank that unpickles it, with the nodes' credentials. torch's weights-only unpickler
refuses every global outside its defaults and the list below (checked against DeepSpeed 0.19.8
and torch 2.13 with ZeRO 1-3, fp32/bf16/fp16: `torch.serialization.get_unsafe_globals_in_checkpoint`
named these and no others). DeepSpeed's own loaders that pass `weights_only=False` (the universal
conversion and loader, zero_to_fp32) only ever see folders whose files the manifests list.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import zipfile
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from tidal.errors import CheckpointError


def allowed_globals() -> list[Any]:
    """The non-torch types in DeepSpeed's checkpoint files: the loss scaler (optimizer states of
    every precision), `zero_stage` (ZeRO optimizer states), param slice mappings (ZeRO-1/2, bf16).
    Imported on use: `tidal export`'s import must not pull in DeepSpeed."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


class UnsafeCheckpointFile(CheckpointError):
    """A checkpoint file whose pickle names a type outside the allow-list: refused, never run."""


def safe_load(f: Any, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """`torch.load` that refuses (UnsafeCheckpointFile) any pickle naming a type outside the
    allow-list, instead of calling it."""
    with torch.serialization.safe_globals(allowed_globals()):
        try:
            return torch.load(f, map_location=map_location, weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as e:
            name = f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", "the file")
            raise UnsafeCheckpointFile(
                f"refused to load {name}: its pickle names a type outside the allow-list of what Tidal's "
                f"checkpoints hold, so loading it could run code ({str(e).splitlines()[0][:200]})") from e


class SafeLoadEngine:
    """Wraps an engine's DeepSpeed checkpoint engine for `engine.load_checkpoint`, which reads the
    model and optimizer states through its `load`: weights-only here, the rest delegated."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def load(self, path: str, map_location: Any = None) -> Any:
        return safe_load(path, map_location=map_location)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@contextlib.contextmanager
def safe_loading(engine: Any) -> Iterator[None]:
    """While inside, `engine.load_checkpoint` unpickles weights-only."""
    before = engine.checkpoint_engine
    engine.checkpoint_engine = SafeLoadEngine(before)
    try:
        yield
    finally:
        engine.checkpoint_engine = before


def check_files(folder: str, files: Iterable[str]) -> None:
    """Unpickle each `.pt` of `files` (relative to `folder`) weights-only, before a DeepSpeed
    loader that does not (universal checkpoints, zero_to_fp32) reads them: UnsafeCheckpointFile
    for the first that names a type outside the allow-list. Zip archives are memory-mapped, so
    the check reads the pickles, not the tensors."""
    for rel in sorted(r for r in files if r.endswith(".pt")):
        path = os.path.join(folder, rel)
        safe_load(path, mmap=zipfile.is_zipfile(path))
