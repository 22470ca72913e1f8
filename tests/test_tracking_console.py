"""A console a person can read: Tidal's own lines, and none of the known-harmless library chatter
(tracking/quiet.py), unless TIDAL_DEBUG=1 asks for everything."""

from __future__ import annotations

import logging
import re
import warnings

import pytest

from tests.conftest import ROOT
from tests.test_cli import tidal_cli
from tidal.tracking.quiet import quiet_libraries

CHATTER = ("TrainingReport(", "Setting accelerator to CPU", "all_gather_into_tensor", "lr_scheduler.step()",
           "optimizer.step()` has been overridden", "built successfully", "Creating initial MLflow database tables",
           "Failed to query Ray Train Controller actor state")


def deepspeed_says(message: str) -> list[str]:
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger = logging.getLogger("DeepSpeed")
    handler = Keep()
    logger.addHandler(handler)
    try:
        logger.warning(message)
    finally:
        logger.removeHandler(handler)
    return seen


def test_known_chatter_is_dropped_and_tidal_debug_keeps_it(monkeypatch):
    monkeypatch.setenv("TIDAL_DEBUG", "1")
    logging.getLogger("DeepSpeed").filters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_libraries()
        warnings.warn("Detected call of `lr_scheduler.step()` before `optimizer.step()`. ...", UserWarning, stacklevel=1)
    assert deepspeed_says("Setting accelerator to CPU. If you have GPU ...") and len(caught) == 1

    monkeypatch.delenv("TIDAL_DEBUG")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_libraries()
        warnings.warn("Detected call of `lr_scheduler.step()` before `optimizer.step()`. ...", UserWarning, stacklevel=1)
        warnings.warn("a real warning", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["a real warning"]
    assert deepspeed_says("Setting accelerator to CPU. If you have GPU ...") == []
    assert deepspeed_says("a real DeepSpeed warning") == ["a real DeepSpeed warning"]
    logging.getLogger("DeepSpeed").filters.clear()


@pytest.mark.slow
def test_a_short_run_prints_tidal_lines_and_no_library_chatter(tmp_path):
    proc = tidal_cli("run", str(ROOT / "jobs/quickstart.yaml"), "--set", "train.steps=20", "--set", "model.d_model=64",
                     "--set", "model.n_head=2", "--set", "checkpoint.every_steps=10",
                     "--set", f"checkpoint.storage={tmp_path / 'runs'}",
                     "--set", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", cwd=tmp_path, timeout=540)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    for chatter in CHATTER:
        assert chatter not in out, chatter
    assert not re.search(r"\b\w+Warning: ", out), [line for line in out.splitlines() if "Warning: " in line]
    lines = out.splitlines()
    assert len([line for line in lines if "[tidal] step " in line]) == 2, "one line per log interval (10 steps)"
    assert len([line for line in lines if "[tidal] checkpoint at step " in line]) == 2
    assert "[tidal] job 'quickstart' finished" in proc.stdout
    assert "starting a local Ray instance (without its dashboard; TIDAL_RAY_DASHBOARD=1 starts it)" in proc.stdout
