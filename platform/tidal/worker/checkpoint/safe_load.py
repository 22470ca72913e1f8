"""Loading a checkpoint file never runs code: `torch.load(weights_only=True)` with an allow-list
of exactly the types DeepSpeed puts in the files Tidal's trainer saves.

A pickle can name any callable; whoever can write one object under a run's prefix would run code
on every rank that unpickles it, with the nodes' credentials. torch's weights-only unpickler
refuses every global outside its defaults and the list below (checked against DeepSpeed 0.19.8
and torch 2.13 with ZeRO 1-3, fp32/bf16/fp16: `torch.serialization.get_unsafe_globals_in_checkpoint`
named these and no others), plus what the job lists in `checkpoint.safe_globals` (`allow`): a
model whose own state holds other types (a numpy value in `get_extra_state()`) says so in its
spec. Such a state fails loudly at the first save (`check_saveable`), naming the types and the
field, rather than being written into checkpoints that would each be refused, and condemned, on
restore. DeepSpeed's own loaders that pass `weights_only=False` (the universal conversion and
loader, zero_to_fp32) only ever see private copies of listed files, checked here first.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import pickle
import re
import threading
import zipfile
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import _weights_only_unpickler as weights_only  # torch's own list of what it loads

from tidal.errors import CheckpointError, UserCodeError


def allowed_globals() -> list[Any]:
    """The non-torch types in DeepSpeed's checkpoint files: the loss scaler (optimizer states of
    every precision), `zero_stage` (ZeRO optimizer states), param slice mappings (ZeRO-1/2, bf16).
    Imported on use: `tidal export`'s import must not pull in DeepSpeed."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address, *_extra]


_extra: list[Any] = []  # this job's checkpoint.safe_globals, resolved (`allow`)
_checked: set[str] = set()  # files whose state `check_saveable` found loadable in this process
FIELD = "checkpoint.safe_globals"
# torch's weights-only refusal names the global it met (`Unsupported global: GLOBAL mod.Name`): a
# refusal that names one is the allow-list at work, not damage.
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_loading = threading.Lock()


def allow(names: Iterable[str]) -> None:
    """Add the job's `checkpoint.safe_globals` (dotted names, as torch prints them) to this
    process's allow-list, for every load and save check that follows."""
    _extra[:] = [resolve(name) for name in names]
    _checked.clear()


def resolve(name: str) -> Any:
    """The object a dotted name (`numpy.dtype`, `numpy._core.multiarray._reconstruct`, or
    `module:attr`) names; CheckpointError saying which field when nothing importable has it."""
    module, _, attr = name.partition(":") if ":" in name else name.rpartition(".")
    while module:
        try:
            obj: Any = importlib.import_module(module)
            for part in attr.split("."):
                obj = getattr(obj, part)
            return obj
        except (ImportError, AttributeError):
            if ":" in name:
                break
            module, _, head = module.rpartition(".")
            attr = f"{head}.{attr}"
    raise CheckpointError(f"{FIELD}: {name!r} names nothing importable here; write it as torch names it "
                          "(module.name, e.g. numpy.dtype) and check the module is installed on the workers")


class UnsafeState(CheckpointError):
    """A state to save that a weights-only load would refuse: every checkpoint would be condemned."""


