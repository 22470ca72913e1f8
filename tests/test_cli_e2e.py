"""`tidal run` as a user types it, on a local Ray instance the command starts itself: a short run of the
quickstart trains (exit 0), and a job that fails for good says so without a traceback (exit 1)."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import ROOT
from tests.helpers import tidal_cli

pytestmark = pytest.mark.slow


def test_quickstart_with_10_steps_trains_them(tmp_path):
    """The issue's command: quickstart's warmup (10) is not below 10 steps; it trains anyway."""
    db = tmp_path / "mlflow.db"
    proc = tidal_cli("run", str(ROOT / "jobs/quickstart.yaml"), "--set", "train.steps=10", "--set", "model.d_model=64",
                     "--set", "model.n_head=2", "--set", f"checkpoint.storage={tmp_path / 'runs'}",
                     "--set", f"tracking.uri=sqlite:///{db}", cwd=tmp_path, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "note: train.warmup_steps 10 is not below train.steps (10): warming up over 9 step(s)" in proc.stderr
    assert "[tidal] step 10/10" in proc.stdout and "[tidal] job 'quickstart' finished" in proc.stdout
    run_id = proc.stdout.split("MLflow run ")[1].split()[0]
    assert max(m.step for m in MlflowClient(f"sqlite:///{db}").get_metric_history(run_id, "loss")) == 10


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): exit codes by outcome run in test_jobs
def test_a_job_that_fails_for_good_exits_1_with_a_message(tmp_path):
    spec = tmp_path / "broken.yaml"
    spec.write_text(f"""\
name: broken
model: {{builder: "tests.custom_model:build_failing", vocab_size: 64, seq_len: 16}}
train: {{steps: 4, micro_batch: 4, global_batch: 8, log_every: 1}}
scaling: {{min_workers: 1, max_workers: 1}}
failure: {{max_restarts: 0}}
checkpoint: {{storage: {tmp_path / 'runs'}}}
tracking: {{uri: "sqlite:///{tmp_path / 'mlflow.db'}"}}
""")
    proc = tidal_cli("run", str(spec), cwd=tmp_path, timeout=540)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    error = proc.stderr[proc.stderr.rindex("error: "):]
    assert error.startswith("error: job 'broken' failed after 0 restart(s)") and "run the same command again" in error
    # Ray shows the worker's traceback as the job runs; the CLI's own stack stays hidden (TIDAL_DEBUG=1 shows it).
    assert "tidal/cli.py" not in proc.stderr and "Traceback" not in error
