"""What `tidal run` prints of the lines Ray forwards to its driver (tidal/tracking/quiet.py): Tidal's
own lines from a worker plainly, without Ray's `(RayTrainWorker pid=...)` prefix; the raylet's notice
of a dead worker dropped (Tidal's line says which rank failed and that it restarts); everything else
as Ray prints it, its origin kept; no colour codes when the console is not a terminal. Checked through
Ray's own driver-side printer, without starting Ray."""

from __future__ import annotations

import logging

import pytest

from tidal.tracking.quiet import (
    COLOR_ENV,
    colour_for,
    forwarded,
    print_forwarded,
    tidy_driver_console,
)

DIED = ("A worker died or was killed while executing a task by an unexpected system error. To troubleshoot the "
        "problem, check the logs for the dead worker. RayTask ID: ffff Worker ID: 01ab Node ID: 02cd")


@pytest.mark.parametrize("line, kind", [
    ("[tidal] resize: converted checkpoint_000000004 (1 MiB) for the new world size in 3.1 s", "tidal"),
    (DIED, "drop"),
    # A driver that connected to Ray itself (a notebook) on a cluster without a dashboard: the cleaner's
    # every-second warning, which reached the console of an in-process node-loss run 40-odd times.
    ("Failed to query Ray Train Controller actor state. State API may be temporarily unavailable. "
     "Continuing to monitor.", "drop"),
    # Ray Train's PreemptionWatcher on a drained node; Tidal's line says the warning and the emergency save.
    ("PreemptionWatcher: preemption detected \u2014 preempted_node_ids=['90bf'], preempted_ranks=[0], "
     "deadline_ms=1795866498070", "drop"),
    ("PreemptionWatcher poll failed", "ray"),
    # Ray Train's cleaner where two Ray instances run on the machine: every second, in an in-process elastic run.
    ("Found multiple active Ray instances: {'192.0.2.2:46867', '192.0.2.2:40857'}. Connecting to latest cluster at "
     "192.0.2.2:46867. You can override this by setting the `--address` flag or `RAY_ADDRESS` environment variable.",
     "drop"),
    ("Resharding: converting global_step4 of checkpoint_000000004 (4 files, 1 MiB) to universal form", "drop"),
    # The controller's C++ core worker on Ray's own PreemptionWatcher (ray#53727; nothing fails), which a
    # driver with Ray's deduplication off (RAY_DEDUP_LOGS=0) got with no skip pattern applied.
    ("[2026-11-28 07:47:47,404 E 14832 14868] core_worker.cc:2465: Actor with class name: 'PreemptionWatcher' and "
     "ID: 'bac9fc' has constructor arguments in the object store and max_restarts > 0.", "drop"),
    ("[2026-11-28 07:47:47,404 E 14832 14868] core_worker.cc:2465: Actor with class name: 'Other' failed", "ray"),
    ("Traceback (most recent call last):", "ray"),
    ("RuntimeError: Connection closed by peer [127.0.0.1]:1234", "ray"),
    ("a user's print: [tidal] is not at the start", "ray"),
])
def test_each_forwarded_line_is_tidals_known_chatter_or_rays(line, kind):
    assert forwarded(line) == kind


def test_the_printer_keeps_the_order_and_passes_ray_only_its_own_lines():
    calls: list[tuple[str, list[str]]] = []
    printed: list[str] = []

    class File:
        def write(self, text: str) -> None:
            printed.append(text)

        def flush(self) -> None:
            pass

    def ray_print(data, print_file, ignore_prefix=False):
        calls.append((data["pid"], list(data["lines"])))
        printed.append(f"<ray {data['lines']}>")

    lines = ["Traceback (most recent call last):", "[tidal] resize: converted", DIED, "ValueError: real"]
    print_forwarded(ray_print)({"pid": 7, "lines": lines, "is_err": True}, File())
    assert calls == [(7, ["Traceback (most recent call last):"]), (7, ["ValueError: real"])]
    assert "".join(printed) == "<ray ['Traceback (most recent call last):']>[tidal] resize: converted\n<ray ['ValueError: real']>"


@pytest.mark.parametrize("env, terminal, expected", [
    ({}, False, "0"), ({}, True, None), ({COLOR_ENV: "1"}, False, None), ({COLOR_ENV: "0"}, True, None),
])
def test_colour_codes_only_on_a_terminal_unless_the_user_chose(env, terminal, expected):
    assert colour_for(env, terminal) == expected


