"""The per-worker training loop Ray Train runs. Reads top to bottom; its state is `TrainState`."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

import ray.train
import torch

from tidal import fs
from tidal.eval_best import stopped_early
from tidal.launch.recovery import POLL_INTERVAL
from tidal.spec.job import JobSpec
from tidal.tracking.actor import known_run_id
from tidal.tracking.emitter import Emitter
from tidal.worker import checkpoint, restore
from tidal.worker.data import Batches
from tidal.worker.device import seed_step, torch_device
from tidal.worker.engine import build_engine, data_parallel_rank, is_pipeline, param_count
from tidal.worker.logsync import LogSync
from tidal.worker.metrics import (
    PhaseClock,
    ResourceSampler,
    flops_per_token,
    speed,
    trace_loss,
    worker_peak_flops,
)
from tidal.worker.telemetry import Telemetry
from tidal.worker.user_code import step_function
from tidal.worker.watchdog import StepWatchdog


def train_loop(config: dict[str, Any]) -> None:
    spec = JobSpec.model_validate(config["spec"])
    os.environ.update(spec.env)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    # Tracking goes to the job's durable event log, written off this thread: no tracking
    # process can fail or slow a step (tracking/emitter.py).
    events = Emitter(spec.checkpoint.storage, spec.name)
    device = torch_device()
    if rank == 0:
        abort_dead_uploads(spec, events)

    found = restore.agree_on_resume_point(spec)  # rank 0 decides; every rank loads the same one
    reshard = bool(found) and restore.needs_reshard(found.state, world)
    telemetry = Telemetry(spec, events, device, found)  # Prometheus, stragglers, site, cost; from here on
    engine = build_engine(spec, world, device, load_universal=reshard)
    if found:
        state = restore.restore(engine, found, reshard)
        if rank == 0:
            events.resumed(found.name, state.step, state.world_size, world)
    else:
        state = checkpoint.TrainState()
    state.world_size, state.zero_stage = world, spec.parallelism.zero_stage
    state.fingerprint = spec.resume_fingerprint()
    run_id = config.get("mlflow_run_id")  # a reference to the tracker's answer: taken at saves, never waited for

    if spec.data.streaming:
        # Imported here: only streamed jobs read shards.
        from tidal.worker.stream import StreamBatches

        batches: Batches | StreamBatches = StreamBatches(spec, config["stream_index"],
                                                         *data_parallel_rank(engine, rank, world), device)
    else:
        batches = Batches(spec, *data_parallel_rank(engine, rank, world), device)
    t = spec.train
    model_flops = flops_per_token(param_count(engine, spec), spec.model)
    s = spec.scaling
    peak = world * worker_peak_flops(device, spec.parallelism.precision, s.cpus_per_worker, s.peak_tflops_per_worker)
    clock, sync, loss_sum, loss_n = PhaseClock(device), LogSync(), torch.zeros(1), 0
    host_stats: Callable[[], dict[str, float]] = ResourceSampler(device) if rank == 0 else dict  # rank 0's only
    step_fn = step_function(spec)  # the user's train.step_fn, or model(*batch)
    watchdog = StepWatchdog(spec.failure.step_timeout_s, rank, events, spec.failure.phase_timeout_s)
    backlog_said = False
    preemption_rearm_at = 0.0  # when to ask Ray about preemption again (time.time()); inf: never
    evaluator = _evaluator(spec, rank, world, device, batches)

    done = state.data_ended or stopped_early(spec, asdict(state))
    last = state.step if done else min(t.steps, t.stop_at or t.steps)
    for step in range(state.step + 1, last + 1):
        seed_step(device, t.seed * 1_000_003 + step * 1_009 + rank)  # dropout depends on the step only
        clock.start_step(sync=step % t.log_every == 0)
        loss, n = _train_step(engine, batches.for_step(step), clock, step_fn)
        loss_sum += loss
        loss_n += n
        clock.end_step()
        watchdog.beat(step)
        state.step, state.samples_seen = step, step * t.global_batch
        state.tokens_seen = state.samples_seen * spec.model.seq_len

        data_ended = state.data_ended = batches.ended  # a stream of data.epochs ran out
        final = step == last or data_ended
        is_log = step % t.log_every == 0 or final
        is_ckpt = step % spec.checkpoint.every_steps == 0 or final
        is_eval = evaluator is not None and evaluator.due(step, final or is_ckpt)
        if not (is_log or is_ckpt or is_eval):
            continue
        times = clock.take()
        # One collective: the loss over ranks, their busy times, and whether to ask Ray now if a
        # node of this group is being drained or reclaimed (its check is a barrier of its own).
        agreed = sync.exchange(loss_sum.item(), loss_n, times.get("busy_s"), is_log and time.time() >= preemption_rearm_at)
        warning = ray.train.get_preemption_info() if agreed.check_preemption else None
        preempted = warning is not None
        if preempted:
            preemption_rearm_at = rearm_after_warning(warning.deadline_ms)
        is_ckpt |= preempted
        is_eval = evaluator is not None and evaluator.due(step, final or is_ckpt)
        step_s = times["step_time_s"]
        if rank == 0 and is_log:
            trace_loss(step, agreed.loss, world)
        metrics = {
            "step": step, "loss": agreed.loss, "lr": engine.get_lr()[0],
            **speed(spec, step_s, world, model_flops, peak), "world_size": world, "tokens_seen": state.tokens_seen,
            **times, "checkpoint_gate_s": checkpoint.gate_waited(), **host_stats(),
        }
        metrics |= telemetry.at_log_step(metrics, agreed.busy_s, final)
        loss_sum.zero_()
        loss_n = 0
        stop = False
        if is_eval:  # before the save: the checkpoint records this step's score and patience
            with watchdog.phase("eval"):
                eval_metrics, stop = evaluator.run(engine, state.evaluation, step)
            metrics.update(eval_metrics)
            is_ckpt |= stop  # early stopping ends with a checkpoint at this step
        if rank == 0 and not is_ckpt:
            events.metrics(metrics)  # written in the background: tracking never blocks a step
        if is_ckpt:
            state.mlflow_run_id = known_run_id(run_id) or state.mlflow_run_id
            with watchdog.phase("save"):
                if rank == 0:
                    if preempted:
                        events.say(f"preemption warning: saving an emergency checkpoint at step {step}", step)
                    # Wait until every step up to this one is durable on the job's storage: once the
                    # checkpoint exists, training never redoes them, so no process's death may lose them.
                    events.metrics(metrics)
                    events.drain()
                # A preemption warning's deadline cannot wait for a background write. (The last step's
                # may run in the background: Ray waits for it before the worker exits.)
                background = spec.checkpoint.async_upload and not preempted
                saved = checkpoint.save(engine, state, metrics, batches.save_position, background=background)
            if rank == 0:
                events.checkpointed(step, saved)
                if not backlog_said and (note := checkpoint.ray_backlog(
                        saved["checkpoint_ray_held_s"], spec.checkpoint.every_steps, os.environ.get(POLL_INTERVAL))):
                    events.say(note, step)
                    backlog_said = True  # once per worker group: the cause does not change
        if warning is not None:
            # The wait ends by itself at the deadline; the drain phase only keeps the step timeout off it.
            with watchdog.phase("drain", max(0.0, preemption_rearm_at - time.time()) + RECLAIM_MARGIN_S):
                _wait_for_reclaim(warning.deadline_ms)
        if stop:  # the driver says why once the group has ended (launch.trainer)
            break
        if data_ended and step < last:
            if rank == 0:
                # Only data.epochs ends a stream (without it, epochs follow one another as for indexed sources).
                events.say(f"the data stream ended after step {step} ({spec.data.epochs} epoch(s) of {spec.data.source}); "
                           "the job ends here", step)
            break
    events.drain()  # the last checkpoint's event and notes reach storage before this process ends


def abort_dead_uploads(spec: JobSpec, events: Emitter) -> None:
    """Abort the multipart uploads earlier attempts left incomplete in the job's folder (billed
    until aborted); before this attempt writes anything there, so none of its own is touched."""
    storage = spec.checkpoint.storage or ""
    try:
        if n := fs.abort_incomplete_uploads(storage, spec.name):
            events.say(f"aborted {n} incomplete upload(s) an earlier attempt left in the job's folder")
    except fs.UploadsUnchecked as e:
        # The storage URI is not named: it may hold credentials (s3://KEY:SECRET@bucket).
        events.say(f"WARNING: could not abort incomplete uploads in the job's folder ({e}); "
                   "a bucket lifecycle rule can (docs/cluster.md)")


def _evaluator(spec: JobSpec, rank: int, world: int, device: torch.device, batches: Any) -> Any:
    if spec.eval is None:
        return None
    from tidal.worker.evaluate import Evaluator

    return Evaluator(spec, rank, world, device, getattr(batches, "held_out", None))


def _train_step(engine: Any, micro: Iterator[Any], clock: PhaseClock,
                step_fn: Callable[[Any, Any], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """One optimizer step over this worker's micro-batches: (sum of their losses, how many)."""
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
            checkpoint.before_update(engine)  # a checkpoint written from the live state (CPU) ends first
            engine.step()  # DeepSpeed steps the optimizer only at the accumulation boundary
        total += loss.detach().float().cpu()
        n += 1


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
