"""The chaos harness: a job run undisturbed, then again while a seeded injector SIGKILLs its Ray
Train workers; what happened, as numbers (`tests/test_chaos.py` asserts on them,
`benchmarks/chaos.py` writes them into docs/reliability.md).

The caller starts Ray (the harness runs jobs with `tidal.run`, which joins a running instance)."""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import tidal
from tidal.spec.job import JobSpec
from tidal.testing.processes import kill, our_processes, wait_for
from tidal.testing.runs import StepHolds, job_run_id, metric_history, prepared_store, wait_for_step
from tidal.testing.timeline import Timeline, TraceTail, step_prints
from tidal.worker.metrics import LOSS_TRACE_ENV


def chaos_spec(tmp: Path, name: str, steps: int, every: int, memory_every: int | None = None) -> JobSpec:
    """The job; rank 0 traces every life's loss of every step into `<tmp>/<name>.trace`; with
    `memory_every`, the memory tier snapshots every that many steps (checkpoint.memory)."""
    spec = JobSpec(
        name=name,
        model={"n_layer": 2, "n_head": 2, "d_model": 64, "vocab_size": 64, "seq_len": 16},
        train={"steps": steps, "micro_batch": 4, "global_batch": 64, "lr": 1e-2, "warmup_steps": 5, "log_every": 1},
        parallelism={"zero_stage": 2},
        scaling={"min_workers": 2, "max_workers": 2},
        # The memory tier (on by default) only with `memory_every`: without it, restarts read storage.
        checkpoint={"every_steps": every, "keep": 3, "storage": str(tmp / "runs"), "memory": None},
        failure={"max_restarts": 50},
        tracking={"uri": prepared_store(tmp / "mlflow.db"), "experiment": "chaos"},
        worker_env={LOSS_TRACE_ENV: str(tmp / f"{name}.trace")},
    )
    return spec if memory_every is None else spec.with_overrides({"checkpoint.memory.every_steps": memory_every})


def traced(spec: JobSpec) -> list[tuple[int, float]]:
    """(step, loss) of every execution of every step, replays included, in order."""
    path = Path(spec.worker_env[LOSS_TRACE_ENV])
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [(r["step"], r["loss"]) for r in rows]


def run_chaos(tmp: Path, faults: int, steps: int, every: int, seed: int,
              expected: dict[int, float] | None = None, held: bool = False) -> dict[str, Any]:
    """Runs the job under faults and compares every execution of every step with `expected`
    (step -> loss of the undisturbed job: a test's stored reference), or with an undisturbed
    run made here first (the benchmark); returns what happened. `held` (tests): rank 0 holds after
    each fault's step until its kill lands (StepHolds), so every planned fault lands however fast the
    machine trains; without it (the benchmarks) a kill lands wherever the job is when MLflow shows the step."""
    ref: dict[str, Any] = {}
    if expected is None:
        reference = chaos_spec(tmp, "undisturbed", steps, every)
        t_ref = time.time()
        done = tidal.run(reference)
        expected = dict(traced(reference))
        ref = {"ref_run_id": done.mlflow_run_id, "ref_wall_s": time.time() - t_ref, "ref_uri": reference.tracking.uri,
               "ref_useful_s": sum(metric_history(reference, done.mlflow_run_id, "step_time_s").values())}

    spec = chaos_spec(tmp, "chaos", steps, every)
    rng = random.Random(seed)
    # Fault k lands at a random step in the k-th of faults + 2 slices of the run, so faults spread
    # over it and none is planned in the last slice: the job could end before the kill lands.
    width = steps // (faults + 2)
    targets = sorted(rng.randrange(k * width + 5, (k + 1) * width) for k in range(1, faults + 1))
    holds = StepHolds(*targets) if held else None
    spec = holds.spec(spec) if holds else spec
    injected: list[int] = []
    kill_times: list[tuple[float, int]] = []  # (wall time of the kill, highest step logged by then)

    def inject() -> None:
        for step in targets:
            if holds:
                holds.wait(step)
                seen = step
            else:
                seen = wait_for_step(spec, step, timeout=600)
            workers = _workers_within(our_processes, 60)  # none while a restarted group is starting
            if workers:
                kill(rng.choice(workers))
                kill_times.append((time.time(), seen))
                injected.append(step)
            if holds:
                holds.release(step)
            time.sleep(1.0)

    injector = threading.Thread(target=inject, daemon=True)
    t0 = time.time()
    timeline = Timeline(launched=t0)  # the harness's own clock (testing/timeline.py)
    injector.start()
    with step_prints(timeline), TraceTail(Path(spec.worker_env[LOSS_TRACE_ENV]), timeline):
        result = tidal.run(spec)
    wall = time.time() - t0
    timeline.ended, timeline.kills = t0 + wall, list(kill_times)
    injector.join(timeout=10)
    run_id = result.mlflow_run_id
    loss = metric_history(spec, run_id, "loss")
    lives = traced(spec)
    step_time = metric_history(spec, run_id, "step_time_s")
    return {
        "recovery_s": _recovery_seconds(spec, run_id, kill_times),
        "faults_planned": targets, "faults_injected": injected, "restarts": int(metric_history(spec, run_id, "restarts")[steps]),
        "steps_lost": int(metric_history(spec, run_id, "steps_lost")[steps]),
        "max_steps_lost": int(metric_history(spec, run_id, "max_steps_lost")[steps]),
        "every_steps": every, "steps_done": sorted(loss) == list(range(1, steps + 1)),
        # Every execution of every step, replays included (MLflow holds each step's first only).
        "max_rel_loss_diff": max(abs(v - expected[s]) / abs(expected[s]) for s, v in lives),
        "executions": len(lives),
        "useful_s": sum(step_time.values()), "wall_s": wall, "steps": steps,
        "run_id": run_id, "uri": spec.tracking.uri, **ref,  # the platform's goodput account is in these runs
        "timeline": timeline,
    }


