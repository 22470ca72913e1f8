"""The per-worker training loop Ray Train runs. Reads top to bottom; its state is `TrainState`.

`train_loop` trains one step, asks `tidal.worker.plan` what the step owes (pure decisions: log,
evaluate, checkpoint, drain, end) and hands the plan to `finish_step`, the one place that carries
it out. Setup and everything that lives across steps: `tidal.worker.session`.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import ray.train
import torch

from tidal.ray_private import HEALTH_CHECK_INTERVAL
from tidal.spec.secrets import with_carried_spec
from tidal.worker import hold, plan
from tidal.worker import warning as short_warning
from tidal.worker.checkpoint import save
from tidal.worker.device import seed_step
from tidal.worker.engine import is_pipeline
from tidal.worker.health import rendezvous
from tidal.worker.health.decide import NONE, LostWorker, decide, group_target, resize_to
from tidal.worker.logsync import Agreed
from tidal.worker.metrics import PhaseClock, speed, trace_loss
from tidal.worker.session import Session, open_session
from tidal.worker.spares import Spares


def train_loop(config: dict[str, Any]) -> None:
    config = with_carried_spec(config, ray.get)  # the spec unredacted, where the driver had to redact it
    if not still_owner(config):
        return  # a newer start owns the job: this group ends before it touches anything
    group = _member(config)  # failure.replace_in_place: the job's own process group (worker/health/rendezvous.py)
    if group is not None:
        group.form()
    s = _opened(config, group)
    warm = Spares(s.spec.failure.warm_spares, s.spec.scaling.cpus_per_worker)  # this node's warm spares, refilled after the first step
    reformed_at: int | None = None  # the step this rank resumed at when it last re-formed in place
    while True:
        try:
            _train(s, warm)
            break
        except Exception as e:
            # Lost again before this rank trained a step of the re-formed group: the fault may be this
            # process's own state (a replacement that fails on meeting it), which only a full restart clears.
            reforming = reformed_at is not None and s.state.step <= reformed_at
            if group is None or not _replaced_in_place(s, e, reforming):
                raise  # Ray Train restarts the whole group (or, for a lost worker, replaces it and we re-form)
            s = _reform(config, s, group)
            reformed_at = s.state.step
    if s.directive is not None:
        s.directive.close()
    s.events.drain()  # the last checkpoint's event and notes reach storage before this process ends


def _member(config: dict[str, Any]) -> rendezvous.Member | None:
    """This rank's side of the driver's rendezvous, with failure.replace_in_place; None: Ray's process group."""
    if not (rdzv := config.get("rendezvous")):
        return None
    ctx = ray.train.get_context()
    return rendezvous.Member(rdzv["name"], ctx.get_world_rank(), ctx.get_world_size(), rdzv["backend"],
                             rendezvous.FORM_S)


def _opened(config: dict[str, Any], group: rendezvous.Member | None) -> Session:
    """The session on this rank's group; rank 0 says when the group replaced a lost rank in place."""
    s = open_session(config)
    if group is not None and s.rank == 0 and (line := group.replaced_line()):
        s.events.say(line, s.state.step)
    return s


def _replaced_in_place(s: Session, e: BaseException, reforming: bool) -> bool:
    """Whether `e` is a lost peer that this rank's group replaces in place (worker/health/decide.py)."""
    return rendezvous.peer_lost(e) and decide(LostWorker(s.world, True, reforming)).action == "replace"


def _reform(config: dict[str, Any], s: Session, group: rendezvous.Member) -> Session:
    """A peer was lost: end what this session opened, dissolve the group, form the next generation with the
    replacement Ray Train starts, and open the session again in this process (the resume agreement rolls
    every rank back to the newest complete memory snapshot, or checkpoint). Anything that goes wrong here
    raises: Ray Train's full restart takes over, as without failure.replace_in_place."""
    _close(s)
    group.dissolve()
    # The re-formed group is a new attempt of the job's saves (without this the survivor skipped the attempt
    # id's collective at the next save while the replacement ran it, and the ranks hung in mismatched collectives)
    save.new_attempt()
    # A loss in here raises as it is: Ray Train restarts the group (as decide does for one while re-forming).
    group.form(s.state.step)
    return _opened(config, group)


def _close(s: Session) -> None:
    """End what `s` opened that outlives it in this process: its watchdog and heartbeat, admission's
    poll, the memory tier's hand-over in flight (its keepers keep what was handed over), its events."""
    s.watchdog.close()
    if s.directive is not None:
        s.directive.close()
    if s.memory is not None:
        s.memory.close(timeout=rendezvous.FORM_S)
    s.events.drain(timeout_s=10.0)


