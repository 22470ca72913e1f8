"""The user's own code, named in the spec as `module:function` and imported here, on the workers.

- `load_ref` imports a reference, with an error that names the spec field and says how to fix it.
- `step_function` is what one micro-batch's loss is: the user's `step(model, batch)`, or `model(*batch)`.
- `UserDataset` serves the user's map-style torch Dataset by global sample index, like every Tidal
  source (see tidal.worker.data): step s trains on samples [(s-1)*B, s*B) of a seeded order, so
  the data position is the step number, and resume and resize are exact. A source without such
  an index (an IterableDataset, a stream) is refused: it could not resume without repeats or gaps.
- `calling` goes around every call into the user's code: a mistake there (a TypeError, an
  ImportError, ...) becomes a `UserCodeError` with the user's own frames, which the job does not
  restart for when it came before the worker's first step (tidal/launch/recovery.py).
"""

from __future__ import annotations

import importlib
import os
import sys
import sysconfig
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import torch
from torch.utils.data import IterableDataset, default_collate

from tidal.errors import UserCodeError
from tidal.spec.job import JobSpec
from tidal.spec.user_refs import WHERE, no_function

# Mistakes in code, which raise again when the same code runs on the same inputs. Not RuntimeError
# or OSError: those also carry what a restart can cure (a device's error, a file system's hiccup).
CODE_ERRORS = (TypeError, ValueError, AttributeError, ImportError, NameError, LookupError, SyntaxError,
               AssertionError, NotImplementedError, ArithmeticError)
# Set once this worker's first step returned a loss: a mistake after it is retried as before.
FIRST_LOSS = threading.Event()
_NOT_USERS = (str(Path(__file__).resolve().parents[1]) + os.sep,  # Tidal's own package
              *{sysconfig.get_paths()[k] + os.sep for k in ("stdlib", "platstdlib")})


