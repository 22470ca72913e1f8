"""Checks that span several fields of a job spec; each problem names the field to change and how."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from tidal.spec.batch import bad_world_sizes, micro_batch_bound
from tidal.spec.compile import compile_problems
from tidal.spec.evaluation import eval_problems
from tidal.spec.passthrough import passthrough_problems
from tidal.spec.sources import source_problem
from tidal.spec.user_refs import user_code_problems

if TYPE_CHECKING:
    from tidal.spec.job import JobSpec
    from tidal.spec.sections import DataSpec


def consistency_problems(spec: JobSpec) -> list[tuple[str, str]]:
    """Checks that span several fields; each problem names the field to change."""
    problems: list[tuple[str, str]] = []
    s, t = spec.scaling, spec.train
    problems += _pipeline_problems(spec)
    stages = spec.parallelism.pipeline_stages
    if t.micro_batch == "auto" and stages > 1:
        problems.append(("train.micro_batch", "auto needs parallelism.pipeline_stages 1 (DeepSpeed's pipeline "
                         "schedule fixes the micro-batch when the engine is built); give a number"))
    micro = micro_batch_bound(spec)  # for auto, the largest it may choose (none fits: 1, and the error below)
    bad = bad_world_sizes(t.global_batch, micro, s.min_workers // stages, s.max_workers // stages)
    if stages > 1 and bad:
        problems.append(("train.global_batch", f"{t.global_batch} must be a multiple of train.micro_batch ({micro}) "
                         f"x data-parallel replicas ({s.max_workers // stages} = {s.max_workers} workers / {stages} stages)"))
    elif bad:
        unit = micro * math.lcm(*range(s.min_workers, s.max_workers + 1))
        near = sorted({unit * max(1, t.global_batch // unit), unit * -(-t.global_batch // unit)})
        problems.append(
            ("train.global_batch",
             f"{t.global_batch} cannot stay fixed at world size(s) {bad}: it must be a multiple of "
             f"train.micro_batch ({micro}) x each world size in [{s.min_workers}, {s.max_workers}]; "
             f"try global_batch {' or '.join(map(str, near))}, or narrow the scaling range")
        )
    if spec.parallelism.precision == "fp16" and s.gpus_per_worker == 0:
        problems.append(("parallelism.precision", "fp16 needs GPUs (scaling.gpus_per_worker >= 1); use fp32 or bf16 on CPU"))
    problems += _data_problems(spec.data)
    problems += eval_problems(spec)
    if spec.data.source != "synthetic" and spec.data.tokenizer is None and spec.model.vocab_size < 256:
        problems.append(("model.vocab_size", f"text is tokenized to bytes, so it needs at least 256; got {spec.model.vocab_size}"))
    par = spec.parallelism
    if spec.data.streaming and spec.data.source == "synthetic":
        problems.append(("data.streaming", "streams a file source; set data.source to a .txt, .jsonl or .parquet file"))
    if spec.data.epochs and not spec.data.streaming:
        problems.append(("data.epochs", "applies to streamed sources; set data.streaming true, or set train.steps instead"))
    if spec.data.streaming and par.pipeline_stages > 1:
        problems.append(("data.streaming", "pipeline stages of one replica must read the same samples, which a "
                         "sharded stream cannot give; set data.streaming false"))
    if spec.failure.replace_in_place and par.zero_stage == 3:
        # A survivor's ZeRO-3 engine rebuilt in its own process numbers its parameters unlike the
        # replacement's new process, and ZeRO-3's first step fails on every rank (DeepSpeed 0.19)
        problems.append(("failure.replace_in_place", "is not supported with parallelism.zero_stage: 3 yet (a "
                         "survivor's rebuilt ZeRO-3 engine disagrees with the replacement's); use zero_stage 1 or "
                         "2, or set failure.replace_in_place: false"))
    if par.offload_optimizer != "none" and par.zero_stage == 0:
        problems.append(("parallelism.offload_optimizer", "needs parallelism.zero_stage 1, 2 or 3"))
    if par.offload_params != "none" and par.zero_stage != 3:
        problems.append(("parallelism.offload_params", "parameter offload needs parallelism.zero_stage 3"))
    if "nvme" in (par.offload_optimizer, par.offload_params) and not par.nvme_path:
        problems.append(("parallelism.nvme_path", "nvme offload needs a path to a fast local disk on every node"))
    problems += compile_problems(par.compile, par.pipeline_stages, s.gpus_per_worker, par.zero_stage)
    problems += user_code_problems(spec)
    problems += passthrough_problems(par.deepspeed)
    return problems


def _pipeline_problems(spec: JobSpec) -> list[tuple[str, str]]:
    par, s, m = spec.parallelism, spec.scaling, spec.model
    n = par.pipeline_stages
    if n == 1:
        return []
    problems: list[tuple[str, str]] = []
    if par.zero_stage > 1:
        problems.append(("parallelism.zero_stage", f"{par.zero_stage} cannot shard a pipeline: DeepSpeed runs pipeline "
                         "stages with ZeRO stage 0 or 1 only; set zero_stage 1, or pipeline_stages 1"))
    if (par.offload_optimizer, par.offload_params) != ("none", "none"):
        problems.append(("parallelism.pipeline_stages", "offload is not supported with pipeline stages in Tidal; "
                         "use ZeRO-3 with offload (pipeline_stages 1) to fit a model that does not fit in memory"))
    if m.hf_config is not None or m.hf_pretrained is not None or m.builder:
        problems.append(("parallelism.pipeline_stages", "only the built-in GPT can be split into pipeline stages; "
                         "train a Hugging Face or custom model with ZeRO-3 instead (pipeline_stages 1)"))
    elif m.n_layer < n:
        problems.append(("parallelism.pipeline_stages", f"{n} stages need at least {n} layers; model.n_layer is {m.n_layer}"))
    if s.min_workers != s.max_workers or s.max_workers % n:
        problems.append(("scaling.min_workers", f"a pipeline job needs a fixed world size that is a multiple of "
                         f"parallelism.pipeline_stages ({n}): Ray Train's elastic range may pick any size in "
                         f"[{s.min_workers}, {s.max_workers}], which would split a pipeline; set min_workers = "
                         f"max_workers = replicas x {n}"))
    return problems


def _data_problems(data: DataSpec) -> list[tuple[str, str]]:
    tok = data.tokenizer
    if tok is not None and data.source == "synthetic":
        return [("data.tokenizer", "tokenizes text sources; the synthetic task has its own tokens")]
    if tok is not None and "://" not in tok and not Path(tok).is_dir():
        return [("data.tokenizer", f"directory not found: {tok} (a Hugging Face tokenizer saved with save_pretrained)")]
    bad = source_problem(data.source)
    return [("data.source", bad)] if bad else []