def test_rays_own_printer_shows_tidal_lines_plainly_drops_the_chatter_and_keeps_real_errors(monkeypatch, capsys):
    from ray._private import worker

    monkeypatch.delenv("TIDAL_DEBUG", raising=False)
    monkeypatch.delenv(COLOR_ENV, raising=False)
    tidy_driver_console()  # pytest's captured stdout is not a terminal

    def forward(lines: list[str], pid: object = 4242, is_err: bool = False) -> str:
        worker.print_to_stdstream({"lines": lines, "pid": pid, "actor_name": "RayTrainWorker", "is_err": is_err,
                                   "ip": "127.0.0.1", "localhost": "127.0.0.1"}, ignore_prefix=False)
        out = capsys.readouterr()
        return out.out + out.err

    out = forward(["[tidal] resize: converted checkpoint_000000004 (1 MiB) for the new world size in 3.1 s"])
    assert out == "[tidal] resize: converted checkpoint_000000004 (1 MiB) for the new world size in 3.1 s\n"
    assert forward([DIED], pid="raylet") == ""
    real = forward(["RuntimeError: a real error, with its origin"], is_err=True)
    assert real.startswith("(RayTrainWorker pid=4242) RuntimeError: a real error") and "\x1b[" not in real
    # Ray's deduplication colours its " [repeated 2x across cluster]" whatever RAY_COLOR_PREFIX says
    repeated = forward(["RuntimeError: twice\x1b[32m [repeated 2x across cluster]\x1b[0m"], is_err=True)
    assert repeated == "(RayTrainWorker pid=4242) RuntimeError: twice [repeated 2x across cluster]\n"

    monkeypatch.setenv("TIDAL_DEBUG", "1")  # everything as Ray prints it
    assert forward([DIED], pid="raylet").startswith("(raylet) A worker died")
    assert forward(["[tidal] a line"]).startswith("(RayTrainWorker pid=4242) [tidal] a line")


def _records(logger_name: str, emit) -> list[logging.LogRecord]:
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    logger = logging.getLogger(logger_name)
    handler = Keep()
    logger.addHandler(handler)
    try:
        emit(logger)
    finally:
        logger.removeHandler(handler)
    return seen


@pytest.mark.parametrize("how", ["setup hook", "callback"])
def test_ray_trains_controller_says_a_dead_workers_restart_once_and_tidal_says_why(monkeypatch, tmp_path, how):
    """What the controller logs on every restart after a worker died (Tidal's line names the rank and
    the restart), and its coordinator's late answer under load, one line without a traceback. Lowered
    by the setup hook when Tidal connected to Ray, and by Tidal's callback as the controller unpickles
    it when the driver connected itself (a notebook), which installs no hook."""
    import pickle

    from tests.conftest import tiny_spec
    from tidal.launch.callbacks import FailureNotifier
    from tidal.ray_private import TRAIN_AUTOSCALING_CLIENT_LOGGER, TRAIN_BACKEND_SETUP_LOGGER
    from tidal.tracking.quiet import quiet_placement_group_cleaner

    monkeypatch.delenv("TIDAL_DEBUG", raising=False)
    names = (TRAIN_BACKEND_SETUP_LOGGER, TRAIN_AUTOSCALING_CLIENT_LOGGER)
    saved = {n: list(logging.getLogger(n).filters) for n in names}
    try:
        for n in names:
            logging.getLogger(n).filters[:] = []
        if how == "setup hook":
            quiet_placement_group_cleaner()
        else:  # what Ray does with the trainer's callbacks on the way to the controller
            assert pickle.loads(pickle.dumps(FailureNotifier(tiny_spec(tmp_path)))).name == "tiny"
        shutdown = _records(TRAIN_BACKEND_SETUP_LOGGER, lambda log: (
            log.warning("Graceful shutdown of backend failed. This is expected if one of the workers has crashed."),
            log.warning("a real problem")))
        assert [r.getMessage() for r in shutdown] == ["a real problem"]

        def late(log: logging.Logger) -> None:
            for _ in range(3):
                try:
                    raise TimeoutError("Get timed out: some object(s) not ready.")
                except TimeoutError:
                    log.warning("Failed to send resource request for train-1. ... safe to ignore", exc_info=True)

        requests = _records(TRAIN_AUTOSCALING_CLIENT_LOGGER, late)
        assert requests == [], "Ray's own line, with its (TrainController pid=...) prefix, never reaches the console"
    finally:
        for n, filters in saved.items():
            logging.getLogger(n).filters[:] = filters


