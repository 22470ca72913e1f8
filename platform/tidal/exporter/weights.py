"""One full state dict from a DeepSpeed checkpoint's per-rank files, on one machine without GPUs.

ZeRO 1-3 keep the fp32 master weights split over the ranks' optimizer files; DeepSpeed's own
`zero_to_fp32` reassembles them (no process group needed), so that is what runs here. Two
layouts it does not read are handled by hand: ZeRO stage 0 (the whole module is in rank 0's
model file) and pipeline jobs (one file per layer, written by the stage that owns it; Tidal's
pipeline runs the built-in GPT, whose layer order `tidal.worker.models.gpt.layers` defines).
"""

from __future__ import annotations

import contextlib
import glob
import os
import sys
from collections.abc import Iterator

import pyarrow.fs as pafs
import torch

from tidal import fs
from tidal.errors import CheckpointError
from tidal.spec.job import JobSpec
from tidal.storage import check_complete, listed_files
from tidal.worker.checkpoint.safe_load import allow, check_files, safe_load


@contextlib.contextmanager
def consolidated(filesystem: pafs.FileSystem, path: str, step: int, spec: JobSpec) -> Iterator[dict[str, torch.Tensor]]:
    """The state dict of the model the job trains (keys as in `build_model(spec.model)`), from
    the checkpoint folder `path`. Only the files of the step's DeepSpeed folder that the
    checkpoint's manifests list are read (a save that died may have left others there, which
    `zero_to_fp32` would count as ranks), through a temporary folder removed on exit."""
    step_tag = f"global_step{step}"  # tidal.worker.checkpoint.save.tag, which would import Ray
    allow(spec.checkpoint.safe_globals)  # the types the job's state may hold, for the weights-only loads here
    listed = listed_files(filesystem, path)
    if not listed:
        raise CheckpointError(f"{path} is not a complete checkpoint ({check_complete(filesystem, path)[0]}); "
                              "export a complete one (--checkpoint latest picks the newest)")
    files = [rel for rel in listed if rel.startswith(f"{step_tag}/")]
    if not files:
        raise CheckpointError(f"{path} has no DeepSpeed folder {step_tag}: it was not written by Tidal's trainer")
    with fs.local_files(filesystem, path, files) as local:
        yield state_dict(os.path.join(local, step_tag), spec)


def state_dict(tag_dir: str, spec: JobSpec) -> dict[str, torch.Tensor]:
    if spec.parallelism.pipeline_stages > 1:
        return pipeline_state_dict(tag_dir, spec.model.n_layer)
    if spec.parallelism.zero_stage == 0:
        return _module_weights(tag_dir)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # zero_to_fp32 unpickles with weights_only=False: check the (listed) files weights-only first.
    check_files(tag_dir, os.listdir(tag_dir))
    # zero_to_fp32 prints its progress to stdout, which belongs to `--output json`.
    with contextlib.redirect_stdout(sys.stderr):
        return get_fp32_state_dict_from_zero_checkpoint(os.path.dirname(tag_dir), tag=os.path.basename(tag_dir))


def _module_weights(tag_dir: str) -> dict[str, torch.Tensor]:
    """ZeRO stage 0 partitions nothing: rank 0's model file holds the whole module."""
    file = os.path.join(tag_dir, "mp_rank_00_model_states.pt")
    if not os.path.isfile(file):
        raise CheckpointError(f"{os.path.basename(tag_dir)} has no mp_rank_00_model_states.pt")
    return {k: v.float() if v.is_floating_point() else v
            for k, v in safe_load(file)["module"].items()}


def pipeline_state_dict(tag_dir: str, n_layer: int) -> dict[str, torch.Tensor]:
    """The built-in GPT's state dict from a pipeline checkpoint's `layer_NN-model_states.pt` files.

    Layers are numbered as `gpt.layers` lists them: token embedding, position embedding, the
    blocks, the final norm, then the output head, which is the token embedding again (tied).
    Pipeline stages run ZeRO 0 or 1, so these files hold the whole weights, in the training
    precision (exact for fp32; bf16-rounded master weights for a bf16 job).
    """
    def layer(idx: int) -> dict[str, torch.Tensor]:
        files = glob.glob(os.path.join(tag_dir, f"layer_{idx:02d}*-model_states.pt"))
        if not files:
            raise CheckpointError(f"pipeline checkpoint {os.path.basename(tag_dir)} has no file for layer {idx}")
        return safe_load(files[0])

    out = {"tok.weight": layer(0)["weight"], "pos.pos.weight": layer(1)["pos.weight"]}
    for i in range(n_layer):
        out.update({f"blocks.{i}.{k}": v for k, v in layer(2 + i).items()})
    out.update({f"ln_f.{k}": v for k, v in layer(2 + n_layer).items()})
    return {k: v.float() for k, v in out.items()}
