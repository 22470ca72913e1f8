"""What Tidal found about a job's use of its accelerators, worded once for the console, the MLflow
run's tags and the end-of-run summary.

Workers put numbers in their step metrics (`input_bound_share`, `time_share_*`,
`straggler_excluded_rank`); this module turns them into words. Nothing here measures anything:
worker/input_bound.py and worker/health/stragglers.py decide.
"""

from __future__ import annotations

from collections.abc import Mapping

INPUT_BOUND_TAG = "tidal.input_bound"
STRAGGLER_TAG = "tidal.straggler_excluded"
MICRO_BATCH_TAG = "tidal.micro_batch"
MICRO_BATCH_HALVED_TAG = "tidal.micro_batch_halved"
PHASE_NAMES = {"data_wait": "data wait", "forward_backward": "forward/backward", "optimizer": "optimizer",
               "outside_steps": "checkpoints, eval and logging"}


def input_bound_advice(dataset: bool, streaming: bool) -> str:
    """What to try, for the kind of data source the job reads."""
    tries = []
    if dataset:
        tries.append("a cheaper data.dataset __getitem__ (tokenize or decode once ahead of the job, cache what it "
                     "reads)")
    elif not streaming:
        tries.append("data.streaming: true (tokenized once into shards, each worker reads only its own)")
    tries += ["faster storage nearer the workers (local NVMe, a bucket in the same region)",
              "more CPUs per worker for loading (scaling.cpus_per_worker)"]
    return "; ".join(tries)


def input_bound_line(share: float, first: int, last: int, advice: str, threshold: float) -> str:
    return (f"WARNING: input-bound: {share:.0%} of each step waited for data over steps {first}-{last} "
            f"(data.input_bound_share: {threshold:g}); the accelerators idle meanwhile. Try: {advice}")


def run_tags(values: Mapping[str, float]) -> dict[str, str]:
    """MLflow tags a step's metrics bring (the run keeps the last value of each)."""
    tags = {}
    if values.get("input_bound_share") is not None:
        tags[INPUT_BOUND_TAG] = f"data wait {values['input_bound_share']:.0%} of the step time"
    if values.get("micro_batch") is not None:  # only auto jobs log it
        tags[MICRO_BATCH_TAG] = f"auto: {values['micro_batch']:.0f}"
    if values.get("micro_batch_halved_at") is not None:
        tags[MICRO_BATCH_HALVED_TAG] = (f"to {values['micro_batch']:.0f} after an out-of-memory error at step "
                                        f"{values['micro_batch_halved_at']:.0f}")
    if values.get("straggler_excluded_rank") is not None:
        tags[STRAGGLER_TAG] = (f"rank {values['straggler_excluded_rank']:.0f} was {values.get('straggler_ratio', 0):.2f}x "
                               "slower than the median: its node is avoided for failure.straggler_avoid_s")
    return tags


def summary_lines(metrics: Mapping[str, float]) -> list[str]:
    """The end-of-run summary's lines: where the time went, and input-bound if it was."""
    lines = []
    shares = {k: metrics[f"time_share_{k}"] for k in PHASE_NAMES if f"time_share_{k}" in metrics}
    if shares:
        lines.append("  time            " + ", ".join(f"{PHASE_NAMES[k]} {v:.0%}" for k, v in shares.items())
                     + " (the last worker group)")
    if "input_bound_share" in metrics:
        lines.append(f"  input-bound     {metrics['input_bound_share']:.0%} of each step waited for data "
                     "(the console said what to try)")
    return lines