def test_a_resource_request_that_keeps_failing_is_said_once_in_tidals_words():
    """Ray calls a late answer from its autoscaling coordinator harmless unless it persists: dropped,
    and one `[tidal]` line once it has lasted PERSISTS_S (a coordinator that never answers)."""
    from tidal.tracking.quiet import LateRequests

    now, said = [0.0], []
    late = LateRequests(persists_s=300.0, clock=lambda: now[0], say=said.append)
    record = logging.LogRecord("x", logging.WARNING, "f", 1, "Failed to send resource request for train-1.", None, None)
    other = logging.LogRecord("x", logging.WARNING, "f", 1, "something else", None, None)
    assert late.filter(other), "anything else is Ray's to print"
    for t in (0.0, 100.0, 200.0, 299.0):
        now[0] = t
        assert not late.filter(record)
    assert said == []
    for t in (301.0, 330.0, 400.0):
        now[0] = t
        assert not late.filter(record)
    assert len(said) == 1 and said[0].startswith("[tidal] WARNING: Ray Train could not send") and "5 min" in said[0]
    now[0] = 2000.0  # a new spell, long after: starts counting again
    assert not late.filter(record) and len(said) == 1


def test_tidals_own_info_notes_show_only_under_tidal_debug(monkeypatch):
    """In a Ray worker every line reaches the driver's console: Tidal's INFO notes (a checkpoint's
    files fetched, a conversion's stage) are for TIDAL_DEBUG=1."""
    from tidal.tracking.quiet import quiet_libraries

    tidal_log = logging.getLogger("tidal")
    before = tidal_log.level
    try:
        tidal_log.setLevel(logging.NOTSET)
        monkeypatch.setenv("TIDAL_DEBUG", "1")
        quiet_libraries()
        assert tidal_log.level == logging.NOTSET, "TIDAL_DEBUG=1: Tidal's notes as they are logged"
        monkeypatch.delenv("TIDAL_DEBUG")
        quiet_libraries()
        assert not tidal_log.isEnabledFor(logging.INFO) and tidal_log.isEnabledFor(logging.WARNING)
    finally:
        tidal_log.setLevel(before)


def _start_timeout(log: logging.Logger, workers: int = 2) -> None:
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError

    try:
        raise WorkerGroupStartupTimeoutError(workers)
    except WorkerGroupStartupTimeoutError as e:
        log.exception("Error in control loop iteration: %s", e)


def test_a_worker_group_that_did_not_start_in_time_is_one_tidal_line_a_minute(monkeypatch, tmp_path, capsys):
    """An elastic job's worker group start times out by design (tidal/launch/recovery.py: a short
    timeout, retried without limit, bounds a stale view of the nodes): Ray Train's controller logged
    each with its traceback (`Error in control loop iteration`), and a node-loss run's console had
    them. Tidal says it once a minute while it lasts; any other controller error keeps its traceback."""
    import pickle

    from tests.conftest import tiny_spec
    from tidal.launch.callbacks import FailureNotifier
    from tidal.ray_private import TRAIN_CONTROLLER_LOGGER
    from tidal.tracking.quiet import StartWaits

    monkeypatch.delenv("TIDAL_DEBUG", raising=False)
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "5")
    logger = logging.getLogger(TRAIN_CONTROLLER_LOGGER)
    saved = list(logger.filters)
    try:
        logger.filters[:] = []
        pickle.loads(pickle.dumps(FailureNotifier(tiny_spec(tmp_path))))  # as Ray hands it to the controller
        kept = _records(TRAIN_CONTROLLER_LOGGER, lambda log: (
            _start_timeout(log), _start_timeout(log), log.error("a real problem", exc_info=ValueError("x"))))
        assert [r.getMessage() for r in kept] == ["a real problem"] and kept[0].exc_info
        said = capsys.readouterr().out.splitlines()
        assert said == ["[tidal] waiting for workers: a group of 2 did not start within 5 s; Ray Train tries "
                        "again with the nodes it sees (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S sets the wait)"]
    finally:
        logger.filters[:] = saved

    now = [0.0]
    lines: list[str] = []
    waits = StartWaits(every_s=60.0, clock=lambda: now[0], say=lines.append)
    for t in (0.0, 5.0, 59.0, 60.0, 65.0, 121.0):
        now[0] = t
        assert not _records("tidal-test-start-waits", lambda log: (log.addFilter(waits), _start_timeout(log, 3)))
    assert len(lines) == 3 and "a group of 3" in lines[0], lines


