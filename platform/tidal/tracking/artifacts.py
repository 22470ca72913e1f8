"""What a run leaves behind in MLflow, read back or stored at its end: the per-step metrics as a
DataFrame, and the artifacts (resolved spec, DeepSpeed config, summary, plots)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

from tidal.spec.job import JobSpec


def metrics_frame(tracking_uri: str, run_id: str) -> Any:
    """Every training metric of a run as a pandas DataFrame: one row per step, one column per metric."""
    import pandas as pd

    c = MlflowClient(tracking_uri)
    rows: dict[int, dict[str, float]] = {}
    for key in c.get_run(run_id).data.metrics:
        if key.startswith("system/"):  # MLflow's system metrics count their own steps, not training steps
            continue
        for m in c.get_metric_history(run_id, key):
            rows.setdefault(m.step, {})[key] = m.value
    frame = pd.DataFrame.from_dict(rows, orient="index").sort_index()
    frame.index.name = "step"
    return frame.reset_index()


def log_artifacts(spec: JobSpec, run_id: str, summary: dict[str, Any]) -> None:
    """At the end of a run: the resolved spec, the DeepSpeed config, a JSON summary, and plots."""
    import tempfile

    import yaml

    from tidal.spec.deepspeed import ds_config

    c = MlflowClient(spec.tracking.uri)
    on_gpu = spec.scaling.gpus_per_worker > 0
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "spec.yaml").write_text(yaml.safe_dump(spec.redacted(), sort_keys=False))
        (d / "deepspeed_config.json").write_text(json.dumps(ds_config(spec, spec.scaling.max_workers, on_gpu), indent=2))
        (d / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        _plots(metrics_frame(spec.tracking.uri, run_id), d)
        c.log_artifacts(run_id, str(d))


def _plots(frame: Any, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes
    import matplotlib.pyplot as plt

    for name, cols, ylabel in (("loss.png", ["loss"], "loss"),
                               ("throughput.png", ["tokens_per_s"], "tokens/s")):
        present = [c for c in cols if c in frame]
        if not present:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for col in present:
            ax.plot(frame["step"], frame[col], label=col)
        ax.set(xlabel="step", ylabel=ylabel, title=ylabel)
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
