"""`train.micro_batch: auto`: the largest micro-batch that fits, found before the first step, and
halved when an out-of-memory error strikes mid-run, the global batch unchanged.

Like Composer's automatic microbatching, with DeepSpeed's engine:

- **Before the first step** (`resolve`): a throwaway engine of the job's own model tries real
  steps (forward, backward, optimizer) on the job's own first batch, at the sizes
  `spec.batch.micro_batch_candidates` allows (those that keep the global batch at every world
  size of the job), by binary search; every rank takes part and they agree on each try (one
  all-reduce), so all choose the same. The engine is then dropped and the real one built at the
  chosen size, from the same seed: the tries leave no trace in the weights or the data order.
- **Mid-run** (`AutoMicroBatch.step`): each forward's out-of-memory error is agreed on by all
  ranks before any backward. One at the step's first micro-batch leaves nothing to undo: the
  micro-batch halves, the engine's micro-batch and gradient accumulation are set to keep the
  global batch (DeepSpeed's `set_train_micro_batch_size`/`set_train_batch_size` change only
  its config; its accumulation boundary counts micro-steps, so the count restarts), and the step
  is trained again. An error later in the step, or in a backward or optimizer step, has left
  gradients half accumulated: the new size is recorded and the worker fails, so the group
  restarts from the last checkpoint (a restart of `failure.max_restarts`) at that size.

The choice is recorded in the job's folder (`tidal-micro-batch.json`): a restart or resize
keeps it, and only `tidal run --restart` (a new folder) searches again.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tidal.errors import TidalError
from tidal.spec.batch import halved, largest_fitting, micro_batch_candidates
from tidal.spec.job import JobSpec
from tidal.storage import RunDir
from tidal.worker.user_code import step_function

RECORD = "tidal-micro-batch.json"
OOM = torch.OutOfMemoryError


class ForwardOutOfMemory(Exception):
    """Some rank ran out of memory in the forward of micro-batch `index` of a step (agreed by all)."""

    def __init__(self, index: int) -> None:
        super().__init__(f"out of memory in the forward of micro-batch {index}")
        self.index = index


def candidates(spec: JobSpec) -> list[int]:
    s = spec.scaling
    return micro_batch_candidates(spec.train.global_batch, s.min_workers, s.max_workers)


def recorded(spec: JobSpec) -> int | None:
    """The size an earlier group of this job chose (still one the spec allows), or None."""
    m = (RunDir(spec.checkpoint.storage, spec.name).read_json(RECORD) or {}).get("micro_batch")
    return m if isinstance(m, int) and m in candidates(spec) else None


def record(spec: JobSpec, micro: int, why: str, step: int) -> None:
    RunDir(spec.checkpoint.storage, spec.name).write_json(RECORD, {"micro_batch": micro, "why": why, "step": step})


def resolve(spec: JobSpec, rank: int, world: int, try_step: Callable[[JobSpec], None],
            say: Callable[[str], None]) -> tuple[JobSpec, bool]:
    """(the spec with a number for train.micro_batch, whether it was searched now). `try_step(spec)`
    trains one throwaway step at `spec`'s micro-batch and raises OutOfMemoryError if it does not fit."""
    if spec.train.micro_batch != "auto":
        return spec, False
    known = recorded(spec)
    if known is not None:
        if rank == 0:
            say(f"train.micro_batch auto: {known}, as this job chose before")
        return with_micro(spec, known), False
    sizes = candidates(spec)
    tried: dict[int, bool] = {}

    def fits(m: int) -> bool:
        tried[m] = agree_fits(_try(try_step, with_micro(spec, m)))
        return tried[m]

    best = largest_fitting(sizes, fits)
    if best is None:
        raise TidalError(f"train.micro_batch auto: even a micro-batch of {sizes[0]} runs out of memory; lower "
                         "the memory a step needs (parallelism.zero_stage 3, parallelism.activation_checkpointing, "
                         "parallelism.offload_optimizer, bf16) or use more memory per worker")
    if rank == 0:
        record(spec, best, "searched", 0)
        said = ", ".join(f"{m} {'fits' if ok else 'out of memory'}" for m, ok in sorted(tried.items()))
        say(f"train.micro_batch auto: {best} (the largest of {sizes} that fits: {said}); "
            f"{spec.train.global_batch // best // world} accumulation step(s) at {world} worker(s) keep "
            f"train.global_batch {spec.train.global_batch}")
    return with_micro(spec, best), True


def with_micro(spec: JobSpec, micro: int) -> JobSpec:
    return spec.with_overrides({"train.micro_batch": micro})


def _try(try_step: Callable[[JobSpec], None], spec: JobSpec) -> bool:
    try:
        try_step(spec)
        return True
    except OOM:
        return False
    finally:
        free_memory()


def agree_fits(fits_here: bool) -> bool:
    """True only if it fit on every rank (a collective)."""
    flag = torch.tensor([0 if fits_here else 1])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item()) == 0


def free_memory() -> None:
    gc.collect()  # DeepSpeed's engine holds reference cycles
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def choose(spec: JobSpec, world: int, device: torch.device, rank: int, say: Callable[[str], None],
           make_batches: Callable[[JobSpec, Any], Any]) -> JobSpec:
    """The spec this worker group trains with: `auto` resolved (recorded, or searched now)."""
    if spec.train.micro_batch != "auto":
        return spec
    prober = Prober(spec, world, device, make_batches)
    try:
        return resolve(spec, rank, world, prober, say)[0]
    finally:
        prober.close()


