"""run(spec): JobSpec -> ScalingConfig/RunConfig/FailureConfig/CheckpointConfig -> TorchTrainer.fit().

The CLI, the SDK and the Ray Jobs entrypoint all end here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidal import eval_best, fs, job_end
from tidal.admission import seat as admission
from tidal.admission.relaunch import RELAUNCHED_VAR, WAIT_VAR
from tidal.cluster import burst
from tidal.errors import SpecError, TidalError, UserCodeError
from tidal.launch.connect import connect_ray
from tidal.launch.console_pump import ConsolePump
from tidal.launch.interrupt import ctrl_c_interrupts
from tidal.launch.recovery import mistake_message, recovery_settings
from tidal.launch.result import RunResult
from tidal.lease import Lease, driver_command, submission_id
from tidal.output import print_notes, print_record
from tidal.ray_private import cancel_reservation, replica_group_config, train_requester
from tidal.redact import redact_uri
from tidal.spec.job import JobSpec
from tidal.spec.sections import trial_name
from tidal.spec.user_refs import check_calls
from tidal.storage import JOB_FILE, Found, RunDir, find_resume_point
from tidal.tracking.buffer import BUFFER_DIR, MetricsBuffer
from tidal.tracking.events import GroupEnded, Launched
from tidal.version import __version__
from tidal.worker.device import dist_backend
from tidal.worker.health import avoidance

# Ray, torch and MLflow take seconds to import: they load only once a job is really going to
# train, so running a finished job again answers at once (see _complete).
if TYPE_CHECKING:
    from ray.train import CheckpointConfig
    from ray.train.torch import TorchTrainer

log = logging.getLogger("tidal")
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray's job supervisor for a submitted job's driver


def run(spec: JobSpec, restart: bool = False, mlflow_tags: dict[str, str] | None = None,
        callbacks: list[Any] | None = None, wait: bool = False, trial: bool = False,
        began: float | None = None) -> RunResult:
    """Train `spec` to its last step, resuming from its latest complete checkpoint.

    `mlflow_tags` are added to the job's MLflow run (e.g. `mlflow.parentRunId` for a sweep
    trial); `callbacks` are extra Ray Train `UserCallback`s (e.g. Tune's report callback).
    A job has one live driver (tidal/lease.py): a second start of a running job is refused
    (JobAlreadyRunning, naming the live one), or with `wait` (or TIDAL_RUN_WAIT=1, which a
    relaunch after a head restart sets) starts once that one has ended. `trial`: a sweep's trial,
    the one kind of job whose name may end in `-tN`. `began`: when the job was submitted, the goodput
    account's first second (the CLI passes its process's start, so an interpreter's start and imports
    count as start-up); by default this call.
    """
    if not trial and (why := trial_name(spec.name)):
        raise SpecError([("name", why)])
    t0 = time.time() if began is None else began
    wait = wait or os.environ.get(WAIT_VAR) == "1"
    if restart and os.environ.get(RELAUNCHED_VAR) == "1":
        # A driver submitted again from an earlier one's record replays its `--restart`: the first
        # start set the folder aside already, and this one must go on from what it trained since.
        print(f"[tidal] job {spec.name!r} was submitted again by the cluster (a head restart or a parked turn): "
              "--restart applied to its first start only; resuming from its latest checkpoint", flush=True)
        restart = False
    spec = spec.resolved()
    # The user's functions against the arguments the spec gives them, before anything starts.
    print_notes(check_calls(spec, Path.cwd()))
    # Before anything reads or writes the job's folder, MLflow run or seat in the queue.
    lease = Lease(spec.checkpoint.storage, spec.name, face=driver_command())
    lease.acquire(wait=wait)
    lease.keep()
    try:
        result = _run_holding(spec, restart, mlflow_tags, callbacks, lease, t0)
    except Exception as e:
        if lease.lost.is_set() or not lease.renew():  # whatever failed, the reason is the newer start
            raise TidalError(lease.why_lost()) from e
        raise
    finally:
        lease.release()
    if lease.lost.is_set():
        raise TidalError(lease.why_lost())
    return result


def _run_holding(spec: JobSpec, restart: bool, mlflow_tags: dict[str, str] | None,
                 callbacks: list[Any] | None, lease: Lease, t0: float) -> RunResult:
    run_dir = RunDir(spec.checkpoint.storage, spec.name)
    if restart and (aside := run_dir.set_aside()):
        print(f"[tidal] --restart: the previous run's folder is kept as {aside}", flush=True)
    _check_vocab(spec)
    found = find_resume_point(spec, condemn_truncated=True)  # refuses an incompatible resume before any worker starts
    job = run_dir.read_json(JOB_FILE) or {}
    if job.get("fingerprint") != spec.fingerprint_hash():
        job = {}  # a different job under the same name and no checkpoint: a new MLflow run
    if found and _already_complete(spec, found.state):
        return _complete(spec, found, job, run_dir, t0, lease)
    if found:
        print(f"[tidal] resuming job {spec.name!r} from {found.name} (step {found.step}/{spec.train.steps}); "
              "use --restart to start over", flush=True)

    connect_ray()
    try:
        asked = time.time()
        with admission.seat(spec) as seat:  # QUEUED here while the cluster's admission says wait
            queued_s = time.time() - asked
            tags = {**_ray_tags(spec, run_dir), **(seat.tags() if seat else {}), **(mlflow_tags or {})}
            return _train(spec, run_dir, job, tags, callbacks or [], seat, t0, lease, queued_s)
    except admission.Parked as p:  # waits with no driver; admission starts the next (admission/parking.py)
        # The goodput account keeps this driver's wait, and the time parked until the successor's launch, as queue.
        record_event(run_dir, Launched(0, {"t0": t0, "queue_s": time.time() - asked, "parked": 1.0}))
        print_record({"name": spec.name, "parked_as": p.successor})
        return RunResult(spec.name, "", spec.tracking.uri, spec.checkpoint.storage, wall_s=time.time() - t0,
                         parked_as=p.successor, position=p.position)


def record_event(run_dir: RunDir, event: Launched | GroupEnded) -> None:
    """Put one of the driver's goodput events in the job's buffer. A side channel: a storage error
    here costs the account that event (said as a warning), never the job, which may be ending or
    already handed to its successor when it is written."""
    try:
        MetricsBuffer(run_dir.fs, run_dir.path).append({**event.entry(), "ts": int(time.time() * 1000)})
    except OSError as e:
        print(f"[tidal] WARNING: the goodput account misses the driver's {type(event).__name__} event: "
              f"storage refused it ({type(e).__name__}: {e})", flush=True)


def _train(spec: JobSpec, run_dir: RunDir, job: dict[str, Any], tags: dict[str, str], callbacks: list[Any],
           seat: admission.Seat | None, t0: float, lease: Lease, queued_s: float = 0.0) -> RunResult:
    import ray

    from tidal.tracking.actor import start_tracker

    trainer = _trainer(spec, callbacks, seat, lease)
    release_reservation(job.get("ray_requester"))
    # The job file names the run the tracker reopens (a new job under this name: none, a new run)
    # and this launch's Ray Train requester (the next launch releases it); whoever reads the
    # bucket reads it, so the tracking URI is kept redacted (tidal/redact.py). Written before the
    # tracker starts: the tracker adds the MLflow run id to what it reads here.
    run_dir.write_json(JOB_FILE, {"mlflow_run_id": job.get("mlflow_run_id"), "fingerprint": spec.fingerprint_hash(),
                                  "tracking_uri": redact_uri(spec.tracking.uri), "tidal_version": __version__,
                                  "ray_requester": train_requester(trainer)})
    # The goodput account's first second is this launch's (tidal/goodput): written before any group starts.
    record_event(run_dir, Launched(0, {"t0": t0, "queue_s": queued_s}))
    # The tracker opens the MLflow run while Ray starts the controller and the workers.
    tracker, _ = start_tracker(spec, tags, job_record(spec, None), lambda run_id: _announce(spec, run_id),
                               lease.config())
    pump = ConsolePump(tracker).start()
    # leftovers of an earlier launch that Ray never registered (the best one stays, under keep_best)
    run_dir.prune(spec.checkpoint.keep, spare=eval_best.spared(spec, run_dir))
    ok = False
    _free_memory_tier(spec, lease, "left by an earlier driver of this job")  # before any group snapshots
    try:
        # site "any": on-prem first, cloud nodes after burst_after_s; Tidal's recovery defaults for Ray;
        # this driver's keepers touched while it lives (they end themselves once it is gone)
        with burst.burst_capacity(spec), recovery_settings(spec), _keepers_touched(spec, lease), _rendezvous(spec, lease):
            _fit(spec, trainer, callbacks, seat, run_dir, lease)
        ok = not lease.lost.is_set()
        if ok:
            _say_if_stopped_early(spec, run_dir)
    except ray.train.TrainingFailedError as e:
        if isinstance(mistake := getattr(e, "controller_failure", None), UserCodeError):  # launch/recovery.py
            raise TidalError(mistake_message(spec.name, mistake)) from e
        # A controller error ends the run at once, with no worker restarts spent.
        how = ("in Ray Train's controller" if isinstance(e, ray.train.ControllerError)
               else f"after {spec.failure.max_restarts} restart(s)")
        raise TidalError(f"job {spec.name!r} failed {how}: {_root_cause(e)}\n"
                         f"Its checkpoints are in {run_dir.path}; run the same command again to resume.") from e
    finally:
        _free_memory_tier(spec, lease)
        (run_id, latest, left), url = _close_tracker(spec, tracker, ok, t0, pump, lease)
        if left:
            print(f"[tidal] WARNING: {left} metric point(s) could not reach MLflow; they stay in "
                  f"{run_dir.path}/{BUFFER_DIR} and are sent when this job runs again", flush=True)
    return RunResult(spec.name, run_id or "", spec.tracking.uri, spec.checkpoint.storage, latest, time.time() - t0,
                     url=url or (_link_here(spec, run_id) if run_id else ""))


def _free_memory_tier(spec: JobSpec, lease: Lease, why: str = "") -> None:
    """checkpoint.memory: end the job's keepers (tidal.worker.checkpoint.keeper) and free what they
    hold: at the job's end, and at its start those an earlier driver that died could not end. Only
    while this driver holds the lease, and never a newer driver's (keeper.remove: this generation
    and older)."""
    if spec.checkpoint.memory is None:
        return
    from tidal.worker.checkpoint import keeper

    if lease.lost.is_set() or not lease.renew():
        return  # a newer start owns the job: its keepers are its own; this driver's end themselves
    try:
        if (n := keeper.remove(keeper.Owner.of(spec, lease.generation))) and why:
            print(f"[tidal] removed {n} memory-tier keeper(s) {why}", flush=True)
    except Exception as e:  # noqa: BLE001 - a keeper that outlives its job holds memory, nothing more
        print(f"[tidal] WARNING: could not remove the job's memory-tier keepers ({type(e).__name__}: {e})", flush=True)


@contextlib.contextmanager
def _keepers_touched(spec: JobSpec, lease: Lease) -> Iterator[None]:
    """checkpoint.memory: this driver's keepers are touched while it trains (keeper.heartbeat)."""
    if spec.checkpoint.memory is None:
        yield
        return
    from tidal.worker.checkpoint import keeper

    with keeper.heartbeat(keeper.Owner.of(spec, lease.generation)):
        yield


