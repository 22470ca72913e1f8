"""A sweep's state as data: every trial's values and outcome, in JSON beside Tune's folder
(`<checkpoint.storage>/<name>-sweep/tidal-sweep.json`). A resumed sweep rebuilds its Tuner from it.

Why not `Tuner.restore`: it unpickles `tuner.pkl` (and the searcher's and trials' state) from the
sweep's folder, so whoever can write to the storage would run code in the sweep's driver at the
next resume (docs/security.md). JSON runs nothing, and what it holds is checked before use: the
values of each trial must be ones the sweep's own distributions can give (`check_values`), so a
rewritten file can change which of those values a trial trains with, never which code runs.

- **Every trial is planned up front**: `plan_trials` draws the values as Tune's
  BasicVariantGenerator would (its `generate_variants`, seeded by `sweep.seed`), and the Tuner
  sweeps the trial numbers (`grid_search`); trial N is the job `<name>-tN` with values `trials[N]`.
- **Outcomes are recorded as they happen** (`Recorder`, a Tune callback in the driver): running,
  then completed, stopped_early (ASHA) or failed, with the last step and metrics Tune saw.
- **Resume** runs the trials not completed or stopped early; each one's `run()` resumes from its
  own latest checkpoint. ASHA compares the resumed trials among themselves (its rungs from the
  interrupted launch are not kept: a trial it stopped stays stopped).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ray import tune

from tidal.errors import TidalError
from tidal.spec.sweep import Param
from tidal.storage import RunDir

SWEEP_FILE = "tidal-sweep.json"
FINISHED = ("completed", "stopped_early")  # never run again on resume
TRIAL_KEY = "trial"  # the one value Tune sweeps: the trial's number in the plan


@dataclass
class SweepState:
    """What `tidal-sweep.json` holds."""

    parent_run_id: str
    fingerprint: str
    trials: list[dict[str, Any]] = field(default_factory=list)  # {"values", "status", "step", "metrics"}
    tidal_version: str = ""

    def todo(self) -> list[int]:
        return [i for i, t in enumerate(self.trials) if t["status"] not in FINISHED]

    def as_json(self) -> dict[str, Any]:
        return {"parent_run_id": self.parent_run_id, "fingerprint": self.fingerprint, "tidal_version": self.tidal_version,
                "trials": self.trials}


def new_trials(plan: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"values": values, "status": "pending", "step": None, "metrics": {}} for values in plan]


def domain(p: Param) -> Any:
    if p.kind == "choice":
        return tune.choice(list(p.values))
    if p.kind == "grid":
        return tune.grid_search(list(p.values))
    if p.kind == "uniform":
        return tune.uniform(p.low, p.high)
    if p.kind == "loguniform":
        return tune.loguniform(p.low, p.high)
    return tune.randint(p.low, p.high)


def plan_trials(params: dict[str, Param], samples: int, seed: int | None) -> list[dict[str, Any]]:
    """Every trial's values, drawn as Tune's BasicVariantGenerator draws them: `samples` passes over
    the grid, random values from one seeded generator."""
    import numpy as np
    from ray.tune.search.variant_generator import generate_variants

    space = {k: domain(p) for k, p in params.items()}
    rng = np.random.RandomState(seed)
    plan = []
    for _ in range(samples):
        for _, resolved in generate_variants(space, random_state=rng):
            plan.append({k: _plain(resolved[k]) for k in params})
    return plan


def _plain(value: Any) -> Any:
    """numpy scalars as Python's own (JSON, and pydantic's strict fields)."""
    return value.item() if hasattr(value, "item") else value


def check_values(values: Any, params: dict[str, Param]) -> str | None:
    """What is wrong with one trial's values read back from storage, or None: exactly the swept
    fields, each a value its distribution can give."""
    if not isinstance(values, dict) or set(values) != set(params):
        return f"its fields {sorted(values) if isinstance(values, dict) else values!r} are not the swept ones {sorted(params)}"
    for key, p in params.items():
        v = values[key]
        if p.kind in ("choice", "grid"):
            ok = any(v == allowed and type(v) is type(allowed) for allowed in p.values)
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            ok = False
        elif p.kind == "randint":
            ok = isinstance(v, int) and p.low <= v < p.high  # type: ignore[operator]
        else:
            ok = p.low <= v <= p.high  # type: ignore[operator]
        if not ok:
            return f"{key}={v!r} is not a value of {p.expression()}"
    return None


def read_state(folder: RunDir, params: dict[str, Param]) -> SweepState | None:
    """The sweep's state, or None when it has none; TidalError when it cannot be trusted."""
    data = folder.read_json(SWEEP_FILE)
    if not data:
        return None
    where = f"{folder.path}/{SWEEP_FILE}"
    trials = data.get("trials")
    if not isinstance(trials, list) or not trials:
        raise TidalError(f"{where} holds no trial plan: the sweep was started by an earlier Tidal, whose resume "
                         "unpickled Tune's state from storage (no longer done: docs/security.md). Start it over with "
                         "--restart (restart=True); its old trials are set aside, not deleted.")
    for i, t in enumerate(trials):
        problem = check_values(t.get("values") if isinstance(t, dict) else None, params)
        if problem is None and t.get("status") not in ("pending", "running", "failed", *FINISHED):
            problem = f"status {t.get('status')!r} is unknown"
        if problem:
            raise TidalError(f"{where}: trial {i} cannot be resumed: {problem}. The file was changed by someone "
                             "else or is damaged; start the sweep over with --restart (restart=True).")
    return SweepState(str(data.get("parent_run_id") or ""), str(data.get("fingerprint") or ""), trials,
                      str(data.get("tidal_version") or ""))


def outcome(last_result: dict[str, Any], last_step: int) -> str:
    """completed or stopped_early for a trial Tune ended without error."""
    step = last_result.get("step")
    if step is None or int(step) >= last_step or last_result.get("early_stopped"):
        return "completed"  # to the end (a job already complete reports nothing), or its own eval.patience
    return "stopped_early"  # ASHA ended it at a checkpoint step


class Recorder(tune.Callback):
    """Writes each trial's outcome to the sweep's state as Tune reports it (in the driver)."""

    def __init__(self, folder: RunDir, state: SweepState, last_step: int) -> None:
        self.folder, self.state, self.last_step = folder, state, last_step

    def _set(self, trial: Any, status: str) -> None:
        rec = self.state.trials[int(trial.config[TRIAL_KEY])]
        last = trial.last_result or {}
        rec["status"] = status
        if last.get("step") is not None:
            rec["step"] = int(last["step"])
        rec["metrics"] = {k: float(v) for k, v in last.items()
                          if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "trial_id")}
        self.folder.write_json(SWEEP_FILE, self.state.as_json())

    def on_trial_start(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._set(trial, "running")

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._set(trial, outcome(trial.last_result or {}, self.last_step))

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._set(trial, "failed")
