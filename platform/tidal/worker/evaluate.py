"""Held-out evaluation inside the training loop, on every worker at once.

The evaluation set is fixed: `eval.batches` batches of `train.global_batch` sequences, indexed
like training data (batch b covers samples [b*B, (b+1)*B)), each rank taking its slice of every
batch. The same sequences are evaluated every time and at any world size, so values compare
across steps, restarts and resizes. Every rank sums its per-sequence losses and the sums are
all-reduced, so all ranks hold the same eval_loss and take the same early-stopping decision.

It runs in eval mode under `torch.no_grad()` and touches neither the optimizer nor the global
RNG the loop re-seeds at each step, so the training losses of a job are the same with or
without evaluation, and a resumed job evaluates exactly as an undisturbed one.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from tidal.eval_best import improved
from tidal.spec.batch import rank_slice
from tidal.spec.job import JobSpec
from tidal.worker.data import SyntheticTask, TextWindows

EVAL_SEED = 104_729  # the synthetic task's evaluation draws use another seed than training's


class HeldOut:
    """Fixed held-out windows (a split of the training source) as a sample source."""

    def __init__(self, windows: torch.Tensor) -> None:
        self.windows = windows

    def samples(self, first: int, count: int) -> torch.Tensor:
        idx = torch.arange(first, first + count) % len(self.windows)  # a small held-out set repeats
        return self.windows[idx]


def eval_source(spec: JobSpec, held_out: torch.Tensor | None) -> Any:
    """Where the evaluation sequences come from: eval.source, else the split training never reads."""
    ev, m = spec.eval, spec.model
    assert ev is not None
    source = ev.source or spec.data.source
    if held_out is not None:
        return HeldOut(held_out)
    if source == "synthetic":
        return SyntheticTask(m.vocab_size, m.seq_len, spec.train.seed + EVAL_SEED)
    windows = TextWindows(source, spec.data.text_field, m.seq_len, spec.train.seed, spec.data.tokenizer).windows
    return HeldOut(windows)


class Evaluator:
    """Decides when to evaluate, evaluates, and keeps the early-stopping record in the TrainState."""

    def __init__(self, spec: JobSpec, rank: int, world_size: int, device: torch.device,
                 held_out: torch.Tensor | None) -> None:
        assert spec.eval is not None
        self.ev, self.t = spec.eval, spec.train
        self.source = eval_source(spec, held_out)
        self.part = rank_slice(self.t.global_batch, world_size, rank)
        self.device = device

    def due(self, step: int, final_or_checkpoint: bool) -> bool:
        """Every eval.every_steps, and at every checkpoint (so each carries its own score for
        keep_best and for Tune) and at the last step."""
        return step % self.ev.every_steps == 0 or final_or_checkpoint

    def run(self, engine: Any, record: dict[str, Any], step: int) -> tuple[dict[str, float], bool]:
        """Evaluate (a collective: every rank together), update `record` (the TrainState's
        `evaluation`) and return (the metrics to log at `step`, whether to stop early)."""
        loss = self._loss(engine)
        metrics = {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0))}
        best = record.get("best")
        if improved(loss, best, self.ev.min_delta):
            record.update(best=loss, best_step=step, since_best=0)
        else:
            record["since_best"] = int(record.get("since_best", 0)) + 1
        record.update(step=step, metrics=metrics)
        stop = self.ev.patience is not None and record["since_best"] >= self.ev.patience
        record["stopped_early"] = stop
        if stop:  # in MLflow, and for a sweep: this trial finished, no scheduler stopped it
            metrics["early_stopped"] = 1.0
        return metrics, stop

    def _loss(self, engine: Any) -> float:
        loss_sum, sequences = 0.0, 0
        engine.eval()
        try:
            with torch.no_grad():
                G = self.t.global_batch
                for b in range(self.ev.batches):
                    mine = self.source.samples(b * G, G)[self.part]
                    for chunk in mine.split(self.t.micro_batch):
                        chunk = chunk.to(self.device, non_blocking=True)
                        # The model returns the mean over the chunk's tokens; every sequence has
                        # seq_len of them, so the mean times the count is the chunk's sum.
                        loss_sum += float(engine(chunk[:, :-1], chunk[:, 1:])) * len(chunk)
                        sequences += len(chunk)
        finally:
            engine.train()
        total = torch.tensor([loss_sum, sequences], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        return float(total[0] / total[1])
