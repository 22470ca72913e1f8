"""User code named in the spec (`module:function`) and the optimizer by name: checks at spec load.

The references are only checked for form here: the driver never imports user code (it may need
libraries or devices only the workers have); the workers import it (tidal.worker.user_code).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidal.spec.job import JobSpec

REF = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")

# What each optimizer accepts besides lr and weight_decay (those come from train.lr / train.weight_decay).
# Checked here so that a typo fails at load, not after the workers started.
OPTIMIZER_ARGS = {
    "AdamW": ("betas", "eps"),
    "Adam": ("betas", "eps"),
    "SGD": ("momentum", "dampening", "nesterov"),
    "Lion": ("betas",),
}
RESHARDABLE = ("AdamW", "Adam")  # what ds_to_universal converts: exp_avg and exp_avg_sq
FROM_TRAIN = {"lr": "train.lr", "weight_decay": "train.weight_decay"}


def check_ref(value: str | None) -> str | None:
    """A pydantic field validator: `pkg.module:function`, or a message saying how to write one."""
    if value is None or REF.match(value):
        return value
    raise ValueError(f"{value!r} is not a 'module:function' reference; write e.g. 'my_models.mlp:build' for the "
                     "function build in my_models/mlp.py, relative to the job's working directory (where you run "
                     "tidal, or the --working-dir of tidal submit)")


def user_code_problems(spec: JobSpec) -> list[tuple[str, str]]:
    m, d, t, par = spec.model, spec.data, spec.train, spec.parallelism
    problems: list[tuple[str, str]] = []
    if d.dataset and d.source != "synthetic":
        problems.append(("data.dataset", f"replaces data.source ({d.source!r}); keep one of them"))
    if d.dataset_args and not d.dataset:
        problems.append(("data.dataset_args", "are arguments for data.dataset, which is not set"))
    if m.builder_args and not m.builder:
        problems.append(("model.builder_args", "are arguments for model.builder, which is not set"))
    if par.pipeline_stages > 1 and (d.dataset or t.step_fn):
        field = "data.dataset" if d.dataset else "train.step_fn"
        problems.append((field, "pipeline stages run the built-in GPT on token batches only; use ZeRO-3 "
                         "(parallelism.pipeline_stages 1) with your own data or step"))
    problems += _optimizer_problems(spec)
    return problems


def _optimizer_problems(spec: JobSpec) -> list[tuple[str, str]]:
    opt, par = spec.train.optimizer, spec.parallelism
    problems: list[tuple[str, str]] = []
    allowed = OPTIMIZER_ARGS[opt.name]
    for key in opt.args:
        if key in FROM_TRAIN:
            problems.append((f"train.optimizer.args.{key}", f"conflicts with {FROM_TRAIN[key]} (Tidal derives it); "
                             f"set {FROM_TRAIN[key]} instead"))
        elif key not in allowed:
            problems.append((f"train.optimizer.args.{key}", f"{opt.name} takes {', '.join(allowed)} here "
                             "(lr and weight_decay come from train.lr and train.weight_decay)"))
    if opt.name not in RESHARDABLE and spec.elastic and par.zero_stage > 0:
        problems.append(("train.optimizer.name", f"{opt.name} cannot change world size under ZeRO: Tidal reshards "
                         "through DeepSpeed's universal checkpoints, which carry Adam's state only; use AdamW or Adam "
                         "for an elastic job, or fix its size (scaling.min_workers = scaling.max_workers)"))
    if opt.name == "Lion" and spec.scaling.gpus_per_worker == 0 and par.offload_optimizer == "none":
        problems.append(("train.optimizer.name", "DeepSpeed's Lion runs on GPUs (scaling.gpus_per_worker >= 1) or "
                         "as its CPU Lion with parallelism.offload_optimizer cpu; on CPU alone use AdamW, Adam or SGD"))
    return problems


def resize_refusal(spec: JobSpec, world_size: int) -> str | None:
    """Why a checkpoint written at another world size cannot load at `world_size` (None: it can)."""
    name = spec.train.optimizer.name
    if name in RESHARDABLE:
        return None
    return (f"cannot resume at {world_size} worker(s) from a checkpoint written at another world size: "
            f"train.optimizer {name}'s state does not convert to DeepSpeed's universal checkpoint (Adam's only); "
            "run the job at the world size that wrote it")
