"""The CLI as a user runs it (`python -m tidal ...` in a subprocess): versions, exit codes, JSON output.

No Ray instance: what needs one is in test_jobs.py and test_cli_e2e.py (slow)."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version

import pytest

import tidal
from tests.conftest import ROOT


def tidal_cli(*args: str, cwd: os.PathLike[str] | str = ROOT, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`tidal ARGS` from this worktree's sources, without TIDAL_DEBUG (tracebacks would be expected)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'platform'}{os.pathsep}{ROOT}"}
    env.pop("TIDAL_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "tidal", *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout)


def test_version_names_tidal_and_the_stack_it_runs_on():
    proc = tidal_cli("--version")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"tidal {tidal.__version__}"
    for name in ("ray", "deepspeed", "mlflow"):
        assert f"{name} {version(name)}" in lines


@pytest.mark.parametrize(
    "args, expected",
    [
        (["run"], "the following arguments are required: SPEC"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["runs", "compare", "only-one-run"], "usage: tidal runs compare RUN_ID RUN_ID"),
        (["runs", "delete"], "unknown runs action 'delete'"),
        (["run", "jobs/quickstart.yaml", "--set", "train.steps"], "--set: 'train.steps' is not of the form"),
    ],
)
def test_bad_usage_exits_2(args, expected):
    proc = tidal_cli(*args)
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr and "Traceback" not in proc.stderr


def test_invalid_spec_exits_2_before_anything_starts(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("train: {stpes: 10}\n")
    proc = tidal_cli("run", str(path))
    assert proc.returncode == 2
    assert "train.stpes: unknown key; did you mean 'steps'?" in proc.stderr
    assert "Ray" not in proc.stdout and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "args, expected",
    [
        # port 1 answers nothing: the cluster cannot be reached
        (["list", "--address", "http://127.0.0.1:1"], "cannot reach the Ray dashboard at http://127.0.0.1:1"),
        (["runs", "--uri", "sqlite:////nonexistent/mlflow.db"], "no MLflow store at sqlite:////nonexistent/mlflow.db"),
    ],
)
def test_a_command_that_fails_exits_1(args, expected):
    proc = tidal_cli(*args)
    assert proc.returncode == 1, proc.stderr
    assert expected in proc.stderr and "Traceback" not in proc.stderr


def test_help_documents_the_exit_codes():
    out = tidal_cli("--help").stdout
    codes = out.split("exit codes:")[1]
    assert all(f"\n  {code} " in codes for code in ("0", "1", "2", "130"))
