"""sweep(spec): a Ray Tune experiment whose trials are whole Tidal jobs, tracked under one MLflow parent run.

- **A trial is a job.** Tune runs `_run_trial` once per trial; it calls `tidal.launch.trainer.run` on the
  base spec with the trial's values, named `<name>-t<N>`: its own run folder and checkpoints under
  `checkpoint.storage`, resume, restarts, and an MLflow child run (tag `mlflow.parentRunId`).
- **Metrics reach Tune with checkpoints only.** Tidal's per-step metrics go to the Tracker actor; each
  checkpoint's `ray.train.report` carries that step's metrics, and Ray's `TuneReportCallback` (a Train
  callback) forwards them to Tune. So ASHA (`time_attr="step"`) decides at checkpoint steps: a sweep
  can set `checkpoint_every` for its trials, and `grace_steps` defaults to that interval.
- **Resources.** The trial function only drives its job; Train's workers ask for their own CPUs/GPUs.
  The trial asks for no CPU (1 byte of memory: Tune refuses an empty request), so a 2-worker trial
  fits a 2-CPU machine. Trials at once default to what the cluster holds at `max_workers` each.
- **Resume.** The sweep's state is data (launch/sweep_state.py): every trial's values, drawn up front,
  and its outcome, in `<checkpoint.storage>/<name>-sweep/tidal-sweep.json`. Running the same sweep
  again rebuilds the Tuner from it, never from Tune's pickles (`Tuner.restore` would unpickle
  `tuner.pkl` from storage): unfinished and failed trials rerun their function, whose `run()`
  resumes from that trial's latest complete checkpoint and reopens its MLflow run.
  `restart=True` sets the old experiment and trial folders aside (never deletes them) and starts over.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs
import ray
from mlflow.tracking import MlflowClient
from ray import tune
from ray.tune.schedulers import ASHAScheduler
from ray.tune.search.basic_variant import BasicVariantGenerator

from tidal import fs, job_end
from tidal.errors import JobAlreadyRunning, SpecError, TidalError
from tidal.launch.connect import connect_ray
from tidal.launch.sweep_mlflow import close_parent, end_parent, open_parent
from tidal.launch.sweep_state import (
    SWEEP_FILE,
    TRIAL_KEY,
    Recorder,
    SweepState,
    new_trials,
    plan_trials,
    read_state,
)
from tidal.launch.trainer import run
from tidal.lease import Lease, driver_command, latest
from tidal.spec.job import JobSpec
from tidal.spec.sweep import Param as SweepParam
from tidal.spec.sweep import SweepSpec, check_metric, merged
from tidal.storage import RunDir
from tidal.version import __version__

# Tune needs a non-empty resource request; one byte of memory reserves nothing that training needs.
TRIAL_RESOURCES = {"memory": 1}


@dataclass
class SweepResult:
    """What a finished sweep left behind.

    `trials` (a pandas DataFrame) has one row per trial: `trial` (N of the job `<name>-t<N>`), `name`,
    one column per swept field, `status` (completed, stopped_early, failed, or unfinished in an
    interrupted sweep), `step` (the last checkpoint step Tune saw: where ASHA stopped it), `loss`
    (and the sweep's metric: the last value logged to the trial's MLflow run) and `mlflow_run_id`.
    `best_spec` is the exact spec of the best completed trial; `best_metrics` are its run's latest
    MLflow metrics.
    """

    name: str
    best_spec: JobSpec | None
    best_metrics: dict[str, float]
    trials: Any
    parent_run_id: str
    experiment_path: str
    tracking_uri: str
    metric: str = "loss"
    mode: str = "min"
    wall_s: float = 0.0
    params: list[str] = field(default_factory=list)

    @property
    def best_trial(self) -> str | None:
        return self.best_spec.name if self.best_spec else None

    def summary(self) -> str:
        lines = [f"[tidal] sweep {self.name!r}: {len(self.trials)} trial(s) in {self.wall_s:.0f}s", ""]
        lines += [self.trials.to_string(index=False, float_format=lambda v: f"{v:.4g}"), ""]
        if self.best_spec is None:
            lines.append("no trial completed: see the errors above; run the same command again to resume")
        else:
            values = ", ".join(f"{k}={_get(self.best_spec, k)}" for k in self.params)
            lines += [
                f"best trial      {self.best_spec.name}: {self.metric} {self.best_metrics.get(self.metric, float('nan')):.4f} "
                f"({self.mode}) with {values}",
                "  its spec      logged as best_spec.yaml on the parent run; rename it to train it afresh",
            ]
        lines += [f"  MLflow        parent run {self.parent_run_id} in {self.tracking_uri}",
                  f"  Tune state    {self.experiment_path}"]
        return "\n".join(lines)


def sweep(spec: JobSpec, params: dict[str, str] | list[str] | None = None, samples: int | None = None,
          scheduler: str | None = None, metric: str | None = None, mode: str | None = None,
          max_concurrent: int | None = None, grace_steps: int | None = None, restart: bool = False,
          config: SweepSpec | None = None) -> SweepResult:
    """Run `spec` once per trial with the swept fields drawn by Ray Tune; see the module docstring.

    `config` is the spec's `sweep:` section (default: `spec.sweep` once JobSpec has one); the other
    arguments, when given, override it; `params` are added to its params.
    """
    t0 = time.time()
    cfg = merged(config or getattr(spec, "sweep", None), params, samples=samples, scheduler=scheduler,
                 metric=metric, mode=mode, max_concurrent=max_concurrent, grace_steps=grace_steps)
    if not cfg.params:
        raise SpecError([("sweep.params", "nothing to sweep: add --param KEY=DIST (e.g. train.lr=loguniform:1e-4:1e-2) "
                          "or a sweep.params section to the spec")])
    base = _trial_base(spec, cfg)
    _check_values(base, cfg.parsed())
    _check_scheduler(base, cfg)
    check_metric(base, cfg)
    # The sweep's own lease (tidal/lease.py), before anything reads or writes its folder: a second
    # `tidal sweep` of it is refused, naming the live one, as a second start of a job is.
    lease = Lease(base.checkpoint.storage, f"{base.name}-sweep", face=driver_command())
    lease.acquire()
    lease.keep()
    try:
        return _sweep_holding(base, cfg, restart, t0)
    finally:
        lease.release()


def _sweep_holding(base: JobSpec, cfg: SweepSpec, restart: bool, t0: float) -> SweepResult:
    connect_ray(dashboard=cfg.scheduler == "asha")  # a local instance: ASHA needs the State API
    if cfg.scheduler == "asha":
        _check_state_api()

    exp_name = f"{base.name}-sweep"
    exp_path = f"{base.checkpoint.storage.rstrip('/')}/{exp_name}"
    folder = RunDir(base.checkpoint.storage, exp_name)
    fingerprint = _fingerprint(base, cfg)
    state = None if restart else read_state(folder, cfg.parsed())
    if state and state.fingerprint != fingerprint:
        raise TidalError(f"the sweep in {exp_path} was started with another spec or other sweep settings. "
                         "Run it with the original ones to resume it, or add --restart (restart=True) to start over "
                         "(its trials are set aside, not deleted).")
    if state is None:
        _set_aside(base)
        state = SweepState("", fingerprint, new_trials(plan_trials(cfg.parsed(), cfg.samples, cfg.seed)))
    else:
        print(f"[tidal] resuming sweep {base.name!r} from {exp_path} ({len(state.todo())} of {len(state.trials)} "
              "trial(s) to run); use --restart to start over", flush=True)
    state.parent_run_id = open_parent(base, cfg, state.parent_run_id or None)
    state.tidal_version = __version__
    folder.write_json(SWEEP_FILE, state.as_json())

    if state.todo():
        _fit(base, cfg, exp_name, folder, state)
    return _finish(state, base, cfg, exp_path, time.time() - t0)


def _fit(base: JobSpec, cfg: SweepSpec, exp_name: str, folder: RunDir, state: SweepState) -> None:
    """Run the trials not finished yet, recording each outcome in the sweep's state as it comes."""
    plan = [t["values"] for t in state.trials]
    trainable = tune.with_resources(tune.with_parameters(
        _run_trial, base=base.model_dump(mode="json"), plan=plan, parent_run_id=state.parent_run_id), TRIAL_RESOURCES)
    tuner = _new_tuner(trainable, base, cfg, exp_name, state.todo(), Recorder(folder, state, _last_step(base)))
    ok = False
    try:
        tuner.fit()
        ok = True
    finally:
        if not ok:
            end_parent(base, state.parent_run_id)


