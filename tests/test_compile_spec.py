"""`parallelism.compile` without Ray: what the spec accepts and refuses, and the warm-up steps the
throughput figures leave out. End to end (a compiled job resuming exactly): tests/test_compile.py."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import tiny_spec
from tidal.errors import SpecError
from tidal.spec.compile import COMPILE_WARMUP_STEPS, warmup_steps
from tidal.worker import metrics
from tidal.worker.metrics import PhaseClock, speed


def test_true_means_inductor_with_torchs_defaults_and_false_means_off(tmp_path):
    on = tiny_spec(tmp_path).with_overrides(["parallelism.compile=true"]).parallelism.compile
    assert on is not None and on.backend == "inductor"
    assert on.kwargs() == {"dynamic": None, "fullgraph": False}
    assert tiny_spec(tmp_path).with_overrides(["parallelism.compile=false"]).parallelism.compile is None
    tuned = tiny_spec(tmp_path, **{"parallelism.compile": {"mode": "max-autotune", "dynamic": False}})
    assert tuned.parallelism.compile.kwargs() == {"dynamic": False, "fullgraph": False, "mode": "max-autotune"}


@pytest.mark.parametrize("compile_spec, overrides, field, hint", [
    ({"backend": "aot_eager", "mode": "max-autotune"}, {}, "parallelism.compile.mode", "set backend inductor"),
    ({"backend": "cudagraphs"}, {}, "parallelism.compile.backend", "use inductor or aot_eager on CPU"),
    ({"backend": "tensorrt"}, {}, "parallelism.compile.backend", "inductor"),
    ({"fullgraf": True}, {}, "parallelism.compile.fullgraf", "fullgraph"),
    ({}, {"parallelism.zero_stage": 3}, "parallelism.compile", "parallelism.zero_stage 1 or 2"),
    ({}, {"parallelism.pipeline_stages": 2, "parallelism.zero_stage": 1}, "parallelism.compile",
     "parallelism.pipeline_stages 1"),
])
def test_bad_compile_options_name_the_field_and_the_fix(tmp_path, compile_spec, overrides, field, hint):
    with pytest.raises(SpecError) as e:
        tiny_spec(tmp_path, **{"parallelism.compile": compile_spec, **overrides})
    assert field in str(e.value) and hint in str(e.value)


def test_turning_compile_on_keeps_the_job_resumable(tmp_path):
    """A compiled engine's checkpoint is an eager one's: the same job, same run, same checkpoints."""
    spec = tiny_spec(tmp_path)
    assert spec.with_overrides(["parallelism.compile=true"]).fingerprint_hash() == spec.fingerprint_hash()


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_compile_steps_count_in_no_time_and_an_interval_of_them_only_gives_nan(monkeypatch, tmp_path):
    fake = FakeTime()
    monkeypatch.setattr(metrics.time, "perf_counter", fake)
    clock = PhaseClock(torch.device("cpu"), comms=None, warmup_steps=warmup_steps(tiny_spec(tmp_path).parallelism.compile))
    assert clock.warmup_left == 0, "an eager job skips nothing"
    clock = PhaseClock(torch.device("cpu"), comms=None, warmup_steps=COMPILE_WARMUP_STEPS)

    def step(seconds: float) -> None:
        clock.start_step(sync=False)
        with clock.phase("forward_backward_s"):
            fake.now += seconds
        clock.end_step()

    step(40.0)  # compiling
    first = clock.take()
    assert math.isnan(first["step_time_s"]) and math.isnan(first["forward_backward_s"])
    assert math.isnan(speed(tiny_spec(tmp_path), first["step_time_s"], 2, 1e6, 1e12)["tokens_per_s"])
    step(5.0)  # the second warm-up step
    step(0.1)
    step(0.3)
    steady = clock.take()
    assert steady["step_time_s"] == pytest.approx(0.2) and steady["forward_backward_s"] == pytest.approx(0.2)