@contextlib.contextmanager
def _rendezvous(spec: JobSpec, lease: Lease) -> Iterator[None]:
    """failure.replace_in_place: the rendezvous every generation of this launch's groups forms through
    (worker/health/rendezvous.py), in an actor of its own: no rank's loss takes it down."""
    if not spec.failure.replace_in_place:
        yield
        return
    from tidal.worker.health import rendezvous

    actor = rendezvous.start(spec.name, lease.generation)
    try:
        yield
    finally:
        rendezvous.stop(actor)


def _fit(spec: JobSpec, trainer: TorchTrainer, callbacks: list[Any], seat: admission.Seat | None,
         run_dir: RunDir, lease: Lease) -> None:
    """Train to the end. Under the cluster's admission a group ends early at a checkpoint when
    admission resizes the job (worker/health/directive.py): restart it at the size admission now gives
    (waiting while the job is SUSPENDED), from that checkpoint, until the job is complete. A group
    also ends early to take a persistent straggler's node out, and to bring it back once this job
    no longer avoids it (worker/health/avoidance.py): it restarts at once, the selector following the record."""
    while True:
        with ctrl_c_interrupts():  # Ray Train aborts the run on Ctrl-C; the CLI then says how to resume
            trainer.fit()
        if not lease.renew():  # at once: the renewal thread may not have looked since fit() returned
            return  # a newer start owns the job: this driver's workers stopped themselves (worker/loop.py)
        # The goodput account holds no workers from here until the next group starts (tidal/goodput).
        record_event(run_dir, GroupEnded(0))
        avoided = avoidance.restart_for(spec)  # the group ended to take a straggler's node out, or back in
        found = find_resume_point(spec) if seat is not None or avoided else None
        if found is None or _already_complete(spec, found.state):
            return
        if seat is not None:  # a straggler's node (avoided) too: _trainer's label selector follows its record
            before = seat.workers
            seat.wait()
            if not avoided:  # the group said why it ended for a node (worker/telemetry.py)
                print(f"[tidal] job {spec.name!r}: restarting at step {found.step} with up to {seat.workers} "
                      f"worker(s) (was {before}), as the cluster's admission decided", flush=True)
        trainer = _trainer(spec, callbacks, seat, lease)
        job = run_dir.read_json(JOB_FILE) or {}
        run_dir.write_json(JOB_FILE, {**job, "ray_requester": train_requester(trainer)})


