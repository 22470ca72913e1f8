"""Chaos: three worker kills at seeded random times; the job finishes with an undisturbed run's losses
(stored: tests/assets/losses/chaos-undisturbed.json, `python -m tests.golden chaos-undisturbed`), and its goodput
account books each bucket as the harness's own clock saw it (tidal/testing/timeline.py).
(`python -m benchmarks.chaos` runs five, and one every 2 minutes of wall time, against an undisturbed run it makes.)"""

from __future__ import annotations

import pytest

from tests.golden import reference_losses
from tidal.testing.chaos import chaos_spec, run_chaos
from tidal.testing.timeline import compare, observed

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]
# The faults land in steps 29-95, a slice of 24 steps each, each replaying at most a checkpoint interval.
STEPS, EVERY = 120, 10


def test_three_faults_survived_with_exact_losses(tmp_path):
    expected = reference_losses("chaos-undisturbed", chaos_spec(tmp_path, "undisturbed", STEPS, EVERY))
    r = run_chaos(tmp_path, faults=3, steps=STEPS, every=EVERY, seed=0, expected=expected, held=True)
    assert len(r["faults_injected"]) == 3
    assert r["restarts"] >= 3
    assert r["steps_done"], "every step done and logged exactly once"
    # A fault while the newest checkpoint is still being written in the background (asynchronous
    # checkpoints) also loses the step or two trained during that write.
    assert r["max_steps_lost"] <= r["every_steps"] + 2
    # Every execution of every step, replays included, against the stored losses: within the drift
    # allowed between machines (tests/golden.py); a resume from the wrong state is off by far more.
    assert r["max_rel_loss_diff"] < 1e-4
    # The goodput account against the harness's own clock (tidal/testing/timeline.py: its launch, its kills,
    # when each step's loss-trace record and each console line reached it; never the job's step times or the
    # account's figures), bucket by bucket. Two clocks of one run must book its seconds alike however fast
    # or loaded the machine is: no speed is asserted. Each row's tolerance is what the harness measured on
    # this run that it cannot see (the console's delay spread, the trace's 0.1 s poll, a step's jitter, each
    # log step's own work inside its step intervals): see tidal.testing.timeline.compare.
    from mlflow.tracking import MlflowClient

    ledger = {k: v for k, v in MlflowClient(r["uri"]).get_run(r["run_id"]).data.metrics.items() if k.startswith("goodput")}
    rows = compare(observed(r["timeline"]), ledger)
    assert all(row["ok"] for row in rows), [row for row in rows if not row["ok"]]