# --- before the sweep ---------------------------------------------------------------------
def _trial_base(spec: JobSpec, cfg: SweepSpec) -> JobSpec:
    """The spec every trial starts from: paths resolved here (trials run in Tune's folders), no sweep."""
    base = spec.resolved()
    if getattr(base, "sweep", None) is not None:
        base = base.with_overrides({"sweep": None})  # a trial's MLflow params are its own, not the sweep's
    if cfg.checkpoint_every:
        base = base.with_overrides({"checkpoint.every_steps": cfg.checkpoint_every})
    return base


def _check_values(base: JobSpec, params: dict[str, SweepParam]) -> None:
    """Fail before any trial starts if a value the sweep can draw makes an invalid job."""
    for key, p in params.items():
        for value in p.extremes():
            try:
                base.with_overrides({key: value, "name": f"{base.name}-t0"})
            except SpecError as e:
                why = "; ".join(f"{path}: {msg}" for path, msg in e.problems)
                raise SpecError([(f"--param {key}", f"the value {value!r} from {p.expression()} makes an invalid job: {why}")]) from None


def _check_scheduler(base: JobSpec, cfg: SweepSpec) -> None:
    if cfg.scheduler != "asha":
        return
    grace = cfg.grace_steps or base.checkpoint.every_steps
    if grace >= base.train.steps:
        raise SpecError([("sweep.grace_steps", f"{grace} is not below train.steps ({base.train.steps}), so ASHA could never "
                          "stop a trial: lower sweep.grace_steps or checkpoint more often (sweep.checkpoint_every)")])


