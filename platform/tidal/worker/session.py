"""Everything a worker's training loop works with, set up once: `open_session(config) -> Session`.

Setup in the order it must happen: the spec's environment (its secrets read from this node), the job's event log, rank 0's
abort of dead uploads (before this attempt writes anything), the resume point every rank
agrees on and how it loads, the engine (built for that load), the restore,
then data, evaluator, watchdog and telemetry. What changes from step to step lives here too
(the loss accumulated since the last log step, the seconds checkpoints blocked this rank, when
to ask Ray about preemption again), so the loop itself holds no state but the step.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import ray.train
import torch

from tidal import fs, job_end
from tidal.lease import LeaseCheck
from tidal.redact import install as install_redaction
from tidal.spec import secrets
from tidal.spec.compile import compile_note, warmup_steps
from tidal.spec.deepspeed import sub_group_size
from tidal.spec.job import JobSpec
from tidal.tracking.emitter import Emitter
from tidal.worker import microbatch
from tidal.worker.checkpoint import restore, save
from tidal.worker.data import Batches
from tidal.worker.device import torch_device
from tidal.worker.engine import build_engine, data_parallel_rank, param_count
from tidal.worker.health import hang
from tidal.worker.health.directive import Directive
from tidal.worker.health.watchdog import StepWatchdog
from tidal.worker.logsync import LogSync
from tidal.worker.metrics import PhaseClock, ResourceSampler, flops_per_token, worker_peak_flops
from tidal.worker.plan import Cadence
from tidal.worker.telemetry import Telemetry
from tidal.worker.user_code import step_function


@dataclass
class Session:
    spec: JobSpec
    rank: int
    world: int
    device: torch.device
    events: Emitter
    engine: Any
    state: save.TrainState
    written_by: save.Provenance
    batches: Any  # Batches or StreamBatches
    evaluator: Any  # tidal.worker.evaluate.Evaluator, or None without spec.eval
    watchdog: StepWatchdog
    telemetry: Telemetry
    step_fn: Callable[[Any, Any], torch.Tensor]
    cadence: Cadence
    model_flops: float
    peak_flops: float
    host_stats: Callable[[], dict[str, float]]
    clock: PhaseClock
    sync: LogSync = field(default_factory=LogSync)
    loss_sum: torch.Tensor = field(default_factory=lambda: torch.zeros(1))
    loss_n: int = 0
    blocked_s: float = 0.0  # this rank's seconds in save.save since the last log step
    gate_s: float = 0.0  # this rank's optimizer waits for checkpoint writes, read at the last log step
    preemption_rearm_at: float = 0.0  # when to ask Ray about preemption again (time.time()); inf: never
    backlog_said: bool = False  # the Ray backlog note is said once per worker group
    last_save_s: float | None = None  # this group's last synchronous save, in s: can a warning's deadline fit one?
    directive: Directive | None = None  # rank 0's poll of the cluster's admission, under admission
    launched_max: int | None = None  # the size admission launched this group for (None: no admission)
    target_by: str = ""  # who asked for the size rank 0 last sent (worker/health/decide.group_target)
    lease: LeaseCheck | None = None  # whether this attempt's driver still owns the job (tidal/lease.py)
    auto: microbatch.AutoMicroBatch | None = None  # train.micro_batch auto: halves it on out-of-memory errors
    memory: Any = None  # checkpoint.memory: this worker's side of the memory tier (checkpoint/memory.py Tier)

    @property
    def samples_seen(self) -> int:
        return self.state.step * self.spec.train.global_batch

    @property
    def tokens_seen(self) -> int:
        return self.samples_seen * self.spec.model.seq_len

    def steps(self) -> range:
        """The steps this attempt trains: none when the job already ended (data, early stop)."""
        done = job_end.is_done(self.spec, asdict(self.state))
        return range(self.state.step + 1, (self.state.step if done else self.cadence.last) + 1)


def open_session(config: dict[str, Any]) -> Session:
    began = time.time()  # the group's setup, for the job's goodput account (tidal/goodput)
    spec = JobSpec.model_validate(config["spec"])
    os.environ.update(spec.worker_env)
    # The secrets' values exist only here, read from this node (spec/secrets.py): before any user code
    # (builders, step functions, datasets) is imported. Lines this worker prints mask them: Ray copies
    # them to the driver and `ray job logs`, where no other process knows the values (tidal/redact.py).
    values = secrets.resolve(spec.env)
    os.environ.update(values)
    install_redaction(values.values())
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    # Tracking goes to the job's durable event log, written off this thread: no tracking
    # process can fail or slow a step (tracking/emitter.py).
    # Every write that could harm a newer start of the job checks that none took its lease:
    # rank 0's event log, each rank's manifests, the first save's clearing (tidal/lease.py).
    lease = LeaseCheck.from_config(spec.checkpoint.storage, spec.name, config.get("lease"))
    events = Emitter(spec.checkpoint.storage, spec.name, fence=lease)
    save.fence_writes(lease)
    device = torch_device()
    # From here a hang is found and explained: the group's start (restore, engine build) is the watchdog's
    # phase "start", and a stopped rank's heartbeat is missed in seconds (worker/health/watchdog.py).
    watchdog = hang.watchdog(spec, rank, world, events)
    if rank == 0:
        abort_dead_uploads(spec, events)

    t_found = time.time()
    generation = lease.generation if lease is not None else 0  # whose keepers hold this driver's snapshots
    found, route = restore.agree_on_resume_point(spec, generation)  # rank 0 decides which and how; every rank loads that
    restore_s = time.time() - t_found
    # train.micro_batch auto: the size this job chose, or searched now (a collective); a number from here on.
    spec = microbatch.choose(spec, world, device, rank, events.say,
                             lambda sp, eng: _batches(sp, config, eng, rank, world, device))
    telemetry = Telemetry(spec, events, device, found)  # Prometheus, stragglers, site, cost; from here on
    engine = build_engine(spec, world, device, route)
    if rank == 0 and spec.parallelism.compile is not None:
        events.say(compile_note(spec.parallelism.compile))
    state = save.TrainState()
    if found:
        t_load = time.time()
        state = restore.restore(engine, found, route)
        restore_s += time.time() - t_load
        if rank == 0:
            events.resumed(found.name, state.step, int(found.state["world_size"]), world)
            if changed := save.libraries_changed(found.state):
                events.say(f"{found.name} was written with other library versions ({changed})")
    batches = _batches(spec, config, engine, rank, world, device)
    auto = (microbatch.AutoMicroBatch(spec, engine, batches, rank, events.say)
            if config["spec"]["train"]["micro_batch"] == "auto" else None)
    t, s = spec.train, spec.scaling
    seat = config.get("admission") or {}  # admission/seat.py: the job's key and the size it was launched for
    session = Session(
        spec, rank, world, device, events, engine, state,
        save.Provenance(world, spec.parallelism.zero_stage, spec.resume_fingerprint(),
                        sum(not p.requires_grad for p in engine.module.parameters()), sub_group_size(spec)),
        batches, _evaluator(spec, rank, world, device, batches),
        # the step deadline from the first step, and a hang explained (worker/health/hang.py)
        watchdog.opened(hang.resumed_step_times(found, world, spec.failure.step_timeout_floor_s)),
        telemetry, auto.step_fn(step_function(spec)) if auto else step_function(spec),  # train.step_fn, or model(*batch)
        Cadence(t.log_every, spec.checkpoint.every_steps, spec.eval.every_steps if spec.eval else None,
                job_end.last_step(t)),
        flops_per_token(param_count(engine, spec), spec.model),
        world * worker_peak_flops(device, spec.parallelism.precision, s.cpus_per_worker, s.peak_tflops_per_worker),
        ResourceSampler(device) if rank == 0 else dict,  # rank 0's host only
        PhaseClock(device, warmup_steps=warmup_steps(spec.parallelism.compile)),
        directive=Directive(seat["job"], world) if seat and rank == 0 else None,
        launched_max=seat.get("launched_max"), lease=lease, auto=auto,
    )
    session.memory = _memory_tier(spec, rank, world, events, generation, state.step)
    if rank == 0:
        events.started(state.step, world, time.time() - began, restore_s)
    return session


def _memory_tier(spec: JobSpec, rank: int, world: int, events: Emitter, generation: int, step: int) -> Any:
    """checkpoint.memory's snapshots for this group (a collective), or None without it; rank 0 says
    where the group's ranks restored from, when from memory (a survivor: its own copy)."""
    if spec.checkpoint.memory is None:
        return None
    from tidal.worker.checkpoint import memory

    if (why := memory.supported(spec)) is not None:
        if rank == 0:
            events.say(f"checkpoint.memory is off for this job: {why}")
        return None
    return memory.Tier(spec, rank, world, generation, lambda line: events.say(line, step))


def _batches(spec: JobSpec, config: dict[str, Any], engine: Any, rank: int, world: int,
             device: torch.device) -> Any:
    if spec.data.streaming:
        # Imported here: only streamed jobs read shards.
        from tidal.worker.stream import StreamBatches

        return StreamBatches(spec, config["stream_index"], *data_parallel_rank(engine, rank, world), device)
    return Batches(spec, *data_parallel_rank(engine, rank, world), device)


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

