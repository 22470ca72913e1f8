"""`parallelism.compile` end to end: a compiled job on 2 gloo workers resumes exactly, its
compile steps stay out of the throughput figures, and its checkpoints hold plain module keys
that an eager engine and `tidal.export` load.

The backend is aot_eager (the spec lets a user choose it): it traces forward and backward
through the same dynamo + AOTAutograd path as inductor without generating C++, whose build of
this tiny GPT took 243 s on a loaded 2-core machine (aot_eager: 18 s).
"""

from __future__ import annotations

import math

import pytest
import torch

import tidal
from tests.conftest import metric_history, tiny_spec
from tests.helpers import EXPORT_TOLERANCE as TOLERANCE
from tests.helpers import batch_of_step

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]

STEPS = 10
COMPILED = {"parallelism.compile": {"backend": "aot_eager"}, "train.steps": STEPS, "checkpoint.every_steps": 5}


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): compile is opt-in; four runs
def test_compiled_job_resumes_exactly_and_its_checkpoint_loads_uncompiled(tmp_path, capsys):
    straight = tiny_spec(tmp_path, name="compiled-straight", **COMPILED)
    run_id = tidal.run(straight).mlflow_run_id
    expected = metric_history(straight, run_id, "loss")
    out = capsys.readouterr().out
    assert out.count("compiling the model (aot_eager)") == 1, out

    # The compile steps (1 and 2) give no throughput; the first steady one does.
    tps = metric_history(straight, run_id, "tokens_per_s")
    assert math.isnan(tps[1]) and math.isnan(tps[2]) and tps[3] > 0, tps

    # Stopped after step 6 (a checkpoint), then run again: the same losses as the undisturbed run.
    spec = tiny_spec(tmp_path, name="compiled-resumed", **COMPILED)
    tidal.run(spec.with_overrides({"train.stop_at": 6}))
    result = tidal.run(spec)
    assert result.error is None, result.error
    got = metric_history(spec, result.mlflow_run_id, "loss")
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert got[step] == pytest.approx(expected[step], abs=TOLERANCE), step

    # The classic compile pitfall: an `_orig_mod.` prefix on every key of the saved module.
    states = sorted((tmp_path / "runs" / spec.name).rglob("mp_rank_00_model_states.pt"))
    assert states
    keys = list(torch.load(states[-1], map_location="cpu", weights_only=False)["module"])
    assert "tok.weight" in keys and not [k for k in keys if "_orig_mod" in k], keys[:5]

    # An eager engine resumes from the compiled checkpoint at step 10 and trains step 11, and the
    # export of that checkpoint (a plain torch GPT) computes the same loss on step 11's batch.
    eager = spec.with_overrides({"parallelism.compile": None, "train.steps": STEPS + 1})
    resumed = metric_history(eager, tidal.run(eager).mlflow_run_id, "loss")
    exported = tidal.export(eager, checkpoint=STEPS, format="torch", output=tmp_path / "gpt")
    with torch.no_grad():
        loss = tidal.load_exported(exported.output)(*batch_of_step(eager, STEPS + 1)).item()
    assert loss == pytest.approx(resumed[STEPS + 1], abs=TOLERANCE)
    assert abs(loss - expected[1]) > 20 * TOLERANCE, "trained weights, not the initial ones"