def _check_state_api() -> None:
    """ASHA ends a trial by ending its Tune actor, which takes the trial's Train controller with it;
    Ray Train's PlacementGroupCleaner then frees the trial's workers, but it notices the dead
    controller only through Ray's State API (the dashboard). Without it those CPUs stay reserved
    and the next trial waits forever: refuse up front instead."""
    from ray.util.state import list_actors
    from ray.util.state.exception import RayStateApiException

    try:
        # this driver's own cluster: with no address the State API looks for one on the machine, and
        # refuses when it finds several (other Ray instances, other users)
        list_actors(address=ray.get_runtime_context().gcs_address, limit=1, timeout=10, raise_on_missing_output=False)
    except (RayStateApiException, ConnectionError) as e:
        raise TidalError("sweep.scheduler asha needs Ray's State API (the dashboard) to free the workers of stopped "
                         "trials, and this Ray cluster has none (started with include_dashboard=False or without "
                         "ray[default]?). Start Ray with its dashboard (a local instance: TIDAL_RAY_DASHBOARD=1), or sweep "
                         "with sweep.scheduler none.") from e


def _last_step(base: JobSpec) -> int:
    return job_end.last_step(base.train)


def _new_tuner(trainable: Any, base: JobSpec, cfg: SweepSpec, exp_name: str, todo: list[int],
               recorder: Recorder) -> tune.Tuner:
    concurrent = min(cfg.max_concurrent or _default_concurrency(base), len(todo))
    scheduler = None
    if cfg.scheduler == "asha":
        # max_t one past the last step: ASHA stops a trial that reaches max_t, and a trial stopped at
        # its final report is killed while its job closes its MLflow run. This way it ends by itself.
        scheduler = ASHAScheduler(time_attr="step", max_t=_last_step(base) + 1, reduction_factor=cfg.reduction_factor,
                                  grace_period=cfg.grace_steps or base.checkpoint.every_steps)
    return tune.Tuner(
        trainable,
        # The values were drawn up front (sweep_state.plan_trials): Tune sweeps the trial numbers.
        param_space={TRIAL_KEY: tune.grid_search(todo)},
        tune_config=tune.TuneConfig(
            metric=cfg.metric, mode=cfg.mode, num_samples=1, scheduler=scheduler,
            # Tune ignores max_concurrent_trials when given a generator: the generator limits itself.
            search_alg=BasicVariantGenerator(max_concurrent=concurrent),
        ),
        # Train restarts failed workers itself (failure.max_restarts); a trial that still fails is
        # retried when the sweep runs again.
        run_config=tune.RunConfig(name=exp_name, **fs.ray_storage(base.checkpoint.storage), callbacks=[recorder],
                                  failure_config=tune.FailureConfig(max_failures=0)),
    )


