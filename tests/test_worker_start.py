"""What a worker imports before its first step: each start and every restart pays it, on cores
the other workers share."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tidal.worker import _compile_on_first_call

ROOT = Path(__file__).resolve().parents[1]

# A fresh interpreter, as a Ray worker is: Tidal's imports, then a real ZeRO-2 engine (gloo, one
# rank) trained five steps, then what got imported on the way.
FIRST_STEPS = """
import json, sys, torch
from tidal.worker import _import_deepspeed, _import_muon_uncompiled
compile_before = torch.compile
_import_deepspeed()
_import_muon_uncompiled()
import deepspeed
from tidal.spec.deepspeed import ds_config
from tidal.spec.job import JobSpec
from tidal.worker.device import skip_cpu_shm_allreduce
from tidal.worker.models import build_model
spec = JobSpec(name="start", model={"n_layer": 2, "n_head": 2, "d_model": 32, "vocab_size": 64, "seq_len": 8},
               train={"steps": 5, "micro_batch": 2, "global_batch": 2, "lr": 1e-2, "warmup_steps": 1}, parallelism={"zero_stage": 2},
               scaling={"min_workers": 1, "max_workers": 1})
skip_cpu_shm_allreduce()  # as build_engine does
deepspeed.init_distributed(dist_backend="gloo")
model = build_model(spec.model)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(spec, 1, on_gpu=False))
tokens = torch.randint(0, 64, (2, 8))
losses = []
for _ in range(5):
    loss = engine(tokens, tokens)
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
imported = {m: m in sys.modules for m in ("mlflow", "torch._inductor.compile_fx", "deepspeed.runtime.zero.muon.original_muon")}
import mlflow  # user code may import it after DeepSpeed
print(json.dumps({"imported": imported, "losses": losses, "compile_restored": torch.compile is compile_before}))
"""


@pytest.mark.slow  # DeepSpeed's first engine on a fresh machine JIT-builds its CPU comm op (about 25 s)
def test_a_worker_reaches_its_first_steps_without_importing_mlflow_or_inductor():
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'platform'}:{ROOT}", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(20000 + os.getpid() % 20000), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    out = subprocess.run([sys.executable, "-c", FIRST_STEPS], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["imported"] == {"mlflow": False, "torch._inductor.compile_fx": False,
                                  "deepspeed.runtime.zero.muon.original_muon": True}, result
    assert result["compile_restored"], "torch.compile is torch's own again for user code"
    assert result["losses"][-1] < result["losses"][0], "the engine trains"


@pytest.mark.slow
def test_a_deferred_compile_compiles_at_its_first_call_only():
    compiled: list[str] = []

    def compile_now(fn, **options):
        compiled.append(options.get("mode", ""))
        return torch.compile(fn, backend="eager")

    deferred = _compile_on_first_call(compile_now)

    @deferred
    def double(x: torch.Tensor) -> torch.Tensor:
        return 2 * x

    @deferred(mode="max-autotune")
    def square(x: torch.Tensor) -> torch.Tensor:
        return x * x

    assert compiled == [], "decorating compiles nothing"
    assert double.__name__ == "double"
    assert double(torch.ones(2)).tolist() == [2.0, 2.0] and square(torch.full((2,), 3.0)).tolist() == [9.0, 9.0]
    assert double(torch.ones(3)).tolist() == [2.0, 2.0, 2.0]
    assert compiled == ["", "max-autotune"], "each compiled once, with its options"
