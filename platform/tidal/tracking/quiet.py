"""Known-harmless library chatter, lowered at its source so that Tidal's `[tidal]` lines and real
warnings and errors stand out. `TIDAL_DEBUG=1` leaves everything as the libraries print it.

Each entry says why it is harmless; anything not listed here is printed as before.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from tidal.errors import UserCodeError
from tidal.ray_private import (
    AUTH_TOKEN_SETUP_LOGGER,
    PLACEMENT_GROUP_CLEANER_LOGGER,
    START_TIMEOUT_ERROR,
    TRAIN_AUTOSCALING_CLIENT_LOGGER,
    TRAIN_BACKEND_SETUP_LOGGER,
    TRAIN_CONTEXT_MODULE,
    TRAIN_CONTROLLER_LOGGER,
    TRAIN_USER_ERROR_LOGGER,
    WORKER_GROUP_START_TIMEOUT,
    log_deduplicators,
    wrap_worker_log_printer,
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
    # Its checkpoint loader warns, on every rank of every resize, that it loads without model parallelism
    # ("MPU is not provided, setting tp size to 1"): Tidal's checkpoints never have any.
    _drop("DeepSpeed", "Setting accelerator to CPU", "Attempting to get learning rate from scheduler before it has started",
          "MPU is not provided, setting tp size to 1")
    # DeepSpeed wraps the optimizer, so torch's check of the scheduler/optimizer call order
    # misfires; the engine steps the scheduler after its optimizer step.
    for message in (r"Seems like `optimizer\.step\(\)` has been overridden",
                    r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"):
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    # DeepSpeed's ZeRO calls torch's old all-gather and reduce-scatter names (ZeRO-3: every step);
    # the new ones do the same collectives.
    for old in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        warnings.filterwarnings("ignore", message=rf"`torch\.distributed\.{old}` is deprecated", category=FutureWarning)
    # Tidal's own progress notes (a checkpoint's files fetched, a conversion's stage) are INFO: in a
    # Ray worker every line reaches the driver's console, so they show only under TIDAL_DEBUG=1.
    tidal_log = logging.getLogger("tidal")
    if tidal_log.level == logging.NOTSET:
        tidal_log.setLevel(logging.WARNING)
    # MLflow logs at INFO when it creates a SQLite store's tables, the first time a job uses it;
    # botocore, on every worker that reaches S3, where it found the endpoint and the credentials.
    for name in ("mlflow.store.db.utils", "alembic.runtime.migration", "botocore"):
        logging.getLogger(name).setLevel(logging.WARNING)
    _quiet_ray_train_reports()
    errors = logging.getLogger(TRAIN_USER_ERROR_LOGGER)
    if not any(isinstance(f, PeerLost) for f in errors.filters):
        errors.addFilter(PeerLost())
    _add_once(errors, UserMistake)


def _add_once(logger: logging.Logger, kind: type[logging.Filter]) -> None:
    if not any(isinstance(f, kind) for f in logger.filters):
        logger.addFilter(kind())


# gloo's and NCCL's words for a collective whose peer's process or node went away.
PEER_LOST = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|remote process exited")


class PeerLost(logging.Filter):
    """Ray Train's "Error in training function:" and its traceback, from a rank whose collective failed
    because another rank's process or node went (killed, its node lost or preempted). The traceback is
    torch's and DeepSpeed's insides; Tidal's own line names the rank and the error, beside the rank
    that failed first (`worker rank 1 failed: RuntimeError: ... Connection closed by peer ...`, from
    the exception Ray Train hands the controller). Any other error keeps its traceback: it is that
    failure's report.

    The peer's loss is looked for in every exception of the traceback, not its last line only: the
    collective's error is often not the last one (a `finally` that runs another collective, a wrapper
    that re-raises, a message of several lines), and a rank whose first error was a lost peer failed
    because of that peer. Frame and code lines are indented; exception lines are not."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith("Error in training function"):
            return True
        return not any(PEER_LOST.search(line) for line in message.splitlines()[1:] if not line.startswith(" "))