def release_reservation(requester: str | None, timeout_s: float = 10.0) -> bool:
    """Have Ray's autoscaling coordinator drop what it still reserves for an earlier launch of this
    job. Why: a launch whose driver was killed leaves its elastic run's request in the coordinator
    until it expires (180 s in Ray 2.60), and a new launch on the same nodes found no capacity
    reserved for it and waited that out: a killed `tidal run` cost 200 s before its first step
    again (benchmarks/chaos_combined.py). A launch that ended cleanly cancelled its own request:
    dropping it again does nothing. False when there was nothing to drop or the coordinator
    could not be asked (no coordinator yet: nothing is held)."""
    if not requester:
        return False
    try:
        cancel_reservation(requester, timeout_s)
        return True
    except Exception as e:  # noqa: BLE001 - no coordinator (a fixed-size job, a new cluster): nothing to release
        log.debug("could not release %s's reservation: %s: %s", requester, type(e).__name__, e)
        return False


def _already_complete(spec: JobSpec, state: dict[str, Any]) -> bool:
    return job_end.is_done(spec, state)


def _say_if_stopped_early(spec: JobSpec, run_dir: RunDir) -> None:
    last = run_dir.latest_complete(warn=False) if spec.eval and spec.eval.patience else None
    if last is not None and eval_best.stopped_early(spec, last.state):
        print(f"[tidal] job {spec.name!r} ended at step {last.step} of {spec.train.steps}: "
              f"{eval_best.stop_reason(spec, last.state)}", flush=True)


