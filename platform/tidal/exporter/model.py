"""Take the trained model out of a job: one consolidated model that loads without DeepSpeed or Ray.

`export(spec, checkpoint, format, output)` is the one function behind `tidal export` and
`tidal.export`. It finds the chosen complete checkpoint in the job's run folder (local, NFS or
object storage, through the same `RunDir` the trainer uses), downloads only that step's
DeepSpeed folder, consolidates the ZeRO shards on this machine (no GPU, no process group:
DeepSpeed's `zero_to_fp32` does it), and writes the model in the chosen format, then optionally
logs it to the job's MLflow run and registers it.

Which checkpoint: `latest`, `best` (by the job's eval metric) or a step number; every named choice is a
function in `CHOOSERS` from the complete checkpoints to one of them.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from tidal.errors import UsageError
from tidal.redact import redact_uri
from tidal.spec.job import JobSpec
from tidal.storage import JOB_FILE, RunDir, check_complete

FORMATS = ("hf", "torch")
EXPORT_FILE = "tidal-export.json"  # written last into the output folder: what was exported, from where


@dataclass(frozen=True)
class Candidate:
    """A complete checkpoint of the job: its step, folder and what rank 0 recorded in it."""

    step: int
    path: str
    state: dict[str, Any]


Chooser = Callable[[list[Candidate], JobSpec], Candidate]
def _best(found: list[Candidate], spec: JobSpec) -> Candidate:
    """The checkpoint with the best score by checkpoint.keep_best (default eval_loss, lowest), the
    newest on a tie: each checkpoint carries the evaluation at its own step (tidal.eval_best)."""
    from tidal.eval_best import pick_best

    kb = spec.checkpoint.keep_best
    metric, mode = (kb.metric, kb.mode) if kb else ("eval_loss", "min")
    best = pick_best(found, lambda c: c.state, metric, mode)
    if best is None:
        raise UsageError(f"--checkpoint best: no checkpoint of job {spec.name!r} carries {metric} (a job evaluates "
                         "with an eval section); use --checkpoint latest or a step number")
    return best


CHOOSERS: dict[str, Chooser] = {"latest": lambda found, spec: max(found, key=lambda c: c.step), "best": _best}


@dataclass(frozen=True)
class Exported:
    """What `export` wrote: the folder, the format, the step, and where MLflow holds it."""

    job: str
    output: str
    format: str
    step: int
    checkpoint: str  # the checkpoint folder it came from (a path or a URI)
    mlflow_run_id: str | None = None
    model_uri: str | None = None  # `runs:/...` or `models:/...`, for mlflow.*.load_model
    registered: str | None = None  # "NAME version N"

    def summary(self) -> str:
        lines = [f"[tidal] exported job {self.job!r} at step {self.step} ({self.format}) to {self.output}"]
        if self.model_uri:
            lines.append(f"[tidal] logged to MLflow run {self.mlflow_run_id}: {self.model_uri}")
        if self.registered:
            lines.append(f"[tidal] registered as {self.registered}")
        return "\n".join(lines)

    def record(self) -> dict[str, Any]:
        return asdict(self)


def export(spec: JobSpec, checkpoint: str | int = "latest", format: str = "torch", output: str | os.PathLike[str] = "",
           mlflow: bool = False, register: str | None = None) -> Exported:
    """Export the job `spec` ran as a model that loads without DeepSpeed.

    `checkpoint`: "latest" or a step number. `format`: "hf" (a Hugging Face `save_pretrained`
    folder, with the job's tokenizer) or "torch" (safetensors + a config JSON; load it with
    `tidal.load_exported`). `mlflow` logs it on the job's MLflow run; `register` also
    registers it under that name (and implies `mlflow`).
    """
    check_format(format, spec)
    which = parse_checkpoint(checkpoint)
    out = check_output(output)
    spec = spec.resolved()
    run = RunDir(spec.checkpoint.storage, spec.name)
    chosen = choose(which, complete_checkpoints(run), spec)
    check_same_model(spec, chosen)

    from tidal.exporter.save import save  # torch and DeepSpeed load only from here on
    from tidal.exporter.weights import consolidated

    if os.path.isdir(out):
        shutil.rmtree(out)  # an earlier export (check_output refuses any other folder)
    with consolidated(run.fs, chosen.path, chosen.step, spec) as state_dict:
        model = save(spec, state_dict, format, out)
    result = Exported(spec.name, out, format, chosen.step, _uri(run, chosen.path))
    if mlflow or register:
        from tidal.exporter.mlflow import log_exported

        job = run.read_json(JOB_FILE) or {}
        # The job file names the job's run (a run deleted and replaced there is the new one);
        # only checkpoints written before TrainState shrank also carry a run id. Its tracking URI
        # is never used: whoever can write the bucket could name a server of theirs and receive
        # the weights and the user's MLflow credentials. The spec's (the user's) URI is; the run
        # is checked to be this job's there (log_exported).
        uri = export_tracking_uri(spec, job)
        result = log_exported(result, model, spec, job.get("mlflow_run_id") or chosen.state.get("mlflow_run_id"),
                              uri, register)
    with open(os.path.join(out, EXPORT_FILE), "w") as f:
        json.dump(result.record(), f, indent=2)
    return result


def export_tracking_uri(spec: JobSpec, job: dict[str, Any]) -> str:
    """Where `--mlflow` logs: the spec's tracking URI, whatever the run folder's job file says; a
    different one recorded there is said, not followed."""
    stored = job.get("tracking_uri")
    if stored and redact_uri(spec.tracking.uri) != stored:
        print(f"[tidal] the job's run folder names another MLflow server ({redact_uri(str(stored))}); the model is "
              f"logged to the spec's ({redact_uri(spec.tracking.uri)}): set tracking.uri to log it elsewhere",
              file=sys.stderr, flush=True)
    return spec.tracking.uri


def check_format(format: str, spec: JobSpec) -> None:
    if format not in FORMATS:
        raise UsageError(f"--format {format!r}: choose one of {', '.join(FORMATS)}")
    m = spec.model
    if format == "hf" and m.builder:
        raise UsageError(f"--format hf: job {spec.name!r} trains a custom model (model.builder {m.builder}), which "
                         "has no Hugging Face form; use --format torch")
    if format == "hf" and spec.parallelism.pipeline_stages > 1:
        raise UsageError("--format hf: pipeline jobs export as --format torch (their layers load into the built-in GPT)")


def check_output(output: str | os.PathLike[str]) -> str:
    """The absolute output folder: new, empty, or an earlier export (which is replaced)."""
    if not os.fspath(output):
        raise UsageError("export needs an output folder: --output DIR (SDK: output=...)")
    out = os.path.abspath(os.fspath(output))
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--output {output}: a file is there; name a new or empty folder")
    if os.path.isdir(out) and os.listdir(out) and not os.path.isfile(os.path.join(out, EXPORT_FILE)):
        raise UsageError(f"--output {output}: the folder holds other files; name a new or empty folder "
                         "(an earlier export there would be replaced)")
    return out


def parse_checkpoint(which: str | int) -> str | int:
    """'latest' (or another name in CHOOSERS) or a step number; anything else is refused."""
    if isinstance(which, int) and not isinstance(which, bool):
        step = which
    elif isinstance(which, str) and which in CHOOSERS:
        return which
    elif isinstance(which, str) and which.strip().isdigit():
        step = int(which)
    else:
        raise UsageError(f"--checkpoint {which!r}: use {' or '.join(CHOOSERS)} or a step number (e.g. --checkpoint 40)")
    if step < 1:
        raise UsageError(f"--checkpoint {step}: steps start at 1; use latest or the step of a saved checkpoint")
    return step


def complete_checkpoints(run: RunDir) -> list[Candidate]:
    """Every checkpoint of the run whose ranks all finished writing, newest first."""
    found = []
    for path in run.checkpoints():
        problem, state = check_complete(run.fs, path)
        if problem is None:
            found.append(Candidate(int(state["step"]), path, state))
    return found


def choose(which: str | int, found: list[Candidate], spec: JobSpec) -> Candidate:
    """The checkpoint `which` names among the complete ones, or an error saying what exists."""
    where = f"{spec.checkpoint.storage.rstrip('/')}/{spec.name}"
    if not found:
        raise UsageError(
            f"job {spec.name!r} has no complete checkpoint in {where}. Run it first (tidal run SPEC), or point "
            "checkpoint.storage at where it ran (in the spec, --set checkpoint.storage=..., or $TIDAL_STORAGE); "
            "the job name must match too")
    if isinstance(which, str):
        return CHOOSERS[which](found, spec)
    for c in found:
        if c.step == which:
            return c
    steps = ", ".join(str(c.step) for c in sorted(found, key=lambda c: c.step))
    raise UsageError(f"--checkpoint {which}: job {spec.name!r} has no complete checkpoint at step {which} in {where}; "
                     f"complete checkpoints are at steps {steps} (or use --checkpoint latest)")


def check_same_model(spec: JobSpec, chosen: Candidate) -> None:
    """The model is rebuilt from the spec: refuse one whose model fields differ from the job's."""
    saved = {k: v for k, v in chosen.state.get("fingerprint", {}).items() if k.startswith("model.")}
    now = {k: v for k, v in spec.resume_fingerprint().items() if k.startswith("model.")}
    diffs = [f"{k}: {saved.get(k)!r} in the checkpoint, {now.get(k)!r} in the spec"
             for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    if saved and diffs:
        raise UsageError(f"the spec's model differs from the one job {spec.name!r} trained at step {chosen.step}:\n  "
                         + "\n  ".join(diffs) + "\nExport with the job file the job ran with (and the same --set overrides).")


def _uri(run: RunDir, path: str) -> str:
    from tidal.fs import is_local

    if is_local(run.fs):
        return path
    return f"{run.fs.type_name}://{path}"


def load_exported(path: str | os.PathLike[str]) -> Any:
    """A model exported with --format torch, rebuilt as the model the job trained (torch only:
    no DeepSpeed, no Ray). Its `forward(tokens, targets)` returns the mean next-token loss."""
    from tidal.exporter.save import load_torch

    return load_torch(os.fspath(path))


__all__ = ["CHOOSERS", "FORMATS", "Candidate", "Exported", "choose", "export", "load_exported", "parse_checkpoint"]