class Prober:
    """Real optimizer steps of a throwaway engine (gradient accumulation 1, so each try is a
    whole step: forward, backward and the optimizer's state) on the job's first batch, cut to
    the size tried. An engine that ran out of memory may hold half-done state: built anew."""

    def __init__(self, spec: JobSpec, world: int, device: torch.device,
                 make_batches: Callable[[JobSpec, Any], Any]) -> None:
        self.spec = with_micro(spec, candidates(spec)[-1])
        self.world, self.device, self.make_batches = world, device, make_batches
        self.engine: Any = None
        self.batches: Any = None
        self.step_fn = step_function(spec, first_loss=False)  # throwaway steps: not the first step

    def __call__(self, tried: JobSpec) -> None:
        if self.engine is None:
            from tidal.worker.engine import build_engine  # DeepSpeed: only for a search

            self.engine = build_engine(self.spec, self.world, self.device)
        if self.batches is None:
            self.batches = self.make_batches(self.spec, self.engine)
        self.batches.micro_batch = int(tried.train.micro_batch)
        batch = next(iter(self.batches.for_step(1)))
        try:
            loss = self.step_fn(self.engine, batch)
            self.engine.backward(loss)
            self.engine.step()
        except OOM:
            self.engine = None
            raise

    def close(self) -> None:
        self.engine = self.batches = None
        free_memory()


class AutoMicroBatch:
    """Rank-agreed out-of-memory handling for one worker group of an auto job (see the module)."""

    def __init__(self, spec: JobSpec, engine: Any, batches: Any, rank: int, say: Callable[[str, int], None]) -> None:
        self.spec, self.engine, self.batches, self.rank, self.say = spec, engine, batches, rank, say
        self.sizes = candidates(spec)
        self.micro = int(spec.train.micro_batch)
        self.index = 0  # the micro-batch of the step being trained
        self.changed: dict[str, float] = {}  # for the next log step's metrics

    def step_fn(self, step_fn: Callable[[Any, Any], torch.Tensor]) -> Callable[[Any, Any], torch.Tensor]:
        """`step_fn` whose out-of-memory errors every rank agrees on before any backward."""

        def agreed(model: Any, batch: Any) -> torch.Tensor:
            loss, here = None, True
            try:
                loss = step_fn(model, batch)
            except OOM:
                here = False
                free_memory()
            self.index += 1
            if not agree_fits(here):
                raise ForwardOutOfMemory(self.index - 1)
            return loss

        return agreed

    def step(self, step: int, train_step: Callable[[], Any]) -> Any:
        """`train_step()` (one optimizer step over fresh micro-batches), trained again at half
        the micro-batch after an out-of-memory error in the first micro-batch's forward."""
        while True:
            self.index = 0
            try:
                return train_step()
            except ForwardOutOfMemory as e:
                smaller = self._smaller(step)
                if e.index > 0:
                    self._fail(step, smaller, f"in micro-batch {e.index} of the step")
                self._use(smaller, step)
            except OOM:
                self._fail(step, self._smaller(step), "in a backward or optimizer step")

    def _smaller(self, step: int) -> int:
        smaller = halved(self.sizes, self.micro)
        if smaller is None:
            raise TidalError(f"out of memory at step {step} with train.micro_batch {self.micro}, the smallest that "
                             "keeps train.global_batch; lower the memory a step needs (parallelism.zero_stage 3, "
                             "activation checkpointing, offload, bf16)")
        return smaller

    def _use(self, micro: int, step: int) -> None:
        e, old = self.engine, self.micro
        e.set_train_micro_batch_size(micro)
        e.set_train_batch_size(self.spec.train.global_batch)  # gradient accumulation follows
        if hasattr(e.optimizer, "gradient_accumulation_steps"):  # ZeRO's own copy (offload paths)
            e.optimizer.gradient_accumulation_steps = e.gradient_accumulation_steps()
        # The boundary is (micro_steps + 1) % accumulation: count this step's micro-steps from 0.
        e.micro_steps = 0
        self.batches.micro_batch = self.micro = micro
        self.changed = {"micro_batch": float(micro), "micro_batch_halved_at": float(step)}
        if self.rank == 0:
            record(self.spec, micro, f"out of memory at step {step}", step)
            self.say(f"out of memory at step {step} with train.micro_batch {old}: training the step again at {micro} "
                     f"with {e.gradient_accumulation_steps()} accumulation step(s); train.global_batch stays "
                     f"{self.spec.train.global_batch}", step)

    def _fail(self, step: int, micro: int, where: str) -> None:
        record(self.spec, micro, f"out of memory at step {step}", step)  # any rank: it may be the only one
        raise TidalError(f"out of memory at step {step} {where} with train.micro_batch {self.micro}: its "
                         f"gradients are half accumulated, so the group restarts from the last checkpoint at "
                         f"micro-batch {micro}")

    def metrics(self) -> dict[str, float]:
        """`micro_batch` at every log step; the step it halved at, once."""
        out = {"micro_batch": float(self.micro), **self.changed}
        self.changed = {}
        return out
