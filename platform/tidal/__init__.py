"""Tidal: elastic, fault-tolerant training on Ray Train + DeepSpeed, tracked in MLflow.

The SDK. Importing it is cheap: torch, ray and deepspeed load only when a job runs.

Imports flow one way, top to bottom (tests/test_layers.py checks every module, function-level
imports included, for cycles and for imports against this order, and that no two folders import
each other); a module may import its own layer and any below it:

    tidal (this SDK), tidal.cli           the user's entry points (and tidal.testing, for tests)
    tidal.launch, tidal.exporter          the driver: submit, run, sweep, export
    tidal.worker, tidal.eval_best         what runs in Ray Train's workers
    tidal.worker.checkpoint               their checkpoints: save, restore, resize (below the loop)
    tidal.tracking                        the job's event log, ledger and MLflow writer
    tidal.storage, tidal.cluster          checkpoints in storage; cluster configs, bursts, status
    tidal.lease, tidal.admission          the job's one live attempt; the team queue (quotas,
                                          decisions, its actor and seats)
    tidal.fs, tidal.exclusive, tidal.azure_blob, tidal.test_hooks (tests' fault hooks), tidal.gil (long GIL holds, said), tidal.errors, tidal.output, tidal.version, tidal.ray_private,
      tidal.redact, tidal.ray_auth, tidal.sites, tidal.prices (a node's site and price),
      tidal.goodput (the goodput account: pure, imports no Tidal), tidal.jobs_api (submitting
      through a starting head's refusals)
    tidal.spec (beside all)               the job spec: imported by every layer, imports only the lowest

`eval_best` (which checkpoints the best evaluation keeps) sits with the worker, which decides
early stopping, above the storage it reads; the launcher and exporter use it from above.
`tidal.ray_private` holds every private Ray name Tidal uses, nothing else may import one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tidal.errors import CheckpointError, ClusterError, JobAlreadyRunning, SpecError, TidalError
from tidal.spec.job import JobSpec
from tidal.version import __version__ as __version__

if TYPE_CHECKING:
    import os

    from torch import nn

    from tidal.exporter.model import Exported
    from tidal.launch.jobs import Job
    from tidal.launch.result import RunResult
    from tidal.launch.sweep import SweepResult


def run(spec: JobSpec, restart: bool = False, wait: bool = False) -> RunResult:
    """Run `spec` to the end on the Ray cluster in RAY_ADDRESS, or on a local Ray instance.

    Resumes from the job's latest complete checkpoint unless `restart` is true. A job runs
    one driver at a time: while another runs it, this raises `JobAlreadyRunning` naming that
    driver, or with `wait` waits for it to end first.
    """
    from tidal.launch.trainer import run as _run

    return _run(spec, restart=restart, wait=wait)


def submit(spec: JobSpec, address: str | None = None, working_dir: str = ".") -> Job:
    """Submit `spec` to the Ray cluster at `address` (default: RAY_ADDRESS) through Ray Jobs.

    `working_dir` is uploaded with the job (respecting .gitignore). Returns a `Job` to follow,
    wait on, stop, and read metrics from.
    """
    from tidal.launch.jobs import submit as _submit

    return _submit(spec, address, working_dir)


def sweep(spec: JobSpec, params: dict[str, str] | list[str] | None = None, samples: int | None = None,
          scheduler: str | None = None, metric: str | None = None, mode: str | None = None,
          max_concurrent: int | None = None, restart: bool = False) -> SweepResult:
    """Run `spec` once per trial of a Ray Tune sweep; resumes an interrupted sweep unless `restart`.

    `params` are `"train.lr=loguniform:1e-4:1e-2"`-style strings (or a dict key -> distribution);
    each trial is a full Tidal job and a child MLflow run of the sweep's parent run.
    """
    from tidal.launch.sweep import sweep as _sweep

    return _sweep(spec, params=params, samples=samples, scheduler=scheduler, metric=metric, mode=mode,
                  max_concurrent=max_concurrent, restart=restart)


def export(spec: JobSpec, checkpoint: str | int = "latest", format: str = "torch", output: str | os.PathLike[str] = "",
           mlflow: bool = False, register: str | None = None) -> Exported:
    """Consolidate a job's checkpoint into one model in `output`, loadable without DeepSpeed or Ray.

    `checkpoint`: "latest" or a step. `format`: "hf" (a Hugging Face `save_pretrained` folder,
    with the job's tokenizer; the built-in GPT as GPT-2) or "torch" (safetensors + config, for
    `load_exported`). `mlflow=True` logs it on the job's MLflow run; `register="NAME"` registers it.
    Runs on any machine that reaches the job's storage; no GPU needed.
    """
    from tidal.exporter.model import export as _export

    return _export(spec, checkpoint=checkpoint, format=format, output=output, mlflow=mlflow, register=register)


def load_exported(path: str | os.PathLike[str]) -> nn.Module:
    """The model of a `--format torch` export, rebuilt with torch alone; `forward(tokens, targets)` is the loss."""
    from tidal.exporter.model import load_exported as _load

    return _load(path)


def __getattr__(name: str) -> Any:
    if name == "RunResult":
        from tidal.launch.result import RunResult

        return RunResult
    if name == "SweepResult":
        from tidal.launch.sweep import SweepResult

        return SweepResult
    if name == "Exported":
        from tidal.exporter.model import Exported

        return Exported
    if name == "Job":
        from tidal.launch.jobs import Job

        return Job
    raise AttributeError(name)


__all__ = ["CheckpointError", "ClusterError", "Exported", "Job", "JobAlreadyRunning", "JobSpec", "RunResult",
           "SpecError", "SweepResult", "TidalError", "export", "load_exported", "run", "submit", "sweep"]