def _complete(spec: JobSpec, found: Found, job: dict[str, Any], run_dir: RunDir, t0: float,
              lease: Lease) -> RunResult:
    """Running a finished job again: say so at once, without starting Ray or any worker, after
    sending whatever an earlier driver left in the metrics buffer."""
    t, reason = spec.train, job_end.end_reason(spec, found.state)
    if reason == "data":
        why, more = "its data stream ended", "--set data.epochs=N with more passes"
    elif reason == "early_stop":
        why, more = eval_best.stop_reason(spec, found.state), "--set eval.patience=null (or a larger patience)"
    elif reason == "stop_at":
        why, more = f"train.stop_at is {t.stop_at}", "--set train.stop_at=null (or a later step)"
    else:
        why, more = f"train.steps is {t.steps}", f"--set train.steps=N with N above {found.step}"
    print(f"[tidal] job {spec.name!r} is already complete at step {found.step} ({found.name}; {why}); "
          f"nothing to train.\n  continue it:   {more}\n"
          "  start over:    --restart (the old run's folder is kept aside)", flush=True)
    run_id, uri = job.get("mlflow_run_id") or None, job.get("tracking_uri") or spec.tracking.uri
    if MetricsBuffer(run_dir.fs, run_dir.path).load():
        run_id, _, left = _finish_here(spec, True, t0, lease, ran=False)
        if left:
            print(f"[tidal] WARNING: {left} metric point(s) still wait for MLflow in {run_dir.path}/{BUFFER_DIR}",
                  flush=True)
    record(spec, run_id)
    return RunResult(spec.name, run_id or "", uri, spec.checkpoint.storage, {"step": float(found.step)},
                     time.time() - t0)


def job_record(spec: JobSpec, run_id: str | None) -> dict[str, Any] | None:
    """What a submitted job tells its submitter (see tidal.launch.result); None outside Ray Jobs."""
    if RAY_JOB_ENV not in os.environ:
        return None
    return {"name": spec.name, "tracking_uri": spec.tracking.uri, "experiment": spec.tracking.experiment,
            "mlflow_run_id": run_id, "storage": spec.checkpoint.storage}


def record(spec: JobSpec, run_id: str | None) -> None:
    if (data := job_record(spec, run_id)) is not None:
        print_record(data)