class UserMistake(logging.Filter):
    """A user's mistake before the first step (tidal.errors.UserCodeError), or met again after a restart,
    which ends the job without a (further) restart (launch/recovery.py) and which the driver reports once, with the user's own frames: Ray
    Train's "Error in training function:" in each worker, its traceback through Tidal's insides, and
    its controller's "Error in control loop iteration" when Tidal's callback raises it to end the run.
    The worker's record carries no exception: Ray logs it while handling the error, so it is the one
    this thread handles now (if Ray stops logging it there, the record shows again, as before)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else sys.exc_info()[1]
        if not isinstance(error, UserCodeError):
            return True
        # A mistake after the first step is retried once (its worker's report stays); the controller's
        # record is of Tidal's callback ending the run, whichever it was (launch/recovery.not_retried).
        return not (error.first_step or record.getMessage().startswith("Error in control loop"))


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
    """Ray's worker_process_setup_hook (tidal.launch.connect), in every process of the job: Ray Train's
    controller lowered where Tidal's own lines say the same (`_quiet_train_controller`), and its
    PlacementGroupCleaner's warning. On a local instance Tidal starts without its dashboard, the
    cleaner asks the State API, which the dashboard serves, whether the controller is alive, and warns
    "Failed to query Ray Train Controller actor state" every second it cannot. The controller's
    driver is this instance's only job, and its placement groups end with it."""
    if debug():
        return
    logging.getLogger(PLACEMENT_GROUP_CLEANER_LOGGER).setLevel(logging.ERROR)
    _ask_this_cluster()
    _quiet_train_controller()


class LateRequests(logging.Filter):
    """Ray Train's controller could not send its resource request to the autoscaling coordinator in
    time ("Failed to send resource request for train-... safe to ignore", with a traceback): under
    load it happens now and then, and Ray calls it harmless unless it persists. Its record is
    dropped; a spell of them lasting `persists_s` (each within `gap_s` of the last) is said once, as
    a `[tidal]` line on this process's stdout, which the driver prints plainly (`forwarded`)."""

    FRAGMENT = "Failed to send resource request"

    def __init__(self, persists_s: float = 300.0, gap_s: float = 120.0, clock: Callable[[], float] = time.monotonic,
                 say: Callable[[str], None] = lambda line: print(line, flush=True)) -> None:
        super().__init__()
        self.persists_s, self.gap_s, self.clock, self.say = persists_s, gap_s, clock, say
        self.since: float | None = None
        self.last = 0.0
        self.said = False

    def filter(self, record: logging.LogRecord) -> bool:
        if self.FRAGMENT not in record.getMessage():
            return True
        now = self.clock()
        if self.since is None or now - self.last > self.gap_s:  # a new spell
            self.since, self.said = now, False
        self.last = now
        if not self.said and now - self.since >= self.persists_s:
            self.said = True
            self.say(f"{TIDAL_LINE}WARNING: Ray Train could not send its resource request to Ray's autoscaling "
                     f"coordinator for {(now - self.since) / 60:.0f} min: the cluster's autoscaler may not know what "
                     "this job asks for (TIDAL_DEBUG=1 shows Ray's own errors)")
        return False


def quiet_controller() -> None:
    """In Ray Train's controller, from Tidal's callback as it is unpickled there (launch/callbacks.py):
    what the setup hook does in that process, for a driver that connected to Ray itself (a notebook,
    `tidal.run` under an existing `ray.init`), which installs no hook. Idempotent; not under TIDAL_DEBUG=1."""
    if not debug():
        _quiet_train_controller()


