"""RunResult: what a job left behind, shaped like Ray Train's `Result` plus the job's MLflow run.

`tidal.run` returns one; `Job.result()` builds the same from a submitted job's own record.
Nothing heavy is imported until a property asks for it (Ray for the checkpoint, MLflow and
pandas for the metrics).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tidal.goodput.report import brief
from tidal.redact import redact_text
from tidal.tracking.findings import summary_lines

if TYPE_CHECKING:
    from tidal.storage import Found


@dataclass
class RunResult:
    """A finished (or failed) job.

    - `checkpoint`: the newest complete checkpoint as a `ray.train.Checkpoint` (path + filesystem),
      or None; `path` is its location (a local path, or a URI on object storage).
    - `metrics`: the last value of each metric; `metrics_dataframe`: every step, from MLflow.
    - `error`: why the job failed, or None.
    """

    name: str
    mlflow_run_id: str
    tracking_uri: str
    storage: str  # the root under which the job's folder lies (checkpoint.storage)
    metrics: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    error: str | None = None
    url: str = ""  # how a person opens the MLflow run
    parked_as: str = ""  # the job waits in the cluster's queue with no driver; it goes on as this Ray job
    position: int | None = None  # its place in the queue when it parked

    @property
    def run_dir(self) -> str:
        """Where the job's checkpoints and records are: `<storage>/<name>`."""
        return f"{self.storage.rstrip('/')}/{self.name}"

    @property
    def final_loss(self) -> float | None:
        return self.metrics.get("loss")

    @property
    def goodput(self) -> dict[str, float]:
        """Where the job's wall time went, since its first launch (docs/reliability.md): `goodput` (the
        productive share), `goodput_wall_s`, and per bucket `goodput_<bucket>_s`, `goodput_<bucket>_worker_hours`
        and, where nodes carry price labels, `goodput_<bucket>_cost`. Empty for a run with no account."""
        return {k: v for k, v in self.metrics.items() if k.startswith("goodput") and not k.startswith("goodput_so_far")}

    def latest(self) -> Found | None:
        from tidal.storage import RunDir  # pyarrow: not on the path of `tidal --help`

        return RunDir(self.storage, self.name).latest_complete(warn=False)

    @property
    def path(self) -> str | None:
        found = self.latest()
        return None if found is None else f"{self.run_dir}/{found.name}"

    @property
    def checkpoint(self) -> Any:
        """The newest complete checkpoint as a `ray.train.Checkpoint`, or None."""
        found = self.latest()
        if found is None:
            return None
        from ray.train import Checkpoint

        return Checkpoint(found.path, filesystem=found.fs)

    @property
    def metrics_dataframe(self) -> Any:
        """Every training metric of the job's MLflow run as a pandas DataFrame, one row per step."""
        from tidal.tracking.reader import metrics_frame

        return metrics_frame(self.tracking_uri, self.mlflow_run_id)

    def summary(self) -> str:
        if self.parked_as:
            where = f" at position {self.position}" if self.position else ""
            return (f"[tidal] job {self.name!r} waits in the cluster's queue{where} with no driver on the head: once "
                    f"admitted it starts as Ray job {self.parked_as}, and `tidal status`, `tidal logs` and "
                    "Job.status() of this job follow it there")
        m = self.metrics
        state = f"failed after {self.wall_s:.0f}s: {self.error}" if self.error else f"finished in {self.wall_s:.0f}s"
        lines = [f"[tidal] job {self.name!r} {state}"]
        if "loss" in m:
            lines.append(f"  final loss      {m['loss']:.4f}")
        if "tokens_per_s" in m:
            lines.append(f"  throughput      {m['tokens_per_s']:,.0f} tokens/s, {m.get('samples_per_s', 0):,.1f} samples/s, "
                         f"MFU {100 * m.get('mfu', 0):.1f}% (last interval)")
        if (said := brief(m)) is not None:
            lines.append(f"  goodput         {said}")
        lines += summary_lines(m)  # where the time went; input-bound if it was
        lines += [f"  checkpoints     {self.run_dir}",
                  f"  MLflow run      {self.mlflow_run_id} in {self.tracking_uri}"]
        if self.url:
            lines.append(f"  open it with    {self.url}")
        return redact_text("\n".join(lines))  # the storage and tracking URIs may hold credentials
