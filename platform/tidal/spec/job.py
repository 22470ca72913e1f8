"""JobSpec: the one typed description of a job. DeepSpeed, Ray and MLflow settings derive from it."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from tidal.errors import SpecError
from tidal.redact import redact_data
from tidal.spec import secrets
from tidal.spec.consistency import consistency_problems
from tidal.spec.evaluation import EvalSpec
from tidal.spec.parse import apply_overrides, read_yaml, validated
from tidal.spec.scheduling import SchedulingSpec
from tidal.spec.secrets import SecretRef
from tidal.spec.sections import (
    NAME_PATTERN,
    CheckpointSpec,
    DataSpec,
    FailureSpec,
    ModelSpec,
    ParallelismSpec,
    Part,
    ScalingSpec,
    TrackingSpec,
    TrainSpec,
    reserved_name,
)
from tidal.spec.sweep import SweepSpec, sweeps_fields_of


class JobSpec(Part):
    """A training job. Load it with `JobSpec.from_yaml`, change it with `with_overrides`."""

    name: str = Field("tidal-job", pattern=NAME_PATTERN, description="names the MLflow run and the checkpoint folder; "
                      "not ending in .lease, -sweep or -tN, which name other jobs' folders (a lease, a sweep's "
                      "state, a sweep's trial N)")
    model: ModelSpec = Field(default_factory=ModelSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec)
    scaling: ScalingSpec = Field(default_factory=ScalingSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    failure: FailureSpec = Field(default_factory=FailureSpec)
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    sweep: SweepSpec | None = Field(None, description="run this job as a Ray Tune sweep with `tidal sweep`")
    eval: EvalSpec | None = Field(None, description="held-out evaluation: eval_loss and eval_perplexity in MLflow")
    env: dict[str, SecretRef] = Field(
        default_factory=dict,
        description="secrets for the workers, by reference, never by value: NAME: env:NODE_VAR (a variable in the "
        "nodes' environment) or NAME: file:/abs/path (a file on the nodes, e.g. a mounted Kubernetes Secret; one "
        "trailing newline dropped); {from_env: ...} / {from_file: ...} also work. Read on each training worker "
        "before user code runs; an inline value is refused. The driver, tracking and data preparation use the "
        "nodes' own environment",
    )
    worker_env: dict[str, str] = Field(
        default_factory=dict,
        description="plain, non-secret environment variables for the workers (NCCL_DEBUG, HF_HOME...): published "
        "like every spec field (Ray Train, MLflow params), so a name that says it holds a credential is refused",
    )

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, name: str) -> str:
        if why := reserved_name(name):
            raise ValueError(why)
        return name

    _env_refs = field_validator("env", mode="before")(secrets.check_env)
    _worker_env = field_validator("worker_env")(secrets.check_worker_env)

    def model_post_init(self, _context: Any) -> None:
        problems = consistency_problems(self)
        if problems:
            raise SpecError(problems)

    # --- constructors -------------------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], overrides: list[str] | None = None) -> JobSpec:
        """Load a YAML job file; `overrides` are `a.b=value` strings applied on top."""
        return validated(cls, apply_overrides(read_yaml(path), overrides or []), source=str(path))

    def with_overrides(self, overrides: Mapping[str, Any] | list[str]) -> JobSpec:
        """A copy with dotted fields replaced, e.g. `{"train.lr": 1e-3}` or `["train.lr=1e-3"]`."""
        data = apply_overrides(self.model_dump(mode="json"), overrides)
        return validated(type(self), data, source="overrides")

    # --- derived views ------------------------------------------------------------------
    @property
    def elastic(self) -> bool:
        return self.scaling.min_workers != self.scaling.max_workers

    def flat(self) -> dict[str, Any]:
        """`section.key -> value`, the form MLflow params take; redacted as `redacted()` is."""
        return _flatten(self.redacted())

    def redacted(self) -> dict[str, Any]:
        """The spec as data for printing and tracking, credentials in any field (a URI's user-info,
        a signed URL's query) masked by tidal.redact's rule. `env` holds references to secrets
        (tidal.spec.secrets), never values: they are shown, so a reader sees where each comes from."""
        return redact_data(self.model_dump(mode="json"))

    def resume_fingerprint(self) -> dict[str, Any]:
        """Fields that must match between a checkpoint and the job resuming from it."""
        keep = ("model.", "parallelism.zero_stage", "parallelism.pipeline_stages", "train.global_batch", "train.seed",
                "data.source", "data.tokenizer", "data.dataset", "eval.holdout")  # a holdout changes what training reads
        # What a stream's windows and their order depend on; only for streamed jobs, so that others
        # keep the fingerprint (and MLflow run) they had before streaming joined it. Not data.epochs:
        # it says only where the job ends (as train.steps does), never which windows a step trains,
        # so a finished job can go on for more passes (`--set data.epochs=N`, as the CLI suggests).
        stream = ("data.streaming", "data.text_field", "data.shard_windows") if self.data.streaming else ()
        # A job without a holdout has the fingerprint it had before eval existed (same MLflow run).
        return {k: v for k, v in self.flat().items()
                if (k.startswith(keep) or k in stream) and (v is not None or k != "eval.holdout")}

    def fingerprint_hash(self) -> str:
        blob = json.dumps(self.resume_fingerprint(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def resolved(self, base: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None) -> JobSpec:
        """The spec with every place filled in and made absolute, once, at the edge (workers run
        in other directories).

        Storage, tracking URI and experiment: the spec's value, else the cluster's environment
        (`TIDAL_STORAGE`, `MLFLOW_TRACKING_URI`, `MLFLOW_EXPERIMENT_NAME`), else the local defaults.
        Relative paths resolve against `base` (default: cwd), except inside Ray's working-dir cache
        (a submitted job), where nothing may be kept: there a relative storage path goes under
        `TIDAL_STORAGE`, and anything else relative is refused.
        """
        from tidal.spec.places import resolved_places

        return self.with_overrides(resolved_places(self, Path(base or os.getcwd()),
                                                   os.environ if environ is None else environ))


sweeps_fields_of(JobSpec)


def notes(spec: JobSpec) -> list[str]:
    """What runs differently from what the spec says, one line each (the CLI prints them)."""
    _, warmup = spec.train.warmup_plan()
    return [warmup] if warmup else []


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out
