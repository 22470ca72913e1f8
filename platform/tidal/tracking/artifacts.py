"""The files a run leaves in MLflow at its end: the resolved spec, the DeepSpeed config, a JSON
summary and plots of the loss and throughput. Written into a folder; tracking/writer.py stores it.
And, as they happen, a hang's stacks (`HangStacks`, a subscriber of the ledger's events)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tidal import fs
from tidal.fs import UnsafeName
from tidal.redact import redact_data
from tidal.spec.job import JobSpec
from tidal.storage import RunDir
from tidal.tracking.events import Event, HangFound


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


class HangStacks:
    """When a hang is found (worker/health/hang.py), its folder on the job's storage (every rank's answer,
    stacks included, and the verdict) goes into the MLflow run as text files under
    `hangs/<group>/`: `stacks-rank<N>.txt` for each rank and `verdict.txt`. Read from storage by
    the tracker: the ranks that wrote it have ended by then."""

    def __init__(self, run_dir: RunDir, writer: Any, run_id: Callable[[], str | None]) -> None:
        self.run_dir, self.writer, self.run_id = run_dir, writer, run_id

    def __call__(self, event: Event) -> None:
        if not isinstance(event, HangFound):
            return
        try:
            files = hang_files(self.run_dir, event.folder)
        except UnsafeName as e:  # read from the event log: never joined to a path unchecked
            print(f"[tidal] WARNING: a hang's folder in the event log is not one Tidal writes ({e}): its stacks "
                  "are not stored in MLflow", flush=True)
            return
        run_id = self.run_id()
        where = f"{self.run_dir.path}/{event.folder}"
        if run_id is None:
            print(f"[tidal] WARNING: MLflow has no run for this job yet: the hang's stacks stay in {where}", flush=True)
            return
        try:
            self.writer.log_texts(run_id, files, f"hangs/{event.folder.rsplit('/', 1)[-1]}")
        except Exception as e:  # noqa: BLE001 - the stacks stay on storage; tracking goes on
            print(f"[tidal] WARNING: could not store the hang's stacks in MLflow ({type(e).__name__}: {e}); "
                  f"they stay in {where}", flush=True)


# The folder worker/health/hang.py writes a hang into: tidal-hangs/<group key>.
HANG_FOLDER_RE = re.compile(r"tidal-hangs/[A-Za-z0-9._-]+")
ANSWER_RE = re.compile(r"answer-(\d+)\.json")


def hang_files(run_dir: RunDir, folder: str) -> dict[str, str]:
    """A hang folder's artifacts: name -> text. `folder` comes from the event log: one that is not a
    hang folder's name (`tidal-hangs/<group>`, no `..`) raises UnsafeName before anything is read;
    the artifacts are named from the files' own names, not from what the files say."""
    if not HANG_FOLDER_RE.fullmatch(fs.check_name(folder)):
        raise UnsafeName(f"{folder!r} is not a hang folder (tidal-hangs/<group>)")
    files: dict[str, str] = {}
    for info in fs.list_dir(run_dir.fs, f"{run_dir.path}/{folder}"):
        name = info.path.rsplit("/", 1)[-1]
        data = fs.read_json(run_dir.fs, info.path) or {}
        if m := ANSWER_RE.fullmatch(name):
            head = [f"rank {data.get('rank')} on node {data.get('node')} (pid {data.get('pid')})"]
            if data.get("silent"):
                head.append(f"did not answer; read from outside: {data.get('state', '')}")
            else:
                head.append(f"at step {data.get('step')}, waiting in {data.get('where', '?')}")
            files[f"stacks-rank{m.group(1)}.txt"] = "\n".join(head) + "\n\n" + str(data.get("stacks", ""))
        elif name == "verdict.json":
            files["verdict.txt"] = f"{data.get('text', '')}\n\ndetected: {data.get('detected', '')}\n"
    return files