def run_periodic(tmp: Path, period_s: float | None, steps: int, every: int, seed: int,
                 memory_every: int | None = None, in_place: bool = False,
                 expected: dict[int, float] | None = None) -> dict[str, Any]:
    """The same job with a worker SIGKILLed every `period_s` of wall time from its first step
    (the issue's "a fault every 2 minutes"; None: no fault, the reference), with
    failure.replace_in_place as `in_place`. Per kill, whether the other workers' processes were
    still there once the job trained a step after it (`survivors_kept`); with `expected` (step ->
    loss of an undisturbed run), every execution of every step, replays included, against it."""
    spec = chaos_spec(tmp, "periodic" if period_s else "undisturbed", steps, every, memory_every)
    spec = spec.with_overrides({"failure.replace_in_place": in_place})
    trace = Path(spec.worker_env[LOSS_TRACE_ENV])
    rng = random.Random(seed)
    stop = threading.Event()
    kill_times: list[tuple[float, int]] = []
    kept: list[bool] = []

    def inject() -> None:
        wait_for_step(spec, 1, timeout=600)
        run_id = job_run_id(spec, 60)
        due = time.time() + (period_s or 0)
        while period_s and not stop.wait(max(0.0, due - time.time())):
            workers = _workers_within(our_processes, 60)
            if workers and not stop.is_set():
                seen = _highest_step(spec, run_id)
                victim = rng.choice(workers)
                others = {p.pid for p in workers if p.pid != victim.pid}
                kill(victim)
                kill_times.append((time.time(), seen))
                due = kill_times[-1][0] + period_s  # the next kill on the clock, however long this one's recovery
                if _stepped_after(trace, kill_times[-1][0], stop):
                    kept.append(others <= {p.pid for p in our_processes("RayTrainWorker")})

    injector = threading.Thread(target=inject, daemon=True)
    t0 = time.time()
    injector.start()
    result = tidal.run(spec)
    wall = time.time() - t0
    stop.set()
    injector.join(timeout=10)
    out = _periodic_summary(spec, result.mlflow_run_id, kill_times, wall, period_s or 0.0, every)
    lives = traced(spec)
    out.update(survivors_kept=kept, executions=len(lives), lives=lives)
    if expected is not None:  # bit for bit: any difference at all is counted
        out["loss_mismatches"] = sum(1 for s, v in lives if v != expected.get(s))
    return out


def _stepped_after(trace: Path, t: float, stop: threading.Event, timeout_s: float = 300) -> bool:
    """Whether rank 0's loss trace holds a step trained after `t` (the group trains again) before the
    job ends or `timeout_s` passes."""
    deadline = time.time() + timeout_s
    while not stop.is_set() and time.time() < deadline:
        for line in trace.read_text().splitlines() if trace.exists() else []:
            with contextlib.suppress(ValueError):  # a line cut short by a kill mid-write
                if json.loads(line)["ts"] > t:
                    return True
        stop.wait(0.2)
    return False


def _highest_step(spec: JobSpec, run_id: str) -> int:
    from mlflow.tracking import MlflowClient

    return max((m.step for m in MlflowClient(spec.tracking.uri).get_metric_history(run_id, "loss")), default=0)


def _periodic_summary(spec: JobSpec, run_id: str, kills: list[tuple[float, int]], wall: float,
                      period_s: float, every: int) -> dict[str, Any]:
    from mlflow.tracking import MlflowClient

    hist = MlflowClient(spec.tracking.uri).get_metric_history(run_id, "loss")
    first, last = min(m.timestamp for m in hist) / 1000, max(m.timestamp for m in hist) / 1000
    useful = sum(metric_history(spec, run_id, "step_time_s").values())
    steps = spec.train.steps
    return {"period_s": period_s, "faults": [s for _, s in kills], "every_steps": every, "steps": steps,
            "restarts": int(metric_history(spec, run_id, "restarts")[steps]),
            "steps_lost": int(metric_history(spec, run_id, "steps_lost")[steps]),
            "steps_done": sorted(m.step for m in hist) == list(range(1, steps + 1)),
            "recovery_s": _recovery_seconds(spec, run_id, kills), "useful_s": useful,
            "wall_s": wall, "training_wall_s": last - first, "run_id": run_id, "uri": spec.tracking.uri}


def _workers_within(find: Any, timeout_s: float) -> list[Any]:
    """The training workers, once there are some; none if no group is up within `timeout_s`."""
    try:
        return wait_for("training workers", lambda: find("RayTrainWorker"), timeout_s)
    except TimeoutError:
        return []


def _recovery_seconds(spec: JobSpec, run_id: str, kills: list[tuple[float, int]]) -> list[float]:
    """Per fault: seconds from the kill to the first step beyond what was reached before it
    (restart, reload and the replay of the steps lost)."""
    from mlflow.tracking import MlflowClient

    logged = {m.step: m.timestamp / 1000 for m in MlflowClient(spec.tracking.uri).get_metric_history(run_id, "loss")}
    out = []
    for t_kill, seen in kills:
        after = [ts for step, ts in logged.items() if step > seen and ts > t_kill]
        if after:
            out.append(round(min(after) - t_kill, 1))
    return out