def _train(s: Session, warm: Spares) -> None:
    """Train the session's steps until the job ends (or this group ends: a resize, a newer start)."""
    spec, state = s.spec, s.state
    try:
        for step in s.steps():
            hold.before_step(s.rank, step)  # tests only: a fault lands after a known step (TIDAL_TEST_HOLD_AFTER_STEP)
            seed_step(s.device, spec.train.seed * 1_000_003 + step * 1_009 + s.rank)  # dropout depends on the step only
            s.clock.start_step(sync=step % spec.train.log_every == 0)
            train = partial(_train_step, s.engine, s.clock, s.step_fn, s.batches, step)
            loss, n = s.auto.step(step, train) if s.auto else train()  # auto: halved and redone on out-of-memory
            s.loss_sum += loss
            s.loss_n += n
            s.clock.end_step()
            s.watchdog.beat(step)
            warm.after_step()
            state.step, state.data_ended = step, s.batches.ended  # a stream of data.epochs ran out
            due = plan.due(step, s.cadence, state.data_ended)
            if due is None:
                _snapshot_to_memory(s, step)
                continue
            times = s.clock.take()
            agreed = _agree(s, times, due.may_check_preemption, due.checkpoint)  # the log step's one collective
            warning = ray.train.get_preemption_info() if agreed.check_preemption else None
            if warning is not None:
                s.preemption_rearm_at = rearm_after_warning(warning.deadline_ms)
            # the size rank 0 asked for (worker/health/decide.group_target), for a group launched at s.world
            resize = resize_to(agreed.target, _launched(s))
            step_plan = plan.plan_step(due, s.cadence, warning is not None, spec.checkpoint.async_upload,
                                       resize is not None, agreed.superseded)
            if step_plan.end == "superseded":
                if s.rank == 0:
                    print(f"[tidal] {s.lease.why()}", flush=True)  # not an event: the job's log is the newer start's
                break
            if step_plan.end == "resize" and s.rank == 0 and s.target_by == "admission":
                s.events.say(f"admission resizes this job to {resize} worker(s): checkpoint at step {step}, "
                             "then the group restarts at that size", step)
            if (end := finish_step(s, step_plan, agreed, times, warning)) is not None:
                if s.rank == 0:  # the goodput account: the gap until the next group is this end's (tidal/goodput)
                    s.events.ending(step, end)
                break
            _snapshot_to_memory(s, step)
    finally:
        # Ended, or raised (a peer died mid-collective): either way this rank judges no peer's silence
        # from here - a killed peer stops beating while Ray tears the group down, and no hang is counted
        # against its node - and the final background upload and the last writes are no step.
        s.watchdog.end()


def still_owner(config: dict[str, Any]) -> bool:
    """False when a newer start of this job holds its lease: a group Ray starts (or restarts) for a
    superseded driver must not open a session, whose first acts (aborting uploads, clearing
    stale checkpoint folders) would undo the newer attempt's work."""
    from tidal.lease import LeaseCheck

    spec = config["spec"]
    check = LeaseCheck.from_config(spec["checkpoint"]["storage"], spec["name"], config.get("lease"))
    if check is None or check.current(fresh=True):
        return True
    if ray.train.get_context().get_world_rank() == 0:
        print(f"[tidal] {check.why()}", flush=True)
    return False


def _agree(s: Session, times: dict[str, float], may_check: bool, due_checkpoint: bool = False) -> Agreed:
    """One collective: the loss over ranks, their busy times, the seconds checkpoints blocked
    each since the last log step, whether to ask Ray now if a node of this group is being
    drained or reclaimed (its check is a barrier of its own), and whether a newer start of the
    job took its lease (rank 0 looks at most once a second, and afresh before a checkpoint)."""
    # Checkpoint writes that optimizer steps waited for (save.before_update) count as
    # blocked too; read once here, so this rank's figure and rank 0's metric agree.
    s.gate_s = save.gate_waited()
    target, s.target_by = group_target(s.directive.target if s.directive is not None else NONE,
                                       s.telemetry.target, _launched(s))
    agreed = s.sync.exchange(s.loss_sum.item(), s.loss_n, times.get("busy_s"),
                             may_check and time.time() >= s.preemption_rearm_at, s.blocked_s + s.gate_s,
                             target,
                             s.rank == 0 and s.lease is not None and not s.lease.current(fresh=due_checkpoint))
    s.loss_sum.zero_()
    s.loss_n, s.blocked_s = 0, 0.0
    return agreed


