"""The sections of a job spec (model, data, train, parallelism, scaling, checkpoint, failure,
tracking): each a pydantic model that refuses unknown keys. `tidal.spec.job.JobSpec` holds them."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tidal.spec.compile import CompileSpec, compile_shorthand
from tidal.spec.evaluation import KeepBestSpec
from tidal.spec.user_refs import check_ref

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$"
# Folders Tidal keeps beside a job's own `<storage>/<name>`: its lease (`<name>.lease`, tidal/lease.py)
# and a sweep's state (`<name>-sweep`); a sweep's trial `N` is the job `<name>-tN`. A job named
# with one of these endings would own another job's lease or sweep folder.
RESERVED_SUFFIXES = (".lease", "-sweep")
TRIAL_SUFFIX = re.compile(r"-t[0-9]+$")


def reserved_name(name: str) -> str | None:
    """Why `name` cannot name a job (a suffix Tidal keeps for another job's folder), or None."""
    for suffix in RESERVED_SUFFIXES:
        if name.endswith(suffix):
            owner = name.removesuffix(suffix)
            what = "lease" if suffix == ".lease" else "sweep state"
            return (f"{name!r} ends in {suffix!r}, which names job {owner!r}'s {what} folder beside its run "
                    "folder; choose a name that does not end so")
    return None


def trial_name(name: str) -> str | None:
    """Why a job that is not a sweep's trial cannot take `name` (`<sweep>-tN` is trial N's), or None."""
    if m := TRIAL_SUFFIX.search(name):
        return (f"{name!r} ends in {m.group()!r}, which names trial {m.group()[2:]} of sweep "
                f"{name[:m.start()]!r} (its folder, lease and MLflow run); choose a name that does not end so")
    return None
DEFAULT_WARMUP_STEPS = 20


class Part(BaseModel):
    """Base of every spec section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSpec(Part):
    """The built-in decoder-only GPT (n_layer...seq_len), or a Hugging Face causal LM, or your own.

    `seq_len` and `vocab_size` also shape the data for every kind of model.
    """

    n_layer: int = Field(4, ge=1, description="transformer blocks")
    n_head: int = Field(4, ge=1, description="attention heads; must divide d_model")
    d_model: int = Field(256, ge=8, description="hidden size")
    vocab_size: int = Field(256, ge=2, description="tokens; 256 = byte-level text")
    seq_len: int = Field(64, ge=2, description="tokens per training sequence")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    hf_config: dict[str, Any] | str | None = Field(
        None, description="a Hugging Face causal LM built from this config (a dict, or a path to a config dir/JSON); no download"
    )
    hf_pretrained: str | None = Field(None, description="a local directory with Hugging Face pretrained weights")
    builder: str | None = Field(
        None, description="'pkg.module:function' returning any torch nn.Module, imported on the workers from the job's "
        "working directory; called as function(model_spec, **model.builder_args). Without train.step_fn its "
        "forward(*batch) must return the loss",
    )
    builder_args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for model.builder")

    _builder_ref = field_validator("builder")(check_ref)

    @model_validator(mode="after")
    def _one_model(self) -> ModelSpec:
        chosen = [k for k in ("hf_config", "hf_pretrained", "builder") if getattr(self, k)]
        if len(chosen) > 1:
            raise ValueError(f"{chosen[1]}: choose one of hf_config, hf_pretrained or builder (got {', '.join(chosen)})")
        if not chosen and self.d_model % self.n_head:
            raise ValueError(f"n_head: must divide model.d_model ({self.d_model}); got {self.n_head}")
        return self


class DataSpec(Part):
    source: str = Field(
        "synthetic",
        description="'synthetic' (a learnable task, no download), or a .txt, .jsonl or .parquet file: a path or a URI (s3://...)",
    )
    text_field: str = Field("text", description="the field holding the text in .jsonl records and .parquet rows")
    tokenizer: str | None = Field(
        None, description="a Hugging Face tokenizer directory (save_pretrained output) readable on every node; "
        "nothing is downloaded. Default: bytes, a vocabulary of 256"
    )
    streaming: bool = Field(
        False, description="for data larger than a worker's memory: Ray Data tokenizes the source once, before "
        "training, into shards on the job's storage, and each worker reads only the shards of its windows; false: "
        "every worker reads the source whole. Both train each window once per epoch in the same global batches at "
        "any world size, across restarts and resizes"
    )
    epochs: int | None = Field(
        None, ge=1, description="with streaming: passes over the source, after which the job ends at the last whole "
        "step (train.steps is then an upper bound); default: as many as train.steps needs"
    )
    shard_windows: int | None = Field(
        None, ge=1, description="with streaming: windows (model.seq_len + 1 tokens) per shard; default: about 4 MiB "
        "of tokens per shard"
    )
    dataset: str | None = Field(
        None, description="'pkg.module:function' returning your own map-style torch Dataset (__len__ and "
        "__getitem__), imported on the workers from the job's working directory and called as "
        "function(**data.dataset_args); it must give the same samples on every worker. Tidal orders it by a seeded "
        "permutation per epoch, so a sample index is its resumable position"
    )
    dataset_args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for data.dataset")
    input_bound_share: float = Field(
        0.2, ge=0.0, lt=1.0, description="say once (console, MLflow tag tidal.input_bound, Prometheus "
        "ray_tidal_input_bound) that the job is input-bound when waiting for data takes this share of rank 0's step "
        "time over data.input_bound_intervals log intervals; 0 turns it off"
    )
    input_bound_intervals: int = Field(5, ge=1, description="log intervals the data-wait share is summed over")

    _dataset_ref = field_validator("dataset")(check_ref)


class OptimizerSpec(Part):
    name: Literal["AdamW", "Adam", "SGD", "Lion"] = Field(
        "AdamW", description="Lion runs on GPUs, or on CPU with parallelism.offload_optimizer (DeepSpeed's Lion)"
    )
    args: dict[str, Any] = Field(
        default_factory=dict, description="the optimizer's own arguments, e.g. {betas: [0.9, 0.99]} or "
        "{momentum: 0.9, nesterov: true}; lr and weight_decay come from train.lr and train.weight_decay"
    )


class TrainSpec(Part):
    steps: int = Field(200, ge=1, description="optimizer steps in the whole job")
    micro_batch: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        8, description="sequences per worker per forward pass; auto: before the first step, the largest that fits "
        "(a binary search with real steps of the job's own model, among the sizes that keep train.global_batch at "
        "every world size), halved (and the step redone) after an out-of-memory error; the job keeps its choice "
        "across restarts"
    )
    global_batch: int = Field(32, ge=1, description="sequences per optimizer step, fixed at any world size")
    lr: float = Field(3e-4, gt=0.0, le=1.0)
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="cosine floor as a fraction of lr")
    warmup_steps: int | None = Field(
        None, ge=0, description=f"steps of linear warmup (default {DEFAULT_WARMUP_STEPS} unless train.warmup is set); "
        "a warmup as long as the job is shortened to train.steps - 1, with a note"
    )
    warmup: float | None = Field(
        None, ge=0.0, le=1.0, description="warmup as a fraction of train.steps (e.g. 0.05), instead of warmup_steps"
    )
    schedule: Literal["cosine", "linear", "constant", "wsd"] = Field(
        "cosine", description="after warmup: cosine or linear decay to train.min_lr_ratio, constant, or wsd "
        "(warmup-stable-decay: constant, then a linear decay over the last train.decay_fraction of the steps)"
    )
    decay_fraction: float = Field(0.2, gt=0.0, le=1.0, description="with schedule wsd: the share of train.steps "
                                  "spent decaying at the end")
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    step_fn: str | None = Field(
        None, description="'pkg.module:function' returning the loss of one micro-batch, for objectives other than "
        "next-token prediction: function(model, batch) -> scalar tensor (model is the DeepSpeed engine: call it like "
        "your module). Default: model(*batch)"
    )
    weight_decay: float = Field(0.0, ge=0.0)
    grad_clip: float = Field(1.0, ge=0.0, description="0 disables clipping")
    seed: int = Field(0, ge=0)
    log_every: int = Field(10, ge=1, description="steps between progress lines and MLflow points")
    stop_at: int | None = Field(
        None, ge=1, description="end this launch after that step, with a checkpoint; the same job run again continues"
    )

    _step_ref = field_validator("step_fn")(check_ref)

    @model_validator(mode="after")
    def _one_warmup(self) -> TrainSpec:
        if self.warmup is not None and self.warmup_steps is not None:
            raise ValueError(f"warmup: {self.warmup} and train.warmup_steps ({self.warmup_steps}) are both set; "
                             "keep one (e.g. --set train.warmup_steps=null)")
        return self

    def warmup_plan(self) -> tuple[int, str | None]:
        """(warmup steps the schedule uses, a note when that differs from what the spec asked for).

        A warmup as long as the job leaves no step at the peak rate; like other trainers we shorten
        it rather than refuse a short run (`--set train.steps=10` on any job).
        """
        if self.warmup is not None:
            # round() first: 0.1 * 30 is 3.0000000000000004, which ceil would make 4
            asked, field = math.ceil(round(self.warmup * self.steps, 6)), "train.warmup"
            shown = f"{self.warmup} x {self.steps} steps = {asked}"
        else:
            asked = DEFAULT_WARMUP_STEPS if self.warmup_steps is None else self.warmup_steps
            field, shown = "train.warmup_steps", f"{asked}{' (the default)' if self.warmup_steps is None else ''}"
        if asked < self.steps:
            return asked, None
        steps = self.steps - 1
        return steps, (f"{field} {shown} is not below train.steps ({self.steps}): "
                       f"warming up over {steps} step(s) instead")


class ParallelismSpec(Part):
    zero_stage: Literal[0, 1, 2, 3] = 2
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    offload_optimizer: Literal["none", "cpu", "nvme"] = Field("none", description="ZeRO-Offload of optimizer state")
    offload_params: Literal["none", "cpu", "nvme"] = Field("none", description="ZeRO-3 parameter offload")
    nvme_path: str | None = Field(None, description="a fast local disk for nvme offload, on every node")
    activation_checkpointing: bool = False
    compile: CompileSpec | None = Field(
        None, description="torch.compile the model (DeepSpeed's engine.compile()): true, or options such as "
        "{backend: inductor, mode: max-autotune}; ZeRO 0-2 without pipeline stages. The first steps of each launch "
        "compile and are left out of tokens/s and MFU"
    )
    pipeline_stages: int = Field(
        1, ge=1, description="split the built-in GPT into this many DeepSpeed pipeline stages, one worker each; "
        "world size = stages x data-parallel replicas"
    )
    pipeline_partition: Literal["parameters", "uniform"] = Field(
        "parameters", description="how layers go to stages: balanced by parameter count, or by layer count"
    )
    deepspeed: dict[str, Any] = Field(
        default_factory=dict, description="DeepSpeed config keys merged into the one Tidal derives, e.g. "
        "{zero_optimization: {reduce_bucket_size: 5.0e+7}}; a key Tidal derives from another field is refused "
        "(set that field instead), or may be given as \"auto\""
    )

    _compile_shorthand = field_validator("compile", mode="before")(compile_shorthand)

    def data_parallel_size(self, world_size: int) -> int:
        """Replicas of the model: each pipeline spans `pipeline_stages` workers."""
        return world_size // self.pipeline_stages


class ScalingSpec(Part):
    min_workers: int = Field(2, ge=1)
    max_workers: int = Field(2, ge=1)
    cpus_per_worker: float = Field(1.0, gt=0.0)
    gpus_per_worker: int = Field(0, ge=0, description="whole GPUs per worker; 0 trains on CPU")
    elastic_check_s: float = Field(
        60.0, gt=0.0, description="how often an elastic job looks for room to grow"
    )
    peak_tflops_per_worker: float | None = Field(
        None, gt=0.0, description="peak TFLOP/s of one worker for MFU; default: a table by GPU model, or measured CPU cores"
    )
    site: Literal["onprem", "cloud", "any"] = Field(
        "any", description="where workers may run: nodes labelled tidal.io/site=onprem, =cloud, or either (on-prem first)"
    )
    burst_after_s: float = Field(
        300.0, ge=0.0, description="with site 'any': how long to wait for on-prem room before asking for cloud nodes"
    )
    reference_run: str | None = Field(
        None, description="an MLflow run id (same tracking store) whose tokens/s per worker is the baseline for "
        "scaling_efficiency_vs_reference"
    )

    @model_validator(mode="after")
    def _range(self) -> ScalingSpec:
        if self.min_workers > self.max_workers:
            raise ValueError(f"min_workers: {self.min_workers} is above scaling.max_workers ({self.max_workers}); "
                             "set min_workers <= max_workers")
        return self


class MemorySpec(Part):
    """Snapshots in host memory between persistent checkpoints (on by default; `checkpoint.memory: null` turns
    them off): a worker's or a node's loss then resumes from the newest complete snapshot, a few steps back,
    reading nothing from storage."""

    every_steps: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", description="steps between snapshots: each rank's state is copied to host memory on its node, held "
        "by a keeper process that outlives the worker, and to a peer node; a restart resumes from the newest complete "
        "one when it is as new as the last checkpoint in storage or newer, at the worker count that wrote it or, by "
        "byte range, at another (a resize that needs a universal conversion reads storage). auto: sqrt(2 x a "
        "snapshot's measured cost x the time between faults) over the step time (Young/Daly; faults: those the "
        "job's groups met, with a prior of one per 4 hours), at most checkpoint.every_steps"
    )
    peer: bool = Field(True, description="also keep each snapshot on the next node of the group, so a node's loss "
                       "keeps it (no copy when the group runs on one node)")
    max_gb: float | None = Field(
        None, gt=0.0, description="host memory one node's keeper may hold, in GiB (two reused shared-memory slots "
        "for each of its ranks and of the ranks whose peer copies it keeps); a slot over it, or one that would leave "
        "under 10% of the node's (or pod's) memory free, is refused (said once) and restarts use the previous "
        "snapshot or storage. Default: half the node's memory"
    )


class CheckpointSpec(Part):
    every_steps: int = Field(
        50, ge=1, description="steps between checkpoints; a fault costs the steps since the last one. Least lost: a "
        "checkpoint about every sqrt(2 x its cost x the time between faults) (Young's rule, docs/reliability.md)"
    )
    keep: int = Field(3, ge=1, description="newest checkpoints kept")
    storage: str | None = Field(
        None, description="where each job's folder goes: a path every node shares, or a URI (s3://..., gs://...). "
        "Default: the cluster's $TIDAL_STORAGE, else ./tidal-runs"
    )
    async_upload: bool = Field(
        True, description="training waits only while the state is copied in memory; the write to storage runs in "
        "the background, one at a time (the next checkpoint waits for it). false: training waits for the write"
    )
    keep_best: KeepBestSpec | None = Field(
        None, description="also keep the best checkpoints by an eval metric: Ray Train then keeps the `keep` best "
        "by it, plus the newest (needs an eval section)"
    )
    resize: Literal["by_range", "universal"] = Field(
        "by_range", description="how a ZeRO checkpoint loads at another worker count. by_range: each new rank reads, "
        "by byte range, only the slices of the old partitions it will hold (no conversion). universal: through "
        "DeepSpeed's universal format, converted once beside the checkpoint (global_stepN_universal), spread over "
        "the ranks. Checkpoints by_range does not cover (pipeline, bf16 with ZeRO-1, NVMe offload, ZeRO-3 with "
        "frozen parameters) always go universal"
    )
    memory: MemorySpec | None = Field(
        default_factory=MemorySpec, description="a host-memory snapshot tier replicated to a peer node: a worker or "
        "node loss redoes about one snapshot interval instead of up to checkpoint.every_steps. On by default, its "
        "interval chosen (every_steps auto); e.g. {every_steps: 5} sets it, null turns the tier off. Not for "
        "streamed data or pipelines (their restarts read storage; such a job says the tier is off)"
    )
    safe_globals: list[str] = Field(
        default_factory=list, description="types and functions (module.name, as torch names them, e.g. numpy.dtype) "
        "that the model's own state holds and checkpoints may load besides tensors and DeepSpeed's types; loading "
        "refuses any other. The first save fails naming what is missing here"
    )

    @field_validator("memory", mode="before")
    @classmethod
    def _memory_on_or_null(cls, value: Any) -> Any:
        # `false`/`off` read as "off" to a user but would fail as "not a dictionary": say the spelling.
        if value is None or isinstance(value, (dict, MemorySpec)):
            return value
        raise ValueError("null turns the memory tier off; {} (every_steps auto) or {every_steps: N, peer: true|false, "
                         f"max_gb: G}} sets it (got {value!r})")

    @field_validator("safe_globals")
    @classmethod
    def _dotted_names(cls, names: list[str]) -> list[str]:
        for name in names:
            if not all(part.isidentifier() for part in name.replace(":", ".").split(".")):
                raise ValueError(f"{name!r} is not a dotted name such as numpy.dtype or numpy._core.multiarray.scalar")
        return names


class FailureSpec(Part):
    max_restarts: int = Field(3, ge=-1, description="worker-group restarts allowed; -1 = unlimited")
    step_timeout_s: float | None = Field(
        None, ge=0.0, description="a fixed step deadline: a worker with no finished step for this long (e.g. stuck "
        "in a collective) ends the group, naming the rank that stopped and saving every rank's stacks, and the group "
        "restarts from the last checkpoint; 0 disables. Armed after the first step. Default (null): adaptive, "
        "step_timeout_multiple times the job's slowest recent step, at least step_timeout_floor_s, once a group "
        "has trained 3 steps (before that, step_timeout_multiple x step_timeout_floor_s)"
    )
    step_timeout_multiple: float = Field(
        10.0, gt=1.0, description="the adaptive step deadline (step_timeout_s null): this many times the slowest of "
        "the job's last steps (saves, evaluations and drains excluded: they have phase_timeout_s)"
    )
    step_timeout_floor_s: float = Field(
        30.0, gt=0.0, description="the adaptive step deadline is never shorter than this: a hang is found this long "
        "after the last step on a job of fast steps (the quickstart: well under a second a step on 2 CPUs)"
    )
    heartbeat_timeout_s: float = Field(
        5.0, ge=0.0, description="a rank whose heartbeat (a side thread's, once a second: a slow step does not stop "
        "it, a stopped or wedged process does) is not seen for this long is hung, beside the step deadline: found in "
        "seconds, named, its stacks saved, and the group restarts from the last checkpoint; 0 disables"
    )
    phase_timeout_s: float = Field(
        3600.0, ge=0.0, description="a checkpoint save or an evaluation may take this long (instead of step_timeout_s, "
        "suspended meanwhile) before the worker is taken as hung and exits; 0: no limit for them. Raise it for "
        "checkpoints that take longer to write synchronously"
    )
    warm_spares: int | None = Field(
        None, ge=0, description="idle worker processes with torch imported that each node keeps for this job, so that "
        "a restarted group's workers start in them instead of new processes. Default (null): one per worker on the "
        "node plus three (the actors Ray Train starts with each group: a synchronizer, the DatasetManager, the preemption "
        "watcher), and none on a node whose CPUs the job's workers already take (their imports would slow training); "
        "0: none. Each costs about the "
        "memory of an idle Python process with torch imported (docs/reliability.md)"
    )
    replace_in_place: bool = Field(
        False, description="a worker lost at the job's size (its process killed or crashed) is replaced alone: the "
        "other workers keep their processes, catch the collective error, roll back to the newest complete memory "
        "snapshot (checkpoint.memory; else the newest checkpoint) and re-form the group with the replacement "
        "through a rendezvous the driver hosts. Anything else (a resize, a lost node without room, a hang, an "
        "error while re-forming) restarts the whole group as when off. Each replacement counts against max_restarts. "
        "Checked on CPU (gloo) with ZeRO-2 only, refused with ZeRO-3: off by default (docs/reliability.md)"
    )
    straggler_ratio: float = Field(
        1.5, ge=0.0, description="warn when one rank's time outside collectives is this many times the median "
        "rank's (the others wait for it); 0 disables"
    )
    straggler_intervals: int = Field(3, ge=1, description="log intervals in a row above straggler_ratio before the warning")
    straggler_exclude: bool | None = Field(
        None, description="take a persistent straggler's node out of the job: checkpoint, restart without it (never "
        "below scaling.min_workers; the global batch stays), avoid it for straggler_avoid_s, then grow back. "
        "Default: on for elastic jobs (min_workers < max_workers), off for fixed-size ones"
    )
    straggler_exclude_ratio: float = Field(
        1.5, gt=1.0, description="a rank's time outside collectives over the median rank's above which it counts "
        "as slow for straggler_exclude"
    )
    straggler_exclude_after_s: float = Field(
        600.0, gt=0.0, description="how long the same rank must stay above straggler_exclude_ratio, without a "
        "break, before its node is taken out (minutes: a checkpoint hiccup or a noisy neighbour's burst is not a "
        "straggler)"
    )
    straggler_avoid_s: float = Field(
        3600.0, gt=0.0, description="how long a node taken out as a straggler is avoided by this job (a Ray label "
        "selector on the node's id); the job then restarts at up to max_workers, that node included"
    )

    @model_validator(mode="after")
    def _straggler_ratio(self) -> FailureSpec:
        if 0 < self.straggler_ratio <= 1:
            raise ValueError(f"straggler_ratio: {self.straggler_ratio} would flag balanced ranks (1.0 is no spread); "
                             "use a value above 1 such as 1.5, or 0 to turn the warning off")
        return self


class TrackingSpec(Part):
    uri: str | None = Field(
        None, description="MLflow tracking URI. Default: the cluster's $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db"
    )
    experiment: str | None = Field(
        None, min_length=1, description="MLflow experiment. Default: $MLFLOW_EXPERIMENT_NAME, else 'tidal'"
    )
    flush_timeout_s: float = Field(
        120.0, ge=0.0, description="at the end, how long to keep retrying an unreachable MLflow before leaving metrics buffered"
    )