def _default_concurrency(base: JobSpec) -> int:
    """Trials whose workers all fit the cluster at once, each at max_workers (at least one)."""
    s = base.scaling
    need = {"CPU": s.max_workers * s.cpus_per_worker}
    if s.gpus_per_worker:
        need["GPU"] = float(s.max_workers * s.gpus_per_worker)
    have = ray.cluster_resources()
    fits = max(1, min(int(have.get(r, 0.0) // n) for r, n in need.items()))
    print(f"[tidal] sweep: {fits} trial(s) at a time (each needs {_resources(need)}; the cluster has "
          f"{_resources({r: have.get(r, 0.0) for r in need})}); set max_concurrent to change it", flush=True)
    return fits


def _set_aside(base: JobSpec) -> None:
    """A fresh sweep: move an old experiment and old trial folders of this name out of the way;
    none while its job is live (a trial of this sweep still running elsewhere, e.g. from a driver
    cut off from the sweep that started it): that is refused, naming it, before anything moves.
    Trial leases stay where they are, beside the folders (tidal/lease.py)."""
    store, root = fs.resolve(base.checkpoint.storage)
    mine = re.compile(rf"^{re.escape(base.name)}-(sweep|t\d+)$")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folders = [info for info in fs.list_dir(store, root)
               if info.type == pafs.FileType.Directory and mine.match(info.base_name)]
    now, host = time.time(), socket.gethostname()
    for info in folders:
        if info.base_name.endswith("-sweep"):
            continue  # the sweep's own: this process holds its lease
        holder = latest(store, f"{info.path}.lease", strict=True)  # a failed listing refuses (OSError)
        if holder is not None and holder.live(now, host):
            raise JobAlreadyRunning(f"--restart would move the folder of trial {info.base_name!r}, which is running: "
                                    f"{holder.describe(now)}. Stop it ({holder.stop_hint()}), or wait for it to end, "
                                    "then restart the sweep; nothing was moved.")
    for info in folders:
        fs.set_aside(store, info.path, f"{info.path}.replaced-{stamp}")
        print(f"[tidal] fresh sweep: moved {info.path} to {info.path}.replaced-{stamp}", flush=True)


def _fingerprint(base: JobSpec, cfg: SweepSpec) -> str:
    """What must not change between a sweep and its resume (concurrency may)."""
    blob = {"base": base.model_dump(mode="json"), "sweep": cfg.model_dump(exclude={"max_concurrent"})}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]


# --- one trial (runs in a Tune trial actor) -----------------------------------------------
def _run_trial(config: dict[str, Any], base: dict[str, Any], plan: list[dict[str, Any]], parent_run_id: str) -> None:
    from ray.tune.integration.ray_train import TuneReportCallback

    index = str(config[TRIAL_KEY])
    spec = trial_spec(base, plan[int(index)], index)
    tags = {"mlflow.parentRunId": parent_run_id, "tidal.sweep": base["name"], "tidal.trial": index}
    run(spec, mlflow_tags=tags, callbacks=[TuneReportCallback()], trial=True)


def trial_spec(base: dict[str, Any], values: dict[str, Any], index: str) -> JobSpec:
    """The job one trial runs: the base spec with its values, named `<name>-t<index>`."""
    return JobSpec.model_validate(base).with_overrides({**values, "name": f"{base['name']}-t{index}"})


# --- after the sweep ----------------------------------------------------------------------
def _finish(state: SweepState, base: JobSpec, cfg: SweepSpec, exp_path: str, wall_s: float) -> SweepResult:
    import pandas as pd

    parent = state.parent_run_id
    client = MlflowClient(base.tracking.uri)
    children = _children(client, base, parent)
    trials = pd.DataFrame([_row(i, t, base, cfg, children) for i, t in enumerate(state.trials)])
    best = _best(trials, cfg)
    best_spec, best_metrics = None, {}
    if best is not None:
        index = int(best["trial"])
        best_spec = trial_spec(base.model_dump(mode="json"), state.trials[index]["values"], str(index))
        child = children.get(str(index))
        best_metrics = dict(child.data.metrics) if child else {cfg.metric: float(best[cfg.metric])}
    close_parent(base, cfg, parent, trials, children, best_spec, best_metrics)
    return SweepResult(base.name, best_spec, best_metrics, trials, parent, exp_path, base.tracking.uri,
                       cfg.metric, cfg.mode, wall_s, list(cfg.params))


def _row(index: int, trial: dict[str, Any], base: JobSpec, cfg: SweepSpec, children: dict[str, Any]) -> dict[str, Any]:
    """One trial as the sweep's state recorded it: completed, stopped_early, failed, or unfinished
    (an interrupted sweep's trial that has not ended)."""
    child = children.get(str(index))
    status = trial["status"] if trial["status"] in ("completed", "stopped_early", "failed") else "unfinished"
    row: dict[str, Any] = {"trial": index, "name": f"{base.name}-t{index}"}
    row.update({k: trial["values"].get(k) for k in cfg.params})
    row.update({"status": status, "step": trial.get("step")})
    for key in dict.fromkeys(["loss", cfg.metric]):
        # MLflow holds the last logged step; Tune only the last checkpoint step.
        value = child.data.metrics.get(key) if child else None
        row[key] = value if value is not None else trial.get("metrics", {}).get(key, math.nan)
    row["mlflow_run_id"] = child.info.run_id if child else None
    return row


def _best(trials: Any, cfg: SweepSpec) -> Any:
    """The best completed trial by `metric`: a trial stopped early is judged at an earlier step."""
    pool = trials[(trials["status"] == "completed") & trials[cfg.metric].notna()]
    if pool.empty:
        return None
    i = pool[cfg.metric].idxmin() if cfg.mode == "min" else pool[cfg.metric].idxmax()
    return pool.loc[i]


def _children(client: MlflowClient, base: JobSpec, parent: str) -> dict[str, Any]:
    """trial index -> its MLflow child run (the newest, should a trial have more than one)."""
    exp = client.get_experiment_by_name(base.tracking.experiment)
    if exp is None:
        return {}
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent}'",
                              order_by=["attributes.start_time ASC"], max_results=10_000)
    return {r.data.tags.get("tidal.trial", ""): r for r in runs}


# --- small helpers ------------------------------------------------------------------------
def _get(spec: JobSpec, dotted: str) -> Any:
    return spec.flat().get(dotted)


def _resources(r: dict[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in r.items())


__all__ = ["SweepResult", "sweep", "trial_spec"]
