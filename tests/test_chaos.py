"""Chaos: three worker kills at seeded random times; the job finishes with an undisturbed run's losses.
(`python -m benchmarks.chaos` runs five, and one every 2 minutes of wall time.)"""

from __future__ import annotations

import pytest

from tidal.testing.chaos import run_chaos

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]


def test_three_faults_survived_with_exact_losses(tmp_path):
    r = run_chaos(tmp_path, faults=3, steps=200, every=20, seed=0)
    assert len(r["faults_injected"]) == 3
    assert r["restarts"] >= 3
    assert r["steps_done"], "every step done and logged exactly once"
    # A fault while the newest checkpoint is still being written in the background (asynchronous
    # checkpoints) also loses the step or two trained during that write.
    assert r["max_steps_lost"] <= r["every_steps"] + 2
    assert r["max_rel_loss_diff"] < 1e-5