def _check_vocab(spec: JobSpec) -> None:
    """A tokenizer with more tokens than the model's embedding would fail deep inside a worker."""
    if spec.data.tokenizer is None:
        return
    from tidal.worker import tokens

    size = tokens.vocab_size(spec.data.tokenizer)
    if size > spec.model.vocab_size:
        raise SpecError([("model.vocab_size", f"{spec.model.vocab_size} is below the {size} tokens of data.tokenizer "
                          f"({spec.data.tokenizer}); set model.vocab_size: {size} or more")])


def _close_tracker(spec: JobSpec, tracker: Any, ok: bool, t0: float, pump: ConsolePump,
                   lease: Lease) -> tuple[tuple[str | None, dict[str, float], int], str | None]:
    """Stop the tracker, first giving an unreachable MLflow up to `tracking.flush_timeout_s` to
    come back; it ends the run. If the actor cannot be reached, one in this process does.
    A driver whose job was taken over by a newer start ends nothing: the run is the newer one's.
    Returns what the run's close returns (run id, last values, points unsent) and the run's link
    as the tracker built it (None: build it here)."""
    import ray

    if lease.lost.is_set():
        pump.stop()
        ray.kill(tracker)
        return (None, {}, 0), None

    from tidal.tracking.actor import PING_TIMEOUT_S

    timeout_s = spec.tracking.flush_timeout_s
    try:
        # Up at all? Ray retries a call to a restarting actor without end; the calls below may take long.
        ray.get(tracker.ping.remote(), timeout=PING_TIMEOUT_S)
        left = ray.get(tracker.flush.remote(force=True))
        if left:
            print(f"[tidal] {left} metric point(s) still wait for MLflow; retrying for up to {timeout_s:.0f}s", flush=True)
        deadline = time.time() + timeout_s
        while left and time.time() < deadline:
            time.sleep(2)
            left = ray.get(tracker.flush.remote(force=True))
        closed = ray.get(tracker.close.remote(ok, time.time() - t0))
    except ray.exceptions.GetTimeoutError:
        print(f"[tidal] the tracker actor did not answer in {PING_TIMEOUT_S:.0f}s (Ray restarts it, and it cannot "
              "start: its process log on this node says why); finishing tracking in the driver", flush=True)
        closed = None
    except ray.exceptions.RayError as e:
        print(f"[tidal] the tracker actor is gone ({type(e).__name__}); finishing tracking in the driver", flush=True)
        closed = None
    url = None
    if closed is not None:
        with contextlib.suppress(ray.exceptions.RayError):  # the tracker gone or stuck: the driver builds it
            url = ray.get(tracker.run_url.remote(), timeout=timeout_s)
    pump.stop()  # before the kill: the lines the tracker printed while closing the run
    ray.kill(tracker)
    return (closed if closed is not None else _finish_here(spec, ok, t0, lease)), url


def _finish_here(spec: JobSpec, ok: bool, t0: float, lease: Lease,
                 ran: bool = True) -> tuple[str | None, dict[str, float], int]:
    """The tracker, in this process: sends what the event log still holds and ends the run
    (`ran` False: nothing trained in this launch; the goodput account ends at the job's last event)."""
    from tidal.tracking.tracker import Tracker

    rec = job_record(spec, None)
    return Tracker(spec, record=rec, system_metrics=False, background=False,
                   lease=lease.config()).close(ok, time.time() - t0, ran)


def _announce(spec: JobSpec, run_id: str | None) -> None:
    """Once the tracker has opened the run: the job's line, and its record for a submitter."""
    record(spec, run_id)
    print(f"[tidal] job {spec.name!r}: {_describe_scaling(spec)}; MLflow run {run_id}", flush=True)


