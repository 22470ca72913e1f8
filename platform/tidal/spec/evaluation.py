"""The `eval:` section of a job spec and `checkpoint.keep_best`. Pydantic only, like all of tidal.spec.

An evaluation computes the mean loss over a fixed set of held-out sequences (the same ones every
time, so values compare across steps), on every worker at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tidal.spec.sources import source_problem

if TYPE_CHECKING:
    from tidal.spec.job import JobSpec


class EvalSpec(BaseModel):
    """Held-out evaluation every `every_steps` steps, at every checkpoint and at the end."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    source: str | None = Field(
        None, description="held-out data, of the same kinds as data.source ('synthetic', .txt, .jsonl, .parquet; a "
        "path or URI), read whole by every worker. Default: a split of data.source (eval.holdout) that training never "
        "sees; for the synthetic task, sequences drawn with another seed"
    )
    holdout: int | float | None = Field(
        None, description="without eval.source: the training samples (windows of seq_len+1 tokens) set aside for "
        "evaluation, as a fraction (0.05) or a count (200), chosen by a seeded draw; training never reads them"
    )
    every_steps: int = Field(50, ge=1, description="steps between evaluations (also at every checkpoint and the last step)")
    batches: int = Field(4, ge=1, description="batches of train.global_batch sequences per evaluation, over all workers")
    patience: int | None = Field(
        None, ge=1, description="early stopping: end the job, with a checkpoint, after this many evaluations in a "
        "row without an eval_loss below the best so far by more than min_delta"
    )
    min_delta: float = Field(0.0, ge=0.0, description="early stopping: the smallest drop of eval_loss that counts")

    @model_validator(mode="after")
    def _holdout_range(self) -> EvalSpec:
        h = self.holdout
        if isinstance(h, float) and not 0.0 < h < 1.0:
            raise ValueError(f"holdout: a fraction must lie strictly between 0 and 1, got {h}; or give a count such as 200")
        if isinstance(h, int) and h < 1:
            raise ValueError(f"holdout: a count of samples must be at least 1, got {h}")
        return self


class KeepBestSpec(BaseModel):
    """Keep the best checkpoints by an evaluation metric (Ray Train's score-based retention)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    metric: Literal["eval_loss", "eval_perplexity"] = "eval_loss"
    mode: Literal["min", "max"] = "min"


def eval_problems(spec: JobSpec) -> list[tuple[str, str]]:
    """Evaluation settings that cannot work together with the rest of the spec; each names the field."""
    ev, data = spec.eval, spec.data
    problems: list[tuple[str, str]] = []
    if spec.checkpoint.keep_best is not None and ev is None:
        problems.append(("checkpoint.keep_best", "ranks checkpoints by an evaluation metric: add an eval section "
                         "(e.g. eval: {every_steps: 50})"))
    if ev is None:
        return problems
    if data.dataset or spec.train.step_fn:
        # The evaluator measures a language model's held-out loss on token sequences; a user's own
        # dataset and step have no held-out split or eval step Tidal could call yet.
        field = "data.dataset" if data.dataset else "train.step_fn"
        problems.append(("eval", f"evaluation of jobs with {field} is not supported yet; remove the eval section"))
        return problems
    if spec.parallelism.pipeline_stages > 1:
        problems.append(("eval", "evaluation of pipeline-parallel jobs is not supported yet; remove the eval section "
                         "or set parallelism.pipeline_stages 1"))
    if ev.source is not None:
        if (bad := source_problem(ev.source)) is not None:
            problems.append(("eval.source", bad))
        if ev.holdout is not None:
            problems.append(("eval.holdout", "splits data.source, but eval.source is set: remove one of them"))
    elif data.source == "synthetic":
        if ev.holdout is not None:
            problems.append(("eval.holdout", "the synthetic task has nothing to split: evaluation draws fresh "
                             "sequences with another seed; remove eval.holdout"))
    elif data.streaming:
        problems.append(("eval.source", "a split of a streamed source is not supported: set eval.source to a "
                         "held-out file (read whole by every worker)"))
    elif ev.holdout is None:
        problems.append(("eval.holdout", f"say how much of {data.source} to hold out for evaluation: a fraction "
                         "(e.g. 0.05) or a count of samples (e.g. 200); or set eval.source to held-out data"))
    return problems
