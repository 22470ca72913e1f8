"""A job run for a test or benchmark: in the background (`run_in_background`), and its progress as MLflow and its run folder show it."""

from __future__ import annotations

import atexit
import functools
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

from tidal.spec.job import JobSpec
from tidal.storage import RunDir
from tidal.testing.processes import wait_for
from tidal.worker import hold

log = logging.getLogger(__name__)


def prepared_store(db: Path) -> str:
    """`sqlite:///<db>`, the file made a copy of an empty MLflow store unless it exists already.

    Creating an MLflow SQLite store runs its schema migrations: seconds of CPU on each new file
    (39 s of wall time measured on a loaded 2-core machine), paid by every test with a store of its
    own. The migrations run once per process, into a template, and each store starts as a copy of
    it: an up-to-date schema opens at once. Each test still has a store of its own."""
    if not db.exists():
        db.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_template(), db)
    return f"sqlite:///{db}"


@functools.cache
def _template() -> Path:
    """The migrated empty store: made once per MLflow version on this machine, in the user's cache
    folder as pip and pytest keep theirs (3-5 s of migrations on a 2-core machine, otherwise paid by
    every test session); in a temporary folder where that cannot be written."""
    import mlflow

    folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tidal-tests"
    kept = folder / f"mlflow-{mlflow.__version__}-empty.db"
    if kept.is_file():
        return kept
    try:
        folder.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(prefix=".building-", dir=folder))
    except OSError:
        building = Path(tempfile.mkdtemp(prefix="tidal-mlflow-template-"))
        kept = building / "mlflow.db"
        atexit.register(shutil.rmtree, building, True)
    db = building / "mlflow.db"
    MlflowClient(f"sqlite:///{db}").search_experiments()  # creates and migrates the store
    if db != kept:
        os.replace(db, kept)  # whole or not at all, for a session starting beside this one
        shutil.rmtree(building, ignore_errors=True)
    return kept


def job_run_id(spec: JobSpec, timeout: float = 120) -> str:
    """The MLflow run id a running job recorded in its run folder (local or object storage)."""
    run = RunDir(spec.checkpoint.storage, spec.name)

    def recorded() -> str | None:
        job = run.read_json("tidal-job.json")
        return job.get("mlflow_run_id") if job else None

    return wait_for(f"{run.path}/tidal-job.json", recorded, timeout, every=0.1)


def wait_for_step(spec: JobSpec, step: int, timeout: float = 180) -> int:
    """Block until MLflow shows `step` logged for the job; returns the highest step seen."""
    run_id = job_run_id(spec, timeout)
    client = MlflowClient(spec.tracking.uri)

    def reached() -> int:
        try:
            seen = max((m.step for m in client.get_metric_history(run_id, "loss")), default=0)
        except Exception as e:  # noqa: BLE001 - the store may be mid-creation (SQLAlchemy's errors too): ask again
            log.debug("metric history not readable yet: %s", e)
            return 0
        return seen if seen >= step else 0

    # each look reads the whole loss history while the workers hold both cores: every 0.2 s
    return wait_for(f"job {spec.name} to reach step {step}", reached, timeout)


class StepHolds:
    """A job's rank 0 held after each of `steps` (tidal.worker.hold) until the test lets it go: a
    fault injected while it holds lands after that step, however fast the machine trains (a wait
    on MLflow lands some steps later). Run `spec(job)`, then `wait(step)`, act, `release(step)`."""

    def __init__(self, *steps: int) -> None:
        self.steps = steps
        self.base = str(Path(tempfile.mkdtemp(prefix="tidal-hold-")) / "held")

    def spec(self, spec: JobSpec) -> JobSpec:
        steps = ",".join(map(str, self.steps))
        return spec.with_overrides({"worker_env": {**spec.worker_env, hold.HOLD_ENV: f"{steps}@{self.base}"}})

    def wait(self, step: int, timeout: float = 600) -> None:
        wait_for(f"rank 0 to hold after step {step}", lambda: os.path.exists(hold.marked(self.base, step)),
                 timeout, every=0.05)

    def release(self, step: int) -> None:
        Path(hold.released(self.base, step)).touch()

    def pid(self, step: int, timeout: float = 10) -> int:
        """The process of rank 0 that holds after `step` (its marker is created, then its pid written)."""
        return wait_for(f"rank 0's pid after step {step}",
                        lambda: int(text) if (text := Path(hold.marked(self.base, step)).read_text()) else None,
                        timeout, every=0.02)


def wait_for_world_size(spec: JobSpec, size: int, timeout: float = 180) -> None:
    """Block until the job's latest logged `world_size` is `size` (an elastic group shrunk or grown)."""
    run_id = job_run_id(spec, timeout)
    client = MlflowClient(spec.tracking.uri)

    def at_size() -> bool:
        hist = client.get_metric_history(run_id, "world_size")
        return bool(hist) and max(hist, key=lambda m: m.step).value == size

    wait_for(f"job {spec.name} at world size {size}", at_size, timeout)


def metric_history(spec: JobSpec, run_id: str, key: str) -> dict[int, float]:
    """step -> value; fails (AssertionError) if any step was logged twice."""
    hist = MlflowClient(spec.tracking.uri).get_metric_history(run_id, key)
    steps = [m.step for m in hist]
    if len(steps) != len(set(steps)):
        raise AssertionError(f"{key}: steps logged more than once: {sorted(steps)}")
    return {m.step: m.value for m in hist}


def run_in_background(spec: JobSpec) -> tuple[threading.Thread, dict[str, Any]]:
    """`tidal.run(spec)` in a daemon thread: its result (or its error) and its wall time (`wall_s`) land
    in the returned dict. The caller's thread stays free for what only a main thread may do, such as
    `Cluster.add_node` (it sets a signal handler)."""
    import tidal  # the SDK imports Ray: only the callers that run a job pay for it

    out: dict[str, Any] = {}

    def target() -> None:
        t0 = time.time()
        try:
            out["result"] = tidal.run(spec)
        except BaseException as e:  # noqa: BLE001 - raised again by `finished`, in the caller's thread
            out["error"] = e
        out["wall_s"] = time.time() - t0

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, out


def finished(t: threading.Thread, out: dict[str, Any], timeout: float | None = 400) -> Any:
    """The result of a `run_in_background` job once its thread ends, or the error it raised."""
    t.join(timeout)
    assert not t.is_alive(), "job did not finish"
    if "error" in out:
        raise out["error"]
    return out["result"]
