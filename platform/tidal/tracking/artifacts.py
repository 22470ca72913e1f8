"""The files a run leaves in MLflow at its end: the resolved spec, the DeepSpeed config, a JSON
summary and plots of the loss and throughput. Written into a folder; tracking/writer.py stores it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tidal.redact import redact_data
from tidal.spec.job import JobSpec


def write_artifacts(spec: JobSpec, frame: Any, summary: dict[str, Any], out: Path) -> None:
    """`frame` is the run's metrics table (reader.metrics_frame)."""
    import yaml

    from tidal.spec.deepspeed import ds_config

    on_gpu = spec.scaling.gpus_per_worker > 0
    (out / "spec.yaml").write_text(yaml.safe_dump(spec.redacted(), sort_keys=False))
    (out / "deepspeed_config.json").write_text(json.dumps(ds_config(spec, spec.scaling.max_workers, on_gpu), indent=2))
    (out / "summary.json").write_text(json.dumps(redact_data(summary), indent=2, default=str))
    _plots(frame, out)


def _plots(frame: Any, out: Path) -> None:
    # Figures without pyplot (matplotlib's advice for code that only writes files): no global
    # figure state shared with the tracker's other threads, no backend to choose.
    from matplotlib.figure import Figure

    for name, cols, ylabel in (("loss.png", ["loss"], "loss"),
                               ("throughput.png", ["tokens_per_s"], "tokens/s")):
        present = [c for c in cols if c in frame]
        if not present:
            continue
        fig = Figure(figsize=(6, 3.5))
        ax = fig.subplots()
        for col in present:
            ax.plot(frame["step"], frame[col], label=col)
        ax.set(xlabel="step", ylabel=ylabel, title=ylabel)
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
