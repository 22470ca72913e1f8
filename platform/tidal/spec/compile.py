"""`parallelism.compile`: torch.compile through DeepSpeed's `engine.compile()`.

It lives under `parallelism`, beside precision and activation checkpointing, because it changes
how the model runs, never what it is: a compiled engine's checkpoint is an eager one's (DeepSpeed
compiles the module in place, `nn.Module.compile`, so no `_orig_mod.` enters the state dict), and
a job may turn it on or off between launches and still resume (`model.*` is in the resume
fingerprint, `parallelism.compile` is not).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# The backends torch 2.13 registers that train (torch._dynamo.list_backends(exclude_tags=())):
# inductor generates kernels (C++ on CPU, Triton on GPU); aot_eager traces forward and backward
# without generating code (quick to compile: for tests and for finding a graph break); eager
# only captures graphs. cudagraphs needs a GPU.
BACKENDS = ("inductor", "aot_eager", "eager", "cudagraphs")
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# Steps of each attempt whose time is left out of tokens/s, MFU and step_time_s when compiled:
# the first step traces and compiles the forward and backward graphs (about 40 s for the tiny
# test GPT with inductor on 2 CPU cores); the second one compiles the graphs left for the
# accumulation boundary and the optimizer's first real step, if any. From the third on, steps
# ran at their steady time in tests/test_compile.py.
COMPILE_WARMUP_STEPS = 2


class CompileSpec(BaseModel):
    """torch.compile options; `parallelism.compile: true` is the same as `{}` (inductor, defaults)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    backend: Literal["inductor", "aot_eager", "eager", "cudagraphs"] = Field(
        "inductor", description="torch.compile backend: inductor (generated kernels), aot_eager (no code generation: "
        "quick to compile), eager, or cudagraphs (GPUs only)"
    )
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] | None = Field(
        None, description="torch.compile mode (inductor only); default: torch's"
    )
    dynamic: bool | None = Field(
        None, description="torch.compile dynamic shapes: true, false, or null (torch decides after a shape changes)"
    )
    fullgraph: bool = Field(False, description="fail on a graph break instead of running that part eagerly")

    @model_validator(mode="after")
    def _mode_needs_inductor(self) -> CompileSpec:
        if self.mode is not None and self.backend != "inductor":
            raise ValueError(f"mode: {self.mode!r} is an inductor option; set backend inductor, or mode null")
        return self

    def kwargs(self) -> dict[str, Any]:
        """The `compile_kwargs` for `engine.compile()` (the backend is passed on its own, as DeepSpeed asks)."""
        out: dict[str, Any] = {"dynamic": self.dynamic, "fullgraph": self.fullgraph}
        return out | ({"mode": self.mode} if self.mode else {})


def compile_shorthand(value: Any) -> Any:
    """`compile: true` means the defaults and `compile: false` none, so `--set parallelism.compile=true` works."""
    if value is True:
        return {}
    if value is False:
        return None
    return value


def compile_problems(compile_spec: CompileSpec | None, pipeline_stages: int, gpus_per_worker: int,
                     zero_stage: int = 0) -> list[tuple[str, str]]:
    """Cross-field checks of `parallelism.compile`; each names the field to change."""
    if compile_spec is None:
        return []
    problems = []
    if compile_spec.backend == "cudagraphs" and gpus_per_worker == 0:
        problems.append(("parallelism.compile.backend", "cudagraphs needs GPUs (scaling.gpus_per_worker >= 1); "
                         "use inductor or aot_eager on CPU"))
    if zero_stage == 3:
        # Seen in a tidal run (DeepSpeed 0.19.8, torch 2.13, aot_eager): dynamo traces the module
        # with ZeRO-3's partitioned parameters, which are empty outside DeepSpeed's gather hooks,
        # and every attempt fails at its first step ("size mismatch ... vec (0)").
        problems.append(("parallelism.compile", "fails with ZeRO-3 (torch.compile sees its partitioned, empty "
                         "parameters); set parallelism.zero_stage 1 or 2, or parallelism.compile null"))
    if pipeline_stages > 1:
        # DeepSpeed would compile each stage's layers (PipelineModule.compile), but Tidal's pipeline
        # ties the embedding across the first and last stage and broadcasts it in place, which
        # compiled graphs have not been tested with here: refused rather than trusted untested.
        problems.append(("parallelism.compile", "is not supported with pipeline stages in Tidal; set "
                         "parallelism.pipeline_stages 1 (ZeRO), or parallelism.compile null"))
    return problems


def warmup_steps(compile_spec: CompileSpec | None) -> int:
    """Steps at the start of each attempt left out of the throughput figures."""
    return 0 if compile_spec is None else COMPILE_WARMUP_STEPS


def compile_note(compile_spec: CompileSpec) -> str:
    """The progress line said once per attempt (rank 0) before the first step compiles."""
    return (f"compiling the model ({compile_spec.backend}): the first steps are slow; the first "
            f"{COMPILE_WARMUP_STEPS} of each launch are left out of tokens/s and MFU")