def _quiet_train_controller() -> None:
    """Ray Train's controller (an actor of this job, so this hook runs in it) on a worker's death
    and under load. Tidal's own lines say which rank failed, why, and that the group restarts."""
    # "Graceful shutdown of backend failed. This is expected if one of the workers has crashed.",
    # with the dead worker's traceback: on every restart after a worker died.
    _drop(TRAIN_BACKEND_SETUP_LOGGER, "Graceful shutdown of backend failed")
    # "Failed to send resource request ... safe to ignore" when its coordinator answers late (a busy
    # machine): Ray says it is harmless unless it persists, so dropped, and said in Tidal's words once
    # it has persisted (LateRequests).
    target = logging.getLogger(TRAIN_AUTOSCALING_CLIENT_LOGGER)
    if not any(isinstance(f, LateRequests) for f in target.filters):
        target.addFilter(LateRequests())
    controller = logging.getLogger(TRAIN_CONTROLLER_LOGGER)
    if not any(isinstance(f, StartWaits) for f in controller.filters):
        controller.addFilter(StartWaits())
    _add_once(controller, UserMistake)


class StartWaits(logging.Filter):
    """A worker group that did not start within RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S: Ray Train's
    controller logs "Error in control loop iteration" with a traceback at each timeout and tries
    again. For an elastic job that is Tidal's design (5 s, tidal/launch/recovery.py: each retry sizes
    the group from the nodes then, bounding what a stale view of a lost node costs), and a fixed-size
    job waiting for an autoscaler's nodes retries the same way. So a `[tidal]` line, once a minute
    while it lasts (a job can wait for nodes a long time), printed to this process's stdout, which
    the driver prints plainly (`forwarded`); Ray's own record is dropped."""

    def __init__(self, every_s: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 say: Callable[[str], None] | None = None) -> None:
        super().__init__()
        self.every_s, self.clock = every_s, clock
        self.say = say or (lambda line: print(line, flush=True))
        self.last: float | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if type(error).__name__ != START_TIMEOUT_ERROR:
            return True
        now = self.clock()
        if self.last is None or now - self.last >= self.every_s:
            self.last = now
            self.say(start_wait_line(getattr(error, "num_workers", "?")))
        return False


def start_wait_line(workers: object) -> str:
    timeout = os.environ.get(WORKER_GROUP_START_TIMEOUT, "60")  # Ray's default
    with contextlib.suppress(ValueError):  # a filter must never raise into the controller's error path
        timeout = f"{float(timeout):g}"
    return (f"{TIDAL_LINE}waiting for workers: a group of {workers} did not start within {timeout} s; "
            f"Ray Train tries again with the nodes it sees ({WORKER_GROUP_START_TIMEOUT} sets the wait)")


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
    for dedup in log_deduplicators():
        current = dedup.skip_re.pattern if dedup.skip_re else None
        dedup.skip_re = re.compile(ray_skip_regex(current))


# --- what the driver prints of the lines Ray forwards to it ---------------------------------------

