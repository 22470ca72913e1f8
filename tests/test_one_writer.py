"""One writer of MLflow (issue 14): only tracking/writer.py creates, changes or ends runs, so the
lifecycle of a job's run (and a sweep's parent) has one owner. `tidal export --mlflow` is the one
other writer: it logs a model to a run on the user's request, after the job. No Ray."""

from __future__ import annotations

import ast
from pathlib import Path

import tidal

PACKAGE = Path(tidal.__file__).parent
WRITERS = {"tracking/writer.py", "exporter/mlflow.py"}
# MlflowClient's and the fluent API's calls that write a run or an experiment.
WRITES = {"create_run", "create_experiment", "update_run", "set_terminated", "log_batch", "log_metric",
          "log_param", "log_params", "log_metrics", "set_tag", "set_tags", "log_artifact", "log_artifacts",
          "log_text", "log_dict", "log_figure", "start_run", "end_run", "delete_run", "log_model"}


def _writes(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [f"{path.relative_to(PACKAGE)}:{n.lineno} {n.func.attr}" for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in WRITES]


def test_only_the_writer_writes_mlflow():
    found = [w for p in sorted(PACKAGE.rglob("*.py")) if str(p.relative_to(PACKAGE)) not in WRITERS for w in _writes(p)]
    assert found == [], f"MLflow written outside tracking/writer.py: {found}"
    assert _writes(PACKAGE / "tracking" / "writer.py"), "the writer itself was not recognised (scan broken)"
