"""What a training step does after its optimizer step, decided as plain values (no torch, no Ray).

The loop (tidal.worker.loop) asks three small questions in the order the facts arrive, and
carries out the answer in one place (`finish_step`):

1. `due(step, cadence, data_ended)`, before the log step's collective: is this a log, eval or
   checkpoint step at all (None: train on), and may Ray be asked about preemption? Every rank
   computes the same answer from the same step, so all of them enter the collective together.
2. `plan_step(due, preempted, async_upload, resize)`, after it: a preemption warning (which only the
   collective's agreed check can bring) forces a synchronous checkpoint, an eval at it, and a
   wait for the reclaim; a new size from the cluster's admission (worker/health/directive.py, agreed
   in the same collective) forces a synchronous checkpoint and ends the group there.
3. `after_eval(plan, stop_early)`: an eval that triggers early stopping forces a checkpoint at
   that step and ends the job.

Three decisions rather than one because each depends on something the step before it produced
(the agreed preemption check, then the eval's score); each stays a pure function tested alone
(tests/test_plan.py), as Ray Train V2's policies return decisions its controller carries out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

End = Literal["data", "early_stop", "resize", "superseded"]


@dataclass(frozen=True)
class Cadence:
    """The spec's cadences and the step the job ends at."""

    log_every: int
    checkpoint_every: int
    eval_every: int | None  # None: the job has no evaluation
    last: int


@dataclass(frozen=True)
class Due:
    """Before the collective: what this step owes by the cadences alone."""

    step: int
    log: bool
    checkpoint: bool
    final: bool  # the last step, or the data ran out
    data_ended: bool

    @property
    def may_check_preemption(self) -> bool:
        # Only log steps ask Ray (a barrier of its own): a checkpoint-only step stays cheap.
        return self.log


@dataclass(frozen=True)
class StepPlan:
    """What `finish_step` carries out at one step, in this order: emit metrics, evaluate,
    checkpoint, wait for a reclaim (drain), end the job."""

    step: int
    log: bool  # a log-cadence step: the loss trace too (metrics are emitted at every planned step)
    evaluate: bool
    checkpoint: bool
    background: bool  # the checkpoint's write may run behind training
    emergency: bool  # a preemption warning brought it
    drain: bool  # train no further until Ray reclaims the node
    end: End | None  # why the job ends here before its last step, if it does


def due(step: int, cadence: Cadence, data_ended: bool) -> Due | None:
    """None when the step owes nothing (no log, no checkpoint, no eval): no collective then."""
    final = step == cadence.last or data_ended
    d = Due(step, log=step % cadence.log_every == 0 or final,
            checkpoint=step % cadence.checkpoint_every == 0 or final, final=final, data_ended=data_ended)
    return d if d.log or d.checkpoint or _eval_due(step, cadence, d.checkpoint) else None


def plan_step(d: Due, cadence: Cadence, preempted: bool, async_upload: bool, resize: bool = False,
              superseded: bool = False) -> StepPlan:
    """After the collective: a preemption warning forces a synchronous checkpoint (its deadline
    cannot wait for a background write) and then the drain. A resize by admission forces one
    too (the group ends at this step: the restart resumes from it, so no step is lost) and ends
    the group, unless the job ends here anyway. A newer start of the job holding its lease
    (tidal/lease.py) ends this group at once with nothing written: no metrics, no checkpoint
    (the newer attempt trains these steps from its own resume point, once)."""
    if superseded:
        return StepPlan(d.step, log=False, evaluate=False, checkpoint=False, background=False, emergency=False,
                        drain=False, end="superseded")
    resize = resize and not d.final
    checkpoint = d.checkpoint or preempted or resize
    end: End | None = "data" if d.data_ended and d.step < cadence.last else ("resize" if resize else None)
    return StepPlan(
        d.step, log=d.log,
        # At every checkpoint (each carries its own score, for keep_best and Tune) and the last step.
        evaluate=_eval_due(d.step, cadence, checkpoint),
        checkpoint=checkpoint, background=async_upload and not (preempted or resize),
        emergency=preempted, drain=preempted and not resize, end=end)


def after_eval(plan: StepPlan, stop_early: bool) -> StepPlan:
    """Early stopping ends the job with a checkpoint at this step (after the eval, so that
    checkpoint records the score and patience that stopped it)."""
    if not stop_early:
        return plan
    return replace(plan, checkpoint=True, end="early_stop")


def _eval_due(step: int, cadence: Cadence, checkpoint_or_final: bool) -> bool:
    return cadence.eval_every is not None and (step % cadence.eval_every == 0 or checkpoint_or_final)
