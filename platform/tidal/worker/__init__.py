"""Code that runs inside each Ray Train worker (imports torch and deepspeed).

`train_loop` is what Ray Train runs: it names the loop without importing it, so the driver that
hands it to Ray Train never imports DeepSpeed.
"""

import functools
import importlib
import sys
from collections.abc import Callable
from contextlib import suppress
from typing import Any

from tidal.tracking.quiet import quiet_libraries
from tidal.worker import spares

quiet_libraries()  # before any module here imports deepspeed, which warns at import


def train_loop(config: dict[str, Any]) -> None:
    """The per-worker training loop (worker/loop.py)."""
    spares.note_train_start()  # before any import here: did this process start as a warm spare?
    # Again, now that Ray Train is imported: the job's setup hook (tidal.worker.spares) imports this
    # package when the process starts, before Ray Train, and the quieting of Ray Train's per-report
    # lines needs its module loaded (quiet._quiet_ray_train_reports); idempotent.
    quiet_libraries()
    _import_deepspeed()
    _import_muon_uncompiled()
    from tidal.worker.loop import train_loop as loop

    loop(config)


def _import_deepspeed() -> None:
    """DeepSpeed imports MLflow, when installed, for its autotuner's trial logging, which Tidal
    never runs (workers never write to MLflow: tracking/tracker.py). That import is about 1 s of
    CPU in every worker start. MLflow is hidden while DeepSpeed loads and visible again after
    (user code may import it)."""
    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        return
    sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` raises ImportError: DeepSpeed's "not installed"
    try:
        import deepspeed  # noqa: F401
    finally:
        del sys.modules["mlflow"]


MUON = "deepspeed.runtime.zero.muon.original_muon"


def _import_muon_uncompiled() -> None:
    """ZeRO 1-3 import DeepSpeed's Muon module at an engine's first steps, to ask whether the
    optimizer is Muon, and that module decorates its kernels with `torch.compile`, which imports
    Inductor: 0.6-0.85 s of CPU per worker start (measured: 3.5 s to a ZeRO-2 engine's first
    step, 2.7 s without), paid again at every restart. Tidal never runs Muon (`train.optimizer`
    offers AdamW, Adam, SGD, Lion), so the module is imported here with each `torch.compile`
    deferred to the first call of what it decorates, which never comes."""
    if MUON in sys.modules:
        return
    import torch

    compile_now = torch.compile
    torch.compile = _compile_on_first_call(compile_now)  # type: ignore[assignment]
    try:
        with suppress(ImportError):  # a DeepSpeed without Muon: nothing to defer
            importlib.import_module(MUON)
    finally:
        torch.compile = compile_now


def _compile_on_first_call(compile_now: Callable[..., Any]) -> Callable[..., Any]:
    def deferred(model: Callable[..., Any] | None = None, **options: Any) -> Any:
        if model is None:  # @torch.compile(mode=...): the decorator itself
            return lambda fn: deferred(fn, **options)
        compiled: Callable[..., Any] | None = None

        @functools.wraps(model)
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            compiled = compiled or compile_now(model, **options)
            return compiled(*args, **kwargs)

        return call

    return deferred
