"""Known-harmless library chatter, lowered at its source so that Tidal's `[tidal]` lines and real
warnings and errors stand out. `TIDAL_DEBUG=1` leaves everything as the libraries print it.

Each entry says why it is harmless; anything not listed here is printed as before.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import warnings

from tidal.ray_private import (
    AUTH_TOKEN_SETUP_LOGGER,
    PLACEMENT_GROUP_CLEANER_LOGGER,
    TRAIN_CONTEXT_MODULE,
    log_deduplicators,
)

DEBUG_ENV = "TIDAL_DEBUG"


class _Drop(logging.Filter):
    def __init__(self, *fragments: str) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(f in message for f in self.fragments)


def _drop(logger: str, *fragments: str) -> None:
    """Drop `logger`'s records that contain any of `fragments`; once per process."""
    target = logging.getLogger(logger)
    if not any(isinstance(f, _Drop) for f in target.filters):
        target.addFilter(_Drop(*fragments))


def debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def quiet_libraries() -> None:
    """Lower the chatter in this process (a worker, the tracker or the driver); idempotent."""
    if debug():
        return
    # DeepSpeed warns in every process without CUDA that it picked its CPU accelerator: on CPU
    # workers that is Tidal's own choice (worker/device.py), and GPU workers never see it.
    # DeepSpeed's warmup schedules warn when the lr is read before their first step; the loop reads
    # it at the first log step of every launch, and the value it gets is the schedule's start.
    _drop("DeepSpeed", "Setting accelerator to CPU", "Attempting to get learning rate from scheduler before it has started")
    # DeepSpeed wraps the optimizer, so torch's check of the scheduler/optimizer call order
    # misfires; the engine steps the scheduler after its optimizer step.
    for message in (r"Seems like `optimizer\.step\(\)` has been overridden",
                    r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"):
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    # DeepSpeed's ZeRO calls torch's old all-gather name; the new one does the same collective.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                            category=FutureWarning)
    # MLflow logs at INFO when it creates a SQLite store's tables, the first time a job uses it.
    for name in ("mlflow.store.db.utils", "alembic.runtime.migration"):
        logging.getLogger(name).setLevel(logging.WARNING)
    _quiet_ray_train_reports()


def _quiet_ray_train_reports() -> None:
    """Ray Train logs `Reporting training result N: TrainingReport(...)` with the whole metrics dict
    from every rank at every checkpoint. Its logger is named by its file path (`getLogger(__file__)`
    in ray.train.v2._internal.execution.context), so `LoggingConfig(log_level=...)` never reaches it
    and no public API names it; Tidal prints its own checkpoint line instead."""
    if "ray.train" not in sys.modules:  # not a Ray Train process: nothing to lower (and keep `tidal --help` light)
        return
    spec = importlib.util.find_spec(TRAIN_CONTEXT_MODULE)
    if spec is not None and spec.origin:
        logging.getLogger(spec.origin).setLevel(logging.WARNING)


def quiet_placement_group_cleaner() -> None:
    """Ray's worker_process_setup_hook on a local instance Tidal starts without its dashboard
    (tidal.launch.trainer): Ray Train's PlacementGroupCleaner asks the State API, which the
    dashboard serves, whether the controller is alive, and warns "Failed to query Ray Train
    Controller actor state" every second it cannot. The controller's driver is this instance's
    only job, and its placement groups end with it."""
    if debug():
        return
    logging.getLogger(PLACEMENT_GROUP_CLEANER_LOGGER).setLevel(logging.ERROR)
    _ask_this_cluster()


def _ask_this_cluster() -> None:
    """The cleaner's State API call finds its cluster the way `ray.init("auto")` does: RAY_ADDRESS,
    else the latest cluster started on this machine, with a warning "Found multiple active Ray
    instances" every second when there are several (seen: a second job's local instance), and then
    it asks the wrong one, or fails for good ("Please specify the one to connect to") and stops
    watching. This worker belongs to exactly one cluster: name it."""
    import ray

    if ray.is_initialized():
        os.environ["RAY_ADDRESS"] = own_cluster(os.environ.get("RAY_ADDRESS"), ray.get_runtime_context().gcs_address)


def own_cluster(current: str | None, gcs_address: str) -> str:
    """RAY_ADDRESS for a worker process: its own cluster's GCS address, unless it already names an
    address. `local` and `auto` (inherited from the driver's environment: `RAY_ADDRESS=local tidal run`)
    make Ray search the machine for a cluster."""
    return gcs_address if current in (None, "", "local", "auto") else current


# Ray's C++ core worker logs an `E` line in every process that builds a PreemptionWatcher with
# the constructor arguments of another Ray version (ray#53727); nothing fails. Only that message:
# any other `E` line is still shown.
KNOWN_RAY_ERRORS = r"PreemptionWatcher.*constructor arguments"
SKIP_ENV = "RAY_DEDUP_LOGS_SKIP_REGEX"


def ray_skip_regex(current: str | None) -> str:
    """The value for RAY_DEDUP_LOGS_SKIP_REGEX: a user's own pattern kept, Tidal's added once."""
    if not current:
        return KNOWN_RAY_ERRORS
    if KNOWN_RAY_ERRORS in current:
        return current
    return f"(?:{current})|(?:{KNOWN_RAY_ERRORS})"


def skip_known_ray_errors() -> None:
    """Drop the known-harmless `E` line from what Ray forwards to this (the driver's) console, and
    Ray's notice that a local instance has token auth on.

    Ray's driver-side log printer drops every forwarded line matching RAY_DEDUP_LOGS_SKIP_REGEX, which
    Ray reads once, when `ray._private.ray_constants` is imported: set it before `import ray` (the CLI
    does, first thing). Ray applies it inside its log deduplication, so not under RAY_DEDUP_LOGS=0
    (Ray's default is on). A process that imported Ray already (a notebook) gets the pattern set on Ray's
    two deduplicators instead: checked against Ray 2.60's ray._private.ray_logging, and skipped if
    they are not there."""
    if debug():
        return
    # ray.init of a local instance (token auth on by Ray 2.60's default, which Tidal keeps) warns
    # that it is on and how to opt out; Tidal's clusters refuse RAY_AUTH_MODE=disabled. Its warning
    # that a cluster runs *without* auth is a real one and stays.
    _drop(AUTH_TOKEN_SETUP_LOGGER, "Token authentication is enabled for this Ray cluster")
    os.environ[SKIP_ENV] = ray_skip_regex(os.environ.get(SKIP_ENV))
    import re

    for dedup in log_deduplicators():
        current = dedup.skip_re.pattern if dedup.skip_re else None
        dedup.skip_re = re.compile(ray_skip_regex(current))