def _launched(s: Session) -> int:
    """The size this group was launched for: admission's, or the world it started with."""
    return s.launched_max if s.launched_max is not None else s.world


def finish_step(s: Session, p: plan.StepPlan, agreed: Agreed, times: dict[str, float],
                warning: Any) -> plan.End | None:
    """Carry out `p`: metrics (emitted here only), eval, save, drain, the end's note. Returns
    why the job ends at this step, or None to train on."""
    if s.rank == 0 and p.log:
        trace_loss(p.step, agreed.loss, s.world)
    metrics = _metrics(s, agreed, times, p)
    if p.evaluate:  # before the save: the checkpoint records this step's score and patience
        t_eval = time.time()
        with s.watchdog.phase("eval"):
            eval_metrics, stop = s.evaluator.run(s.engine, s.state.evaluation, p.step)
        metrics.update(eval_metrics, eval_s=time.time() - t_eval)  # the goodput account's evaluation
        p = plan.after_eval(p, stop)
    if s.rank == 0:
        if p.emergency:
            s.events.say(f"preemption warning: saving an emergency checkpoint at step {p.step}", p.step)
            if note := short_warning.before_save(_left_s(warning), s.last_save_s):
                s.events.say(note, p.step)
        s.events.metrics(metrics)  # written in the background: tracking never blocks a step
    if p.checkpoint:
        t0 = time.time()
        _save(s, p, metrics)
        if p.emergency and s.rank == 0 and (note := short_warning.after_save(_left_s(warning, t0), time.time() - t0)):
            s.events.say(note, p.step)
    if p.drain:
        if s.rank == 0:  # until the next group starts, time goes to the preemption (tidal/goodput)
            s.events.ending(p.step, "preemption")
        # The wait ends by itself at the deadline; the drain phase only keeps the step timeout off it.
        with s.watchdog.phase("drain", max(0.0, s.preemption_rearm_at - time.time()) + RECLAIM_MARGIN_S):
            _wait_for_reclaim(warning.deadline_ms)
    if p.end == "data" and s.rank == 0:
        # Only data.epochs ends a stream (without it, epochs follow one another as for indexed sources).
        s.events.say(f"the data stream ended after step {p.step} ({s.spec.data.epochs} epoch(s) of "
                     f"{s.spec.data.source}); the job ends here", p.step)
    return p.end  # early stopping: the driver says why once the group has ended (launch.trainer)


def _metrics(s: Session, agreed: Agreed, times: dict[str, float], p: plan.StepPlan) -> dict[str, Any]:
    """The metrics of a planned step: rank 0 logs them; every rank builds them, since
    `Telemetry.at_log_step` exports each rank's gauges (and is a collective once per group)."""
    metrics = {
        "step": p.step, "loss": agreed.loss, "lr": s.engine.get_lr()[0],
        **speed(s.spec, times["step_time_s"], s.world, s.model_flops, s.peak_flops), "world_size": s.world,
        "tokens_seen": s.tokens_seen, **times, "checkpoint_gate_s": s.gate_s,
        # The slowest rank's stall since the last log step (its saves and its optimizer's waits).
        "checkpoint_blocked_max_s": agreed.blocked_max_s, **s.host_stats(),
        **(s.auto.metrics() if s.auto else {}),
    }
    return metrics | s.telemetry.at_log_step(metrics, agreed.busy_s, p.step == s.cadence.last or p.end == "data")


def _save(s: Session, p: plan.StepPlan, metrics: dict[str, Any]) -> None:
    # Every step up to this one must be durable on the job's storage before the checkpoint is
    # complete: once it exists, training never redoes them, so no process's death may lose them.
    # Rank 0's write waits for that before its manifest, off the training thread: waiting here
    # held every rank for an event-log write at each save (~60 ms of a 126 ms stall on moto S3).
    before_commit = partial(s.events.wait_written, s.events.mark()) if s.rank == 0 else None
    with s.watchdog.phase("save"):
        # A preemption warning's deadline cannot wait for a background write. (The last step's
        # may run in the background: Ray waits for it before the worker exits.)
        saved = save.save(s.engine, s.state, s.written_by, metrics, s.batches.save_position,
                                background=p.background, before_commit=before_commit)
    s.blocked_s += saved["checkpoint_blocked_s"]  # reaches the next log step's collective
    if not p.background:  # a synchronous save's whole time: what an emergency one will take
        s.last_save_s = saved["checkpoint_blocked_s"]
    if s.rank == 0:
        s.events.checkpointed(p.step, saved)
        if not s.backlog_said and (note := save.ray_backlog(
                saved["checkpoint_ray_held_s"], s.spec.checkpoint.every_steps, os.environ.get(HEALTH_CHECK_INTERVAL),
                save.period_s())):
            s.events.say(note, p.step)
            s.backlog_said = True  # once per worker group: the cause does not change


