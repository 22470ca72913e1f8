"""The user's own code, named in the spec as `module:function` and imported here, on the workers.

- `load_ref` imports a reference, with an error that names the spec field and says how to fix it.
- `step_function` is what one micro-batch's loss is: the user's `step(model, batch)`, or `model(*batch)`.
- `UserDataset` serves the user's map-style torch Dataset by global sample index, like every Tidal
  source (see tidal.worker.data): step s trains on samples [(s-1)*B, s*B) of a seeded order, so
  the data position is the step number, and resume and resize are exact. A source without such
  an index (an IterableDataset, a stream) is refused: it could not resume without repeats or gaps.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, default_collate

from tidal.errors import SpecError, TidalError
from tidal.spec.job import JobSpec

WHERE = ("the module must be importable on every worker: put it in the directory you start `tidal run` from "
         "(or the --working-dir of `tidal submit`), or install it on every node")


def load_ref(field: str, ref: str) -> Callable[..., Any]:
    """The function `ref` ('pkg.module:function') names, for spec field `field`."""
    module_name, _, name = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not module_name.startswith(e.name):
            raise  # the user's module itself imports something missing: their traceback says what
        raise SpecError([(field, f"cannot load {ref!r}: {e}; {WHERE}")]) from e
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise SpecError([(field, f"cannot load {ref!r}: {module_name} has no function {name!r} "
                                   f"(it has: {', '.join(found) or 'none'})")])
    return fn


def step_function(spec: JobSpec) -> Callable[[Any, Any], torch.Tensor]:
    """`step(model, batch) -> loss` for one micro-batch; `model` is the DeepSpeed engine."""
    if spec.train.step_fn is None:
        return _forward_returns_loss
    user = load_ref("train.step_fn", spec.train.step_fn)
    ref = spec.train.step_fn

    def step(model: Any, batch: Any) -> torch.Tensor:
        loss = user(model, batch)
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
            got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise TidalError(f"train.step_fn {ref!r} returned {got}; it must return the loss: a scalar tensor "
                             "computed from the model's output (so that it has a gradient)")
        return loss

    return step


def _forward_returns_loss(model: Any, batch: Any) -> torch.Tensor:
    return model(**batch) if isinstance(batch, dict) else model(*batch)


class UserDataset:
    """`data.dataset`'s Dataset, in a seeded order per epoch that depends on the sample index only."""

    def __init__(self, spec: JobSpec) -> None:
        ref = spec.data.dataset or ""
        data = load_ref("data.dataset", ref)(**spec.data.dataset_args)
        refuse = resume_problem(data)
        if refuse:
            raise SpecError([("data.dataset", f"{ref!r} returned {type(data).__module__}.{type(data).__name__}, "
                              f"{refuse}")])
        if len(data) == 0:
            raise SpecError([("data.dataset", f"{ref!r} returned an empty dataset")])
        self.data, self.seed = data, spec.train.seed
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
            yield to_device(default_collate([self.data[i] for i in mine[k:k + micro]]), device)


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