# A rank's record when its peer was SIGKILLed mid-all_reduce (torch 2.13's gloo, captured on this machine),
# as Ray Train logs it in that rank: "Error in training function:" and the traceback, first frames cut.
SURVIVOR = """Error in training function:
Traceback (most recent call last):
  File "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83, in wrapper
    return func(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^^^^
  File "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3252, in all_reduce
    work.wait()
RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer \
[127.0.0.1]:6847. This is typically caused by a remote worker crashing. Check the logs of the remote worker before \
reporting an error. GLHF! \U0001f3d6\ufe0f
"""
# The same collective's error, then another in a `finally` that ran one more collective (or a wrapper that
# re-raised): the last exception does not name the peer.
CHAINED = SURVIVOR.rstrip() + """

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/work/wt/platform/tidal/worker/loop.py", line 60, in train_loop
    s.events.drain()
RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:218] Read error \
[127.0.0.1]:6847: Connection reset by peer
During the above, the barrier of rank 0 was aborted
"""
USERS = """Error in training function:
Traceback (most recent call last):
  File "/job/model.py", line 3, in forward
    raise ValueError("Connection closed by peer is not a shape")  # a frame's code line: not an error line
ValueError: bad head
"""


def test_a_survivors_traceback_for_a_lost_peer_is_dropped_unless_tidal_debug(monkeypatch):
    """The rank whose peer was killed mid-collective: its traceback, behind Ray's `(RayTrainWorker pid=...)`
    prefix, beside Tidal's own `worker rank N failed` line, is dropped where Ray logs it, whichever of its
    exceptions names the lost peer; a traceback that names none is the failure's report and stays."""
    from tidal.ray_private import TRAIN_USER_ERROR_LOGGER
    from tidal.tracking.quiet import quiet_libraries

    def says(message: str) -> list[str]:
        return [r.getMessage() for r in _records(TRAIN_USER_ERROR_LOGGER, lambda log: log.error(message))]

    saved = list(logging.getLogger(TRAIN_USER_ERROR_LOGGER).filters)
    try:
        logging.getLogger(TRAIN_USER_ERROR_LOGGER).filters[:] = []
        monkeypatch.setenv("TIDAL_DEBUG", "1")
        quiet_libraries()
        assert says(SURVIVOR) == [SURVIVOR] and says(CHAINED) == [CHAINED], "TIDAL_DEBUG=1: as Ray logs it"
        monkeypatch.delenv("TIDAL_DEBUG")
        quiet_libraries()
        assert says(SURVIVOR) == [] and says(CHAINED) == []
        assert says(USERS) == [USERS]
    finally:
        logging.getLogger(TRAIN_USER_ERROR_LOGGER).filters[:] = saved


def test_a_rank_whose_peer_died_says_so_in_tidals_words():
    """gloo's error names a socket and ends "GLHF!": the console line says the rank lost a peer instead
    (seen after a worker was killed: `worker rank 0 failed: [.../pair.cc:537] Read error ... GLHF! 🏖️`)."""
    from tidal.launch.callbacks import failure_line

    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                        "[127.0.0.1]:58002: Connection reset by peer. This is typically caused by a remote worker "
                        "hanging or bugs in the application. Check the logs of the remote worker before reporting "
                        "an error. GLHF! 🏖️")
    line = failure_line(gloo)
    assert line.startswith("its collective lost a peer (Connection reset by peer)") and "GLHF" not in line
    assert failure_line(ValueError("first\nthe last line")) == "the last line"
    assert failure_line(KeyError()) == "KeyError"