def unsafe_globals(state: Any) -> list[str]:
    """The types and functions (module.name) a weights-only load of `state`, once saved, would
    refuse. Its structure is pickled as torch.save does (protocol 2) with the tensors' bytes left
    out, then unpickled by torch's weights-only unpickler onto the meta device; each refusal is
    noted and allowed for the next try, so every missing name is found, those a static look at
    the pickle misses too (numpy builds `numpy.dtypes.Float64DType` while loading)."""
    class Structure(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            if isinstance(obj, torch.storage.TypedStorage):
                return ("storage", str(obj.dtype).removeprefix("torch."), obj._untyped_storage.nbytes())
            if isinstance(obj, torch.UntypedStorage):
                return ("storage", "uint8", obj.nbytes())
            return None

    def storage(pid: Any) -> Any:
        return torch.storage.TypedStorage(wrap_storage=torch.UntypedStorage(pid[2], device="meta"),
                                          dtype=getattr(torch, pid[1]), _internal=True)

    buf = io.BytesIO()
    Structure(buf, protocol=2).dump(state)
    refused: list[str] = []
    for _ in range(32):  # one refusal per try; a state names few types
        buf.seek(0)
        with torch.serialization.safe_globals([*allowed_globals(), *map(resolve, refused)]):
            unpickler = weights_only.Unpickler(buf, encoding="utf-8")
            unpickler.persistent_load = storage
            try:
                unpickler.load()
                return refused
            except pickle.UnpicklingError as e:
                name = _refused_name(str(e))
                if name is None or name in refused:
                    return [*refused, name or str(e).splitlines()[0][:200]]
                refused.append(name)
    return refused


def _refused_name(message: str) -> str | None:
    """The global torch's weights-only unpickler refused, from its message."""
    m = re.search(r"GLOBAL ([\w.]+)|got <class '([\w.]+)'>", message)
    return next((g for g in m.groups() if g), None) if m else None


def check_saveable(rel: str, state: Any) -> None:
    """Before a file is first saved in this process (by its name without the step folder): its
    state must load weights-only, else UnsafeState naming the types and how to allow them."""
    name = rel.replace(os.sep, "/").split("/", 1)[-1]
    if name in _checked:
        return
    refused = unsafe_globals(state)
    if refused:
        # The names last: Ray keeps the tail of a worker's error where a message is long.
        listed = ", ".join(f'"{g}"' for g in refused)
        raise UnsafeState(
            f"{name} would hold types a weights-only load refuses (loading them could run code), so no checkpoint "
            "of this job could be restored: keep only tensors and plain Python values in the model's state "
            f"(get_extra_state), or if these are safe to load, allow them in the spec: {FIELD}: [{listed}]")
    _checked.add(name)


class UnsafeCheckpointFile(CheckpointError):
    """A checkpoint file whose pickle names a type outside the allow-list: refused, never run.

    `refused`: the global the pickle names, where torch says which. Such a refusal is not damage:
    the same follows removing an entry from `checkpoint.safe_globals`, or a library upgrade that
    moved an allowed type, and a checkpoint is never condemned for either. "" where torch names
    none (an opcode its weights-only unpickler does not know: bytes torch.save never writes)."""

    def __init__(self, message: str, refused: str = "") -> None:
        super().__init__(message)
        self.refused = refused

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return (type(self), (str(self), self.refused))


def refusal(error: UnsafeCheckpointFile, checkpoint: str, libraries: str | None = None) -> UserCodeError:
    """What the user reads when the checkpoint folder `checkpoint` holds a refused pickle: the job ends,
    since every restart would refuse it again (tidal.launch.recovery), nothing is condemned, and the two
    fixes. `libraries`: how the libraries that wrote it differ from this worker's (save.libraries_changed).

    Set aside with Tidal's own marker, not moved: Ray Train's run state names every checkpoint it
    reported, and refuses to start once one is gone."""
    from tidal.storage import QUARANTINE_FILE

    name = error.refused or "the type named above"
    upgraded = (f" It was written with other library versions ({libraries}): a type they moved is the "
                "likelier reading." if libraries else "")
    return UserCodeError(FIELD, (
        f"{error} (in {checkpoint}). Nothing was quarantined: the refusal says nothing against the checkpoint, "
        f"but loading it could run code.{upgraded} If this is a type your model's state holds and the "
        f"checkpoint is yours (an entry removed from {FIELD}, or a library upgrade that moved a type), allow "
        f"it: {FIELD}: [{name}]. If you do not know the type, a file may have been planted: do not allow it; "
        f"set that checkpoint aside by writing a file {checkpoint}/{QUARANTINE_FILE} (any JSON, such as "
        '{"error": "set aside by hand"}; moving or deleting the folder breaks Ray Train\'s run state) and '
        "run again to resume from the checkpoint before it."))


@contextlib.contextmanager
def allowed() -> Iterator[None]:
    """While inside, torch's weights-only unpickler takes the allow-list (for a caller that
    runs that unpickler itself, reading a pickle without its tensors' bytes)."""
    with _loading, torch.serialization.safe_globals(allowed_globals()):
        yield


def safe_load(f: Any, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """`torch.load` that refuses (UnsafeCheckpointFile) any pickle naming a type outside the
    allow-list, instead of calling it."""
    # torch keeps the safe-globals list per process and the context restores it on exit: two
    # threads loading at once (a background fetch, ranks simulated as threads) would clear each
    # other's list mid-load and refuse sound files.
    with _loading, torch.serialization.safe_globals(allowed_globals()):
        try:
            return torch.load(f, map_location=map_location, weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as e:
            name = f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", "the file")
            named = _GLOBAL.search(str(e))
            what = f"names {named[1]}, a type" if named else "names a type or instruction"
            raise UnsafeCheckpointFile(
                f"refused to load {name}: its pickle {what} outside the allow-list of what Tidal's "
                f"checkpoints hold, so loading it could run code ({str(e).splitlines()[0][:200]})",
                named[1] if named else "") from e


class SafeLoadEngine:
    """Wraps an engine's DeepSpeed checkpoint engine for `engine.load_checkpoint`, which reads the
    model and optimizer states through its `load`: weights-only here, the rest delegated.

    `served`: states already in memory by file name (loaded weights-only, or built from such:
    a direct ZeRO-3 resize's, tidal.worker.checkpoint.repartition_zero3), returned for those names; with
    it, DeepSpeed reads no file, and a name it does not hold is refused."""

    def __init__(self, inner: Any, served: dict[str, Any] | None = None) -> None:
        self.inner, self.served = inner, served

    def load(self, path: str, map_location: Any = None) -> Any:
        if self.served is None:
            return safe_load(path, map_location=map_location)
        name = os.path.basename(path)
        if name not in self.served:
            raise CheckpointError(f"DeepSpeed asked for {name}, which this load does not hold")
        return self.served[name]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@contextlib.contextmanager
def safe_loading(engine: Any, served: dict[str, Any] | None = None) -> Iterator[None]:
    """While inside, `engine.load_checkpoint` unpickles weights-only (or takes `served`, SafeLoadEngine)."""
    before = engine.checkpoint_engine
    engine.checkpoint_engine = SafeLoadEngine(before, served)
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
