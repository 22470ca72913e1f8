"""Save a DeepSpeed checkpoint through Ray Train, and restore it at any world size.

Every rank saves its own files into a local folder, adds a manifest of them, and hands the
folder to `ray.train.report`, which merges all ranks' folders into one on shared storage.
Rank 0 also writes `tidal-state.json`: the step, the world size, the spec fingerprint and
the MLflow run id. `tidal.storage` decides from those files which checkpoint is complete.

Resizing: DeepSpeed ZeRO checkpoints only load at the world size that wrote them. For another
size we convert once to DeepSpeed's universal format (`ds_to_universal`), which keeps the
optimizer state, store it beside the original as `global_stepN_universal`, and load that.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray.train
import torch.distributed as dist

from tidal.errors import CheckpointError
from tidal.storage import STATE_FILE, Found, checkpoint_dir_name, manifest_name, quarantine

log = logging.getLogger("tidal")


@dataclass
class TrainState:
    """All a checkpoint needs beyond DeepSpeed's own files to continue exactly."""

    step: int = 0
    samples_seen: int = 0
    tokens_seen: int = 0
    world_size: int = 1
    zero_stage: int = 0
    mlflow_run_id: str | None = None
    data_ended: bool = False  # a stream of data.epochs passes ran out: the job is done
    fingerprint: dict[str, Any] = field(default_factory=dict)


def tag(step: int) -> str:
    return f"global_step{step}"


def save(engine: Any, state: TrainState, metrics: dict[str, Any],
         save_data_position: Callable[[Path], None] | None = None) -> dict[str, float]:
    """Save on every rank and report to Ray Train (a collective: all ranks call it together).

    `metrics` go with the checkpoint to Ray (and so to Ray Tune in a sweep);
    `save_data_position(folder)`, a collective too, adds the data stream's position. Returns
    this rank's save time, time training was blocked, and bytes written.
    """
    rank = dist.get_rank()
    local = Path(tempfile.mkdtemp(prefix="tidal-ckpt-"))
    t0 = time.perf_counter()
    engine.save_checkpoint(
        str(local),
        tag=tag(state.step),
        # ds_to_universal refuses checkpoints without this key.
        client_state={"tidal": asdict(state), "universal_checkpoint_info": {"universal_checkpoint_version": 0.4}},
    )
    if save_data_position is not None:
        save_data_position(local)
    if rank == 0:
        (local / STATE_FILE).write_text(json.dumps(asdict(state), indent=2))
    files = {str(p.relative_to(local)): p.stat().st_size for p in local.rglob("*") if p.is_file()}
    # Written last and listing every file this rank wrote: its presence with matching sizes
    # is what makes the checkpoint count as complete (see tidal.storage).
    (local / manifest_name(rank)).write_text(json.dumps({"step": state.step, "files": files}))
    save_s = time.perf_counter() - t0
    ray.train.report(
        {**metrics, "step": state.step},
        checkpoint=ray.train.Checkpoint.from_directory(str(local)),
        checkpoint_dir_name=checkpoint_dir_name(state.step),
        delete_local_checkpoint_after_upload=True,
    )
    shutil.rmtree(local, ignore_errors=True)
    return {"checkpoint_save_s": save_s, "checkpoint_blocked_s": time.perf_counter() - t0,
            "checkpoint_bytes": float(sum(files.values()))}


def needs_reshard(state: dict[str, Any], world_size: int) -> bool:
    """ZeRO 1-3 partition optimizer state by rank; stage 0 keeps it whole, so it loads anywhere."""
    return int(state["world_size"]) != world_size and int(state["zero_stage"]) > 0


def restore(engine: Any, found: Found, reshard: bool) -> TrainState:
    """Load `found` into `engine`, converting it first if it was written at another world size."""
    with ray.train.Checkpoint(found.path, filesystem=found.fs).as_directory() as local:
        state = TrainState(**found.state)
        step_tag = _universal(local, tag(state.step)) if reshard else tag(state.step)
        try:
            load_path, _ = engine.load_checkpoint(local, tag=step_tag, load_optimizer_states=True, load_lr_scheduler_states=True)
            if load_path is None:
                raise CheckpointError(f"DeepSpeed found nothing to load under tag {step_tag}")
        except Exception as e:
            # Files of the right size that do not load (bit rot, a bad copy): quarantine it, and
            # fail, so Ray restarts the group and the next attempt takes the previous checkpoint.
            quarantine(found, e)
            raise CheckpointError(f"checkpoint {found.path} failed to load and was quarantined: {e}") from e
    return state


def _universal(local: str, step_tag: str) -> str:
    """Convert `local/step_tag` to universal form once (rank 0), cached beside it; returns its tag."""
    out_tag = f"{step_tag}_universal"
    out = Path(local) / out_tag
    if dist.get_rank() == 0 and not out.exists():
        t0 = time.perf_counter()
        tmp = Path(local) / f".{out_tag}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
               "--input_folder", str(Path(local) / step_tag), "--output_folder", str(tmp),
               "--num_extract_workers", "1", "--num_merge_workers", "1"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        if proc.returncode != 0:
            raise CheckpointError(f"converting {step_tag} to a universal checkpoint failed:\n{proc.stderr[-3000:]}")
        tmp.rename(out)  # the rename makes a half-written conversion invisible
        log.warning("Resharding: converted %s to universal form in %.1fs", step_tag, time.perf_counter() - t0)
    dist.barrier()
    return out_tag