def test_the_failure_ray_gives_up_on_says_so_instead_of_announcing_a_restart(tmp_path, mlflow_uri, capsys):
    """failure.max_restarts 1: the first failure is restart 1; the second ends the job, and its line
    must not promise a restart Ray Train will not make."""
    from tests.ledger_fakes import Server, ledger, setup
    from tidal.launch.callbacks import FailureNotifier
    from tidal.tracking.console import Console

    spec, run, _ = setup(tmp_path, mlflow_uri, name="gives-up", **{"failure.max_restarts": 1})
    notifier = FailureNotifier(spec)
    for _ in range(2):
        notifier.after_exception(None, {0: RuntimeError("CUDA error: an illegal memory access was encountered")})
    capsys.readouterr()
    tracker = ledger(spec, run, Server(spec), None)
    tracker.subscribers.append(Console(spec.train.steps, max_restarts=spec.failure.max_restarts))
    tracker.poll()
    lines = [x for x in capsys.readouterr().out.splitlines() if "restart" in x or "gives up" in x]
    assert lines[0].startswith("[tidal] restart 1: restarting the worker group"), lines
    assert "restart 2" not in "\n".join(lines) and "restarting" not in lines[-1], lines
    assert lines[-1] == ("[tidal] the worker group failed again after 1 restart(s) (failure.max_restarts 1): "
                         "Ray Train gives up on it"), lines
    assert tracker.counters["restarts"] == 1, "the failure that ends the job is no restart"


def test_a_preempted_workers_failure_is_not_charged_to_max_restarts(tmp_path, mlflow_uri, capsys):
    """Ray Train charges a worker death its node's preemption caused to max_preemption_failures (no
    limit), not max_failures: after such a death the group still restarts, so it is no 'gives up'."""
    from ray.exceptions import RayActorError

    from tests.ledger_fakes import Server, ledger, setup
    from tidal.launch.callbacks import FailureNotifier
    from tidal.tracking.console import Console

    class HealthCheckFailed(RuntimeError):  # Ray Train's WorkerHealthCheckFailedError, as its poll wraps a death
        def __init__(self, failure: Exception) -> None:
            super().__init__("worker health check failed")
            self.health_check_failure = failure

    spec, run, _ = setup(tmp_path, mlflow_uri, name="preempted", **{"failure.max_restarts": 1})
    notifier = FailureNotifier(spec)
    for _ in range(2):
        notifier.after_exception(None, {0: HealthCheckFailed(RayActorError(error_msg="node preempted", preempted=True))})
    capsys.readouterr()
    tracker = ledger(spec, run, Server(spec), None)
    tracker.subscribers.append(Console(spec.train.steps))
    tracker.poll()
    lines = [x for x in capsys.readouterr().out.splitlines() if "restart" in x or "gives up" in x]
    assert not any("gives up" in x for x in lines), lines
    assert tracker.counters["restarts"] == 2, "both preemptions restarted the group"


# What Ray 2.60 holds for a Ray Train worker whose process was SIGKILLed (captured on this machine: an
# actor that killed itself with SIGKILL; SIGSEGV gives the same text).
KILLED = """The actor died unexpectedly before finishing this task.
\tclass_name: RayTrainWorker
\tactor_id: 3b3016b3fc6a56e138e0514401000000
\tpid: 15154
\tnamespace: 45ac4ad9-a232-478f-980a-d802b543fc6f
\tip: 192.0.2.2
The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: Worker \
unexpectedly exits with a connection error code 2. End of file. Some common causes include: (1) the process was killed \
by the OOM killer due to high memory usage, (2) ray stop --force was called, or (3) the worker crashed unexpectedly due \
to SIGSEGV or another unexpected error. If the process was killed by the kernel OOM killer (verifiable by checking for \
OOM in dmesg of the OOMing node), consider enabling resource isolation via --enable-resource-isolation to prevent node \
deaths by resource contention and significant loss of progress by uninformed kernel OOM killing."""


def test_a_worker_killed_by_a_signal_is_said_as_what_is_known_not_rays_oom_guess():
    from tidal.launch.callbacks import failure_line

    line = failure_line(RuntimeError(KILLED))
    assert line == ("its process (pid 15154 on node 192.0.2.2) died without a Python error: ended by a signal "
                    "(SIGKILL from a kill or the kernel's OOM killer, SIGSEGV from a crash; Ray does not report which)")
    assert "OOM killer due to high memory usage" not in line