def load_ref(field: str, ref: str) -> Callable[..., Any]:
    """The function `ref` ('pkg.module:function') names, for spec field `field`."""
    module_name, _, name = ref.partition(":")
    with calling(field, ref, "imported"):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name is None or not (module_name == e.name or module_name.startswith(e.name + ".")):
                raise  # the user's module itself imports something missing: `calling` shows where
            raise mistake(field, f"cannot load {ref!r}: {e}; {WHERE}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise mistake(field, no_function(ref, module))
    return fn


def mistake(field: str, message: str, frames: str = "") -> UserCodeError:
    """The user's mistake named by spec field `field`, stamped with whether this worker had trained a step."""
    return UserCodeError(field, message, frames, first_step=not FIRST_LOSS.is_set())


@contextmanager
def calling(field: str, ref: str, how: str = "called") -> Iterator[None]:
    """Around a call into the code `ref` (spec field `field`) names: a `CODE_ERRORS` error raised in
    the user's files, or by the call itself (arguments that do not fit), is raised as a UserCodeError
    with the user's frames. Anything else, or raised in Tidal's or a library's code only, goes on as
    it is: it may be Tidal's, or a restart may cure it."""
    caller = sys._getframe(2)  # the frame of the `with` (contextmanager's __enter__ is between)
    try:
        yield
    except UserCodeError:
        raise
    except CODE_ERRORS as e:
        below = _below(e.__traceback__, caller)  # what the call ran: the with-block's frame is Tidal's
        frames = users_frames(below)
        if not frames and below is not None:  # raised in Tidal's or a library's code only, not by the call itself
            raise
        summary = f"{type(e).__name__}: {e}".strip()
        raise mistake(field, f"{ref!r} raised {summary} when {how}", format_frames(frames, e)) from e


def _below(tb: TracebackType | None, caller: FrameType) -> TracebackType | None:
    """The part of `tb` below `caller`'s frame: None when the error was raised in `caller` itself."""
    while tb is not None and tb.tb_frame is not caller:
        tb = tb.tb_next
    return tb.tb_next if tb is not None else None


def users_frames(tb: TracebackType | None) -> traceback.StackSummary:
    """The frames of `tb` in the user's files: neither Tidal's, nor the standard library's, nor an
    installed package's."""
    return traceback.StackSummary.from_list(
        [f for f in traceback.extract_tb(tb) if is_users(f.filename)])


def is_users(filename: str) -> bool:
    if filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>
        return False
    path = os.path.abspath(filename)
    return not (path.startswith(_NOT_USERS) or f"{os.sep}site-packages{os.sep}" in path
                or f"{os.sep}dist-packages{os.sep}" in path)


def format_frames(frames: traceback.StackSummary, error: BaseException) -> str:
    """Python's traceback of the user's frames, paths relative to the job's working directory."""
    here = os.getcwd() + os.sep
    for f in frames:
        if f.filename.startswith(here):
            f.filename = f.filename[len(here):]
    head = "Traceback (most recent call last), in your code:\n" if frames else ""
    return head + "".join(frames.format()) + "".join(traceback.format_exception_only(error))


def step_function(spec: JobSpec, first_loss: bool = True) -> Callable[[Any, Any], torch.Tensor]:
    """`step(model, batch) -> loss` for one micro-batch; `model` is the DeepSpeed engine.
    `first_loss`: its first loss marks this worker's first step (FIRST_LOSS); not for the
    throwaway steps of train.micro_batch auto's search."""
    ref, field = spec.train.step_fn, "train.step_fn"
    user = load_ref(field, ref) if ref else _forward_returns_loss
    if ref is None and spec.model.builder:  # the user's model's forward is the step
        ref, field = spec.model.builder, "model.builder"

    def step(model: Any, batch: Any) -> torch.Tensor:
        if ref is None:  # Tidal's model and loss
            loss = user(model, batch)
        else:
            with calling(field, ref, "computing a micro-batch's loss"):
                loss = user(model, batch)
        if spec.train.step_fn and not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
            got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise mistake("train.step_fn", f"{ref!r} returned {got}; it must return the loss: a scalar tensor "
                          "computed from the model's output (so that it has a gradient)")
        if first_loss:
            FIRST_LOSS.set()
        return loss

    return step


def _forward_returns_loss(model: Any, batch: Any) -> torch.Tensor:
    return model(**batch) if isinstance(batch, dict) else model(*batch)


class UserDataset:
    """`data.dataset`'s Dataset, in a seeded order per epoch that depends on the sample index only."""

    def __init__(self, spec: JobSpec) -> None:
        ref = spec.data.dataset or ""
        make = load_ref("data.dataset", ref)
        with calling("data.dataset", ref, f"called with data.dataset_args {spec.data.dataset_args}"):
            data = make(**spec.data.dataset_args)
        refuse = resume_problem(data)
        if refuse:
            raise mistake("data.dataset", f"{ref!r} returned {type(data).__module__}.{type(data).__name__}, {refuse}")
        with calling("data.dataset", ref, "asked for its length"):
            empty = len(data) == 0
        if empty:
            raise mistake("data.dataset", f"{ref!r} returned an empty dataset")
        self.data, self.seed, self.ref = data, spec.train.seed, ref
        self._epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    def indices(self, first: int, count: int) -> list[int]:
        """Dataset indices of global samples [first, first + count): each epoch is a new permutation."""
        n, out = len(self.data), []
        for i in range(first, first + count):
            epoch, j = divmod(i, n)
            if epoch != self._epoch:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._epoch, self._perm = epoch, torch.randperm(n, generator=g)
            out.append(int(self._perm[j]))
        return out

    def micro_batches(self, first: int, part: slice, micro: int, device: torch.device) -> Iterator[Any]:
        """This rank's part of the step starting at global sample `first`, `micro` samples at a time."""
        mine = self.indices(first + part.start, part.stop - part.start)
        for k in range(0, len(mine), micro):
            with calling("data.dataset", self.ref, "its samples were read"):
                samples = [self.data[i] for i in mine[k:k + micro]]
            yield to_device(default_collate(samples), device)


def resume_problem(data: Any) -> str | None:
    """Why `data` has no resumable position (None: it has one, the sample index)."""
    if isinstance(data, IterableDataset):
        return ("an IterableDataset, which has no position Tidal can resume from without repeating or skipping "
                "samples; return a map-style torch Dataset (with __len__ and __getitem__) instead")
    if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        return ("which lacks __len__ or __getitem__: Tidal resumes by sample index; return a map-style torch "
                "Dataset (for a Ray Dataset: a torch Dataset over its rows, e.g. from ds.take_all())")
    return None


def to_device(batch: Any, device: torch.device) -> Any:
    """Tensors of a collated batch (nested in tuples, lists or dicts) moved to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch
