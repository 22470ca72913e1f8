"""`parallelism.deepspeed`: DeepSpeed config keys a user adds to the config Tidal derives.

A key Tidal derives from another field is refused, naming that field, never silently replaced
(either way would leave two sources for one value). As in accelerate's DeepSpeed integration,
"auto" stands for "the value Tidal derives", so a config written for other tools can be pasted in.
Keys Tidal only defaults (steps_per_print, fp16.loss_scale...) are the user's to change.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

AUTO = "auto"
# DeepSpeed key (dotted path) -> the spec field Tidal derives it from.
DERIVED = {
    "train_batch_size": "train.global_batch",
    "train_micro_batch_size_per_gpu": "train.micro_batch",
    "gradient_accumulation_steps": "train.global_batch",  # / (train.micro_batch x workers), per world size
    "gradient_clipping": "train.grad_clip",
    "zero_optimization.stage": "parallelism.zero_stage",
    "zero_optimization.offload_optimizer": "parallelism.offload_optimizer",
    "zero_optimization.offload_param": "parallelism.offload_params",
    "zero_force_ds_cpu_optimizer": "parallelism.offload_optimizer",
    "bf16.enabled": "parallelism.precision",
    "fp16.enabled": "parallelism.precision",
    "optimizer": "train.optimizer",
    "zero_allow_untested_optimizer": "train.optimizer",
    "scheduler": "train.schedule",
    "pipeline": "parallelism.pipeline_stages",
    "checkpoint.load_universal": "scaling.min_workers",  # set when a job resumes at another world size
}
FIELD = "parallelism.deepspeed"


def passthrough_problems(extra: Mapping[str, Any]) -> list[tuple[str, str]]:
    """One (field, message) per key of `extra` that Tidal derives, or that says "auto" where Tidal derives nothing."""
    problems = []
    for path, value in _leaves(extra):
        owner = _derived_owner(path)
        if owner is None:
            if value == AUTO:
                problems.append((f"{FIELD}.{path}", f'"auto" stands for a value Tidal derives, and it derives no '
                                 f"{path}; give a value"))
            continue
        if value == AUTO and path in DERIVED:
            continue
        derived = owner
        problems.append((f"{FIELD}.{path}", f"conflicts with {DERIVED[derived]} (Tidal derives {derived} from it); "
                         f'set {DERIVED[derived]} instead, or write "auto"'))
    return problems


def merged(derived: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """`derived` with `extra`'s keys added (nested mappings merged; "auto" leaves dropped).

    Call after `passthrough_problems(extra)` found nothing: a derived key is never replaced here.
    """
    out = dict(derived)
    for key, value in extra.items():
        if value == AUTO:
            continue
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merged(dict(out[key]), value)
        else:  # a key Tidal only defaults (steps_per_print...), or one it does not set
            out[key] = value
    return out


def _leaves(d: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for k, v in d.items():
        path = f"{prefix}{k}"
        if isinstance(v, Mapping) and v and path not in DERIVED:
            out += _leaves(v, path + ".")
        else:
            out.append((path, v))
    return out


def _derived_owner(path: str) -> str | None:
    """The derived key that `path` is, lies inside, or holds; None if it touches none."""
    for key in DERIVED:
        if path == key or path.startswith(key + ".") or key.startswith(path + "."):
            return key
    return None