def _trainer(spec: JobSpec, callbacks: list[Any], seat: admission.Seat | None = None,
             lease: Lease | None = None) -> TorchTrainer:
    import ray
    from ray.train import (
        FailureConfig,
        LoggingConfig,
        RunConfig,
        ScalingConfig,
    )
    from ray.train.torch import TorchConfig, TorchTrainer

    from tidal.launch.callbacks import ClusterView, FailureNotifier, Retention
    from tidal.spec.secrets import carried_spec
    from tidal.worker import train_loop

    s = spec.scaling
    most = seat.workers if seat is not None else s.max_workers  # admission's size caps the job's
    most = avoidance.most_workers(most, avoidance.read(spec))  # without a node it avoids (worker/health/avoidance.py)
    scaling = ScalingConfig(
        num_workers=(min(s.min_workers, most), most) if spec.elastic else most,
        use_gpu=s.gpus_per_worker > 0,
        **burst.scaling_overrides(spec),  # resources per worker, with the site's resource when pinned
        **({"elastic_resize_monitor_interval_s": s.elastic_check_s} if spec.elastic else {}),
        # a node this job avoids after taking a straggler out (worker/health/avoidance.py says why labels)
        label_selector=avoidance.label_selector(avoidance.read(spec)),
    )
    run_config = RunConfig(
        name=spec.name,
        **fs.ray_storage(spec.checkpoint.storage),  # abfs://: with the key Azure's variables give (tidal/azure_blob.py)
        failure_config=FailureConfig(max_failures=spec.failure.max_restarts),
        checkpoint_config=_checkpoint_config(spec),
        callbacks=[FailureNotifier(spec), Retention(spec), *([ClusterView()] if spec.elastic else []), *callbacks],
        # Ray Train logs every report at INFO; Tidal prints its own progress, restart and
        # checkpoint lines, so keep Ray's warnings and errors only.
        logging_config=LoggingConfig(log_level="WARNING"),
    )
    streaming: dict[str, Any] = {}
    if spec.data.streaming:
        from tidal.launch.stream_prep import prepare

        # Tokenized into shards here, before the workers hold any CPU (or reused if already made);
        # the workers read windows from it by global index.
        streaming = {"stream_index": prepare(spec)}
    return TorchTrainer(
        train_loop,
        # Ray Train's state API records this config: the spec's `env` holds references only, and the
        # workers read the values (tidal.spec.secrets); a credential elsewhere goes by reference (carried_spec).
        train_loop_config={**carried_spec(spec.model_dump(mode="json"), ray.put), **streaming,
                           **({"admission": seat.config()} if seat is not None else {}),
                           **({"lease": lease.config()} if lease is not None else {}),
                           **_rendezvous_config(spec, lease)},
        scaling_config=scaling,
        run_config=run_config,
        # failure.replace_in_place: Ray Train replaces a lost worker alone and forms no process group
        # across workers; the workers form their own through the driver's rendezvous (_rendezvous)
        torch_config=(replica_group_config(dist_backend(s.gpus_per_worker)) if spec.failure.replace_in_place
                      else TorchConfig(backend=dist_backend(s.gpus_per_worker))),
    )


def _rendezvous_config(spec: JobSpec, lease: Lease | None) -> dict[str, Any]:
    """The workers' side of the rendezvous (failure.replace_in_place): its actor's name and the backend."""
    if not spec.failure.replace_in_place:
        return {}
    from tidal.worker.health.rendezvous import actor_name

    return {"rendezvous": {"name": actor_name(spec.name, lease.generation if lease is not None else 0),
                           "backend": dist_backend(spec.scaling.gpus_per_worker)}}


def _checkpoint_config(spec: JobSpec) -> CheckpointConfig:
    """Ray Train's retention: the newest `keep`, or with keep_best the `keep` best by the eval
    metric each checkpoint reports (Ray always keeps the newest too, to resume from)."""
    kb = spec.checkpoint.keep_best
    from ray.train import CheckpointConfig

    if kb is None:
        return CheckpointConfig(num_to_keep=spec.checkpoint.keep)
    return CheckpointConfig(num_to_keep=spec.checkpoint.keep, checkpoint_score_attribute=kb.metric,
                            checkpoint_score_order=kb.mode)


def _ray_tags(spec: JobSpec, run_dir: RunDir) -> dict[str, str]:
    import ray

    tags = {"tidal.run_dir": run_dir.path, "ray.run_name": spec.name}
    job_id = submission_id() or (ray.get_runtime_context().get_job_id() if ray.is_initialized() else None)
    if job_id:
        tags["ray.job_id"] = job_id
    return tags


def _link_here(spec: JobSpec, run_id: str) -> str:
    """The run's link when the tracker could not build it (it is gone): MLflow loaded in this process."""
    from tidal.tracking.reader import safe_run_url

    return safe_run_url(spec, run_id)


def _describe_scaling(spec: JobSpec) -> str:
    s = spec.scaling
    workers = f"{s.min_workers}-{s.max_workers} (elastic)" if spec.elastic else str(s.max_workers)
    device = f"{s.gpus_per_worker} GPU" if s.gpus_per_worker else "CPU"
    return f"{workers} worker(s) x {s.cpus_per_worker:g} CPU, {device}, ZeRO-{spec.parallelism.zero_stage}, {spec.parallelism.precision}"


def _root_cause(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__


__all__ = ["RunResult", "run"]
