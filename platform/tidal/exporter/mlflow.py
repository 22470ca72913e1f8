"""Log an exported model on the job's own MLflow run, and register it if asked.

`--format hf` goes in as MLflow's transformers flavour (model + tokenizer: its pipeline needs
one; a job without data.tokenizer gets the pytorch flavour of the same Hugging Face model),
`--format torch` as the pytorch flavour (the module itself, pickled). The run is the one the job
tracked its metrics in (its id is in the checkpoint and in the run folder's job file), so the
model sits beside the losses that produced it. Reopening a run marks it FINISHED on exit in
MLflow; the status it had (RUNNING for a job still training, FAILED...) is put back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator
from typing import Any

from torch import nn

from tidal.errors import TidalError, UsageError
from tidal.spec.job import JobSpec

ARTIFACT = "model"


def log_exported(result: Any, model: nn.Module, spec: JobSpec, run_id: str | None, uri: str,
                 register: str | None) -> Any:
    """`result` (an `Exported`) with the MLflow run, model URI and registered version filled in."""
    if not run_id:
        raise UsageError(f"job {spec.name!r} recorded no MLflow run id in its run folder (tidal-job.json), so there is "
                         "no run to log the model on; export without --mlflow, then log the folder yourself")
    import mlflow
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    try:
        found = client.get_run(run_id)
        status = found.info.status
    except Exception as e:  # noqa: BLE001 - any store failure: say which store and run, hide the traceback
        raise TidalError(f"MLflow at {uri} has no run {run_id} of job {spec.name!r} or cannot be reached "
                         f"({type(e).__name__}: {str(e)[:200]}); the model was exported to {result.output} "
                         "but not logged") from e
    if (owner := found.data.tags.get("tidal.job")) != spec.name:
        # The run id is read from storage: a run of another job (or none of Tidal's) is not reopened.
        raise TidalError(f"MLflow run {run_id} at {uri} is not job {spec.name!r}'s (its tidal.job tag: {owner!r}); "
                         f"the model was exported to {result.output} but not logged")
    # MLflow prints its progress to stdout, which belongs to `--output json`.
    with _tracking_uri(uri), contextlib.redirect_stdout(sys.stderr), mlflow.start_run(run_id=run_id):
        info = _log(result.format, result.output, model, result.step, register)
    if status != "FINISHED":
        client.update_run(run_id, status=status)
    version = getattr(info, "registered_model_version", None)
    return dataclasses.replace(
        result, mlflow_run_id=run_id,
        model_uri=f"models:/{register}/{version}" if register and version else info.model_uri,
        registered=f"{register} version {version}" if register and version else None)


@contextlib.contextmanager
def _tracking_uri(uri: str) -> Iterator[None]:
    """Point MLflow's fluent API (which logs models) at the job's store for this call only:
    `set_tracking_uri` also sets MLFLOW_TRACKING_URI, which must not outlive an SDK call."""
    import mlflow

    before = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(before)  # None unsets it again


def _log(format: str, folder: str, model: nn.Module, step: int, register: str | None) -> Any:
    import mlflow

    common = {"name": ARTIFACT, "step": step, "registered_model_name": register}
    tokenizer = _tokenizer(folder) if format == "hf" else None
    if tokenizer is not None:
        # Requirements given, not inferred: inference imports the model in a subprocess (slow).
        return mlflow.transformers.log_model(transformers_model={"model": model, "tokenizer": tokenizer},
                                             task="text-generation",
                                             pip_requirements=_requirements("torch", "transformers"), **common)
    if format == "hf":
        print("[tidal] the job had no tokenizer (data.tokenizer), which MLflow's transformers flavour needs: "
              "logging the Hugging Face model with the pytorch flavour", file=sys.stderr)
    # pickle: the module as torch.save writes it. MLflow's default, pt2, traces forward from an
    # input example, and a Tidal model's forward takes (tokens, targets).
    return mlflow.pytorch.log_model(model, serialization_format="pickle", pip_requirements=_requirements("torch"),
                                    **common)


def _tokenizer(folder: str) -> Any:
    """The tokenizer the export saved beside the model, or None."""
    import os

    if not os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def _requirements(*names: str) -> list[str]:
    from importlib.metadata import version

    return [f"{n}=={version(n)}" for n in names]