TIDAL_LINE = "[tidal] "
# Lines Ray forwards from a worker, an actor or a raylet that only restate what Tidal's own lines say;
# each says why. Everything else keeps Ray's forwarding, its origin prefix included (a real error).
FORWARDED_CHATTER = (
    # The raylet's notice of a worker process that died, with its ids and a pointer to its logs:
    # Tidal's own line names the rank that failed, why, and the restart (tracking/console.py).
    "A worker died or was killed while executing a task by an unexpected system error",
    # A resize's conversion progress, should a Tidal older or newer than worker/checkpoint/universal.py print it
    # (that module keeps it in the log unless TIDAL_DEBUG=1); `[tidal] resize: converted ...` says it.
    "Resharding: ",
    # Ray Train's PlacementGroupCleaner where the State API is not served (no dashboard): every second.
    # Its own logger is lowered in the job's processes by the setup hook (quiet_placement_group_cleaner),
    # which a driver that connected to Ray itself (a notebook, a test) does not install; the cleaner
    # goes on watching, and the controller's placement groups end with its job.
    "Failed to query Ray Train Controller actor state",
    # Ray Train's PreemptionWatcher when a node is drained (a spot reclaim): its node and rank ids. Tidal's
    # own line says it ("preemption warning: saving an emergency checkpoint at step N") and what follows.
    # Its "PreemptionWatcher poll failed" stays: that one is news.
    "PreemptionWatcher: preemption detected",
    # Ray's address lookup in an actor of the job (Ray Train's PlacementGroupCleaner) when several Ray
    # instances run on one machine (a `ray start` cluster beside a local instance, test clusters): it
    # names them all, once a second, and picks the newest for its State API queries. The job's own
    # cluster is the one Tidal's line named when it connected (launch/connect.py).
    "Found multiple active Ray instances",
)
COLOR_ENV = "RAY_COLOR_PREFIX"  # Ray's driver colours each forwarded line's origin unless it is "0"
# Colour codes inside a line: Ray's deduplication adds a green " [repeated 2x across cluster]" whatever
# RAY_COLOR_PREFIX says, and a library may colour its own messages.
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def forwarded(line: str) -> str:
    """What the driver does with one line Ray forwards to it: "tidal" (a Tidal line: printed as it is,
    without Ray's `(RayTrainWorker pid=...)` prefix), "drop" (known chatter), or "ray" (Ray prints it)."""
    if line.startswith(TIDAL_LINE):
        return "tidal"
    # KNOWN_RAY_ERRORS too: Ray's deduplicators apply RAY_DEDUP_LOGS_SKIP_REGEX, but not when a
    # driver turned deduplication off (RAY_DEDUP_LOGS=0), and not in a process that imported Ray first.
    if any(c in line for c in FORWARDED_CHATTER) or re.search(KNOWN_RAY_ERRORS, line):
        return "drop"
    return "ray"


def print_forwarded(ray_print: Callable[..., None], plain: bool = False) -> Callable[..., None]:
    """Ray's printer of forwarded lines, with `forwarded`'s decisions applied and the order kept;
    `plain`: without colour codes (a console that is not a terminal)."""
    def printer(data: dict[str, Any], print_file: TextIO, ignore_prefix: bool = False) -> None:
        # the autoscaler's lines are raw monitor output that Ray itself sorts out
        if debug() or data.get("pid") == "autoscaler":
            ray_print(data, print_file, ignore_prefix)
            return
        pending: list[str] = []
        for line in data.get("lines", []):
            line = ANSI.sub("", line) if plain else line
            kind = forwarded(line)
            if kind == "ray":
                pending.append(line)
                continue
            if pending:
                ray_print({**data, "lines": pending}, print_file, ignore_prefix)
                pending = []
            if kind == "tidal":
                print(line, file=print_file, flush=True)
        if pending:
            ray_print({**data, "lines": pending}, print_file, ignore_prefix)

    return printer


def colour_for(env: Mapping[str, str], terminal: bool) -> str | None:
    """The value for RAY_COLOR_PREFIX: "0" (no colour codes) when the console is not a terminal (a
    log file, a pipe, a Ray job's log), unless the user chose; None leaves it as it is."""
    return None if terminal or env.get(COLOR_ENV) else "0"


def _is_terminal() -> bool:
    return all(getattr(stream, "isatty", lambda: False)() for stream in (sys.stdout, sys.stderr))


def tidy_driver_console() -> None:
    """In the driver, once Ray is imported: Tidal's lines from workers print plainly, known chatter
    is dropped, and no colour codes go into a console that is not a terminal. TIDAL_DEBUG=1 leaves
    Ray's printing as it is."""
    if debug():
        return
    terminal = _is_terminal()
    colour = colour_for(os.environ, terminal)
    if colour is not None:
        os.environ[COLOR_ENV] = colour  # Ray reads it at every line it prints
    wrap_worker_log_printer(lambda ray_print: print_forwarded(ray_print, plain=not terminal))