# How long a memory snapshot's hand-over waits for rank 0's events up to its step (they are written in
# milliseconds; storage that lags longer costs the snapshot, not training: the next one joins this wait).
LOGGED_WAIT_S = 5.0


def _snapshot_to_memory(s: Session, step: int) -> None:
    """checkpoint.memory: every rank's state to its node's and a peer's memory, every few steps
    (a collective; after the step's checkpoint and evaluation, so it holds what they changed)."""
    if s.memory is None or not s.memory.due(step) or step == s.cadence.last:
        return
    # Rank 0's events up to this step must be in the job's log before the snapshot is complete (as before a
    # checkpoint's, `_save`), waited for off the training thread and not long: a log that lags keeps the previous one.
    logged = partial(s.events.wait_written, s.events.mark(), LOGGED_WAIT_S) if s.rank == 0 else None
    with s.watchdog.phase("save"):
        s.memory.snapshot(s.engine, s.state, s.written_by, lambda line: s.events.say(line, step), logged)
    s.blocked_s += s.memory.take_stall()  # training waited for it: the checkpoint stall of the next log step


def _train_step(engine: Any, clock: PhaseClock, step_fn: Callable[[Any, Any], torch.Tensor], batches: Any,
                step: int) -> tuple[torch.Tensor, int]:
    """One optimizer step over this worker's micro-batches: (sum of their losses, how many)."""
    micro = batches.for_step(step)  # here: a step trained again reads its micro-batches afresh
    if is_pipeline(engine):  # DeepSpeed's schedule runs all micro-batches and the optimizer step
        with clock.phase("forward_backward_s"):
            return engine.train_batch(data_iter=micro).detach().float().cpu(), 1
    total, n = torch.zeros(1), 0
    while True:
        with clock.phase("data_wait_s"):
            batch = next(micro, None)
        if batch is None:
            return total, n
        with clock.phase("forward_backward_s"):
            loss = step_fn(engine, batch)
            engine.backward(loss)
        with clock.phase("optimizer_s"):
            save.before_update(engine)  # a checkpoint written from the live state (CPU) ends first
            engine.step()  # DeepSpeed steps the optimizer only at the accumulation boundary
        total += loss.detach().float().cpu()
        n += 1


def _left_s(warning: Any, now: float | None = None) -> float | None:
    """Seconds from `now` to the warning's deadline (None: the drain named none)."""
    deadline_ms = getattr(warning, "deadline_ms", None)
    return deadline_ms / 1000 - (now or time.time()) if deadline_ms else None


RECLAIM_MARGIN_S = 30.0  # how long past a drain's deadline Ray is given to tear the group down


def rearm_after_warning(deadline_ms: int | None, margin_s: float = RECLAIM_MARGIN_S) -> float:
    """When (time.time()) to ask Ray about preemption again after a warning with `deadline_ms`.

    One warning brings one emergency checkpoint; asking again while its drain is under way would
    save at every log step. But a group still training after the deadline (plus Ray's margin to
    tear it down) was not reclaimed: the drain was cancelled, and a later one must get its own
    emergency checkpoint. Without a deadline there is no moment at which the warning is known to
    be over, so it is never asked again (as before; the periodic checkpoints still run).
    """
    return deadline_ms / 1000 + margin_s if deadline_ms else math.inf


def _wait_for_reclaim(deadline_ms: int | None, margin_s: float = RECLAIM_MARGIN_S) -> None:
    """After the emergency checkpoint, train no further until Ray tears the group down at the
    deadline: steps trained now would be lost with the node. Ray then restarts the group on
    other nodes from that checkpoint. Without a deadline, or if nothing happens, train on."""
    if not deadline_ms:
        return
    until = deadline_ms / 1000 + margin_s
    while time.time() < until:
        time.sleep(0.2)
