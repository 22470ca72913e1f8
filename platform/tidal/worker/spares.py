"""Warm spares: idle Ray worker processes of this job, per node, with torch imported, that a restarted group's actors take instead of starting (and importing) new ones.

Two halves, in two kinds of process:
- `setup_worker`, the job's `worker_process_setup_hook` (tidal/launch/connect.py), runs in every
  worker process of the job. A process that is still idle `IDLE_WAIT_S` after it started is a spare
  (Ray hands a new process its actor or task within moments): it imports `PRELOAD` in a background
  thread. The job's actors (controller, tracker, keepers) never import torch this way.
- `Spares`, in each Ray Train worker: on each node's local rank 0, after the group's first step,
  tops the node's spares up to `wanted` through the raylet's PrestartWorkers (tidal/ray_private.py),
  with this worker's exact runtime-env string and job id, the two things an actor must share with an
  idle process to take it. After the first step, so that the spares' imports never slow a start.

Nothing preloaded initialises CUDA (`torch` and `torch._dynamo` do not; `deepspeed` would, probing
the accelerator before Ray sets CUDA_VISIBLE_DEVICES): the device is still chosen in
tidal/worker/device.py, once the process is a worker.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass

PRELOAD = ("torch", "torch._dynamo")
IDLE_WAIT_S = 2.0
# Spares live as long as the job (Ray ends a job's idle workers with it); the raylet's own limit on
# idle workers would otherwise end them within a second.
KEEP_ALIVE_S = 24 * 3600
IDLE_TITLE = "ray::IDLE"
WORKER_MAIN = "default_worker.py"  # the script every Ray Python worker process runs
TRACE_ENV = "TIDAL_SPARES_TRACE"  # tests and benchmarks: a file each worker appends how it started to

_preloaded_at: float | None = None  # when this process finished importing PRELOAD as a spare
_train_start: tuple[float, bool] | None = None  # when the train function began; torch imported by then


# Actors Ray Train 2.60 starts with every worker group, with the workers' runtime env, each in an
# idle process of the job like any actor: its SynchronizationActor, DatasetManager and PreemptionWatcher
# (seen on a local instance: three such processes per group, beside the two workers).
GROUP_ACTORS = 3


def wanted(local_workers: int, setting: int | None, idle_cpus: float = 1.0) -> int:
    """Spares a node keeps: `setting` (failure.warm_spares) if given; else one per Train worker on
    the node, which a full restart replaces all at once, and one per actor Ray Train starts with
    each group (GROUP_ACTORS): whichever of them starts first takes a spare, and a worker must
    still find one. By default none where the job's workers already take every CPU of the node
    (`idle_cpus` < 1, a laptop's quickstart): each spare's imports cost about 3 s of CPU, which there
    come out of training (measured: the quickstart 27.5 s -> 36.5 s to its end on 2 cores)."""
    if setting is not None:
        return setting
    return local_workers + GROUP_ACTORS if idle_cpus >= 1.0 else 0


def to_start(want: int, idle: int) -> int:
    """Processes to prestart: what is missing; never a negative count (spares left unused stay)."""
    return max(0, want - idle)


def setup_worker() -> None:
    """The job's worker_process_setup_hook: Tidal's console hook, then a spare's preload."""
    from tidal.tracking.quiet import quiet_placement_group_cleaner

    quiet_placement_group_cleaner()
    if not sys.argv[0].endswith(WORKER_MAIN):
        return  # Ray runs the hook in a driver too: a driver is never a spare
    threading.Thread(target=_preload_if_idle, name="tidal-spare-preload", daemon=True).start()


def _preload_if_idle() -> None:
    time.sleep(IDLE_WAIT_S)
    import ray

    if ray.get_runtime_context().get_actor_id() is not None:
        return  # an actor of the job: it imports what it needs itself
    for name in PRELOAD:
        importlib.import_module(name)
    global _preloaded_at
    _preloaded_at = time.time()


@dataclass(frozen=True)
class Start:
    """How a Train worker's process started: a warm spare or a fresh process."""

    pid: int
    process_started: float  # epoch s
    preloaded_at: float | None  # when it imported PRELOAD as a spare; None: not a spare
    train_started: float
    torch_before: bool  # torch and torch._dynamo imported when the train function began

    @property
    def warm(self) -> bool:
        return self.preloaded_at is not None and self.torch_before


def note_train_start() -> None:
    """Called first thing in the train function (tidal.worker.train_loop), before it imports anything."""
    global _train_start
    _train_start = (time.time(), torch_imported())


def this_start() -> Start:
    import psutil

    pid = os.getpid()
    began, torch_before = _train_start or (time.time(), False)
    return Start(pid, psutil.Process(pid).create_time(), _preloaded_at, began, torch_before)


class Spares:
    """One Train worker's part: note how it started; on local rank 0, refill the node's spares once."""

    def __init__(self, setting: int | None, cpus_per_worker: float = 1.0) -> None:
        self.setting, self.cpus_per_worker = setting, cpus_per_worker
        self.start = this_start()
        self.asked = setting == 0
        _trace({**asdict(self.start), "warm": self.start.warm})

    def after_step(self) -> None:
        """After the group's first step, local rank 0 tops its node up, in the background."""
        if self.asked:
            return
        self.asked = True
        import ray.train

        ctx = ray.train.get_context()
        if ctx.get_local_rank() == 0:
            threading.Thread(target=self._refill, args=(ctx.get_local_world_size(),), name="tidal-spares",
                             daemon=True).start()

    def _refill(self, local: int) -> None:
        """Off the training thread: node_cpus asks Ray's control store, which may be slow or down."""
        try:
            if want := wanted(local, self.setting, node_cpus() - local * self.cpus_per_worker):
                refill(want)
        except Exception as e:  # noqa: BLE001 - no spares is today's behaviour, never a failed job
            print(f"[tidal] could not keep warm spares on this node ({type(e).__name__}: {e}); a restart starts "
                  "new processes", file=sys.stderr, flush=True)


def node_cpus() -> float:
    """This node's logical CPUs, as Ray counts them."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    return float(next(x for x in ray.nodes() if x["NodeID"] == node)["Resources"].get("CPU", 0.0))


def refill(want: int, patience_s: float = 120.0, ask_every_s: float = 10.0) -> int:
    """Prestart what this node lacks of `want` spares; the number that came up. The raylet starts at
    most its startup concurrency per request (2 on a 2-CPU node) and drops what it cannot start
    then, so this asks again for what is still missing every `ask_every_s` until the node has
    `want` or `patience_s` has passed. A raylet that refuses costs nothing but the spares: a restart
    then starts processes as without them."""
    import ray

    from tidal.ray_private import prestart_workers

    ctx = ray.get_runtime_context()
    job, env = ctx.get_job_id(), ctx.get_runtime_env_string()
    node = next(x for x in ray.nodes() if x["NodeID"] == ctx.get_node_id())
    raylet = f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}"
    first = idle = len(idle_spares(job, env))
    deadline, asked_at, asked = time.monotonic() + patience_s, -ask_every_s, 0
    # At most twice `want` asked in all: where the spares cannot be counted (a runtime env whose
    # variables Ray expands, a container), asking on would start processes without end.
    while (n := min(to_start(want, idle), 2 * want - asked)) > 0 and time.monotonic() < deadline:
        if time.monotonic() - asked_at >= ask_every_s:
            asked += n
            try:
                prestart_workers(raylet, job, env, n, KEEP_ALIVE_S)
            except Exception as e:  # noqa: BLE001 - no spares is today's behaviour, never a failed job
                print(f"[tidal] could not start warm spares on this node ({type(e).__name__}: {e}); "
                      "a restart starts new processes", file=sys.stderr, flush=True)
                break
            asked_at = time.monotonic()
        time.sleep(0.5)
        now = len(idle_spares(job, env))
        if now > idle:
            asked_at = -ask_every_s  # those asked for are up: ask for the rest at once
        idle = now
    _trace({"refill": {"wanted": want, "idle_before": first, "idle_after": idle, "at": time.time()}})
    return max(0, idle - first)


def idle_spares(job: str, runtime_env: str) -> list[int]:
    """pids of this job's idle workers on this node that an actor with `runtime_env` could take:
    the raylet's children (this worker's parent; another Ray instance on the machine has its own)
    titled `ray::IDLE`, whose RAY_JOB_ID (set by Ray in each worker it starts) is the job's and
    whose environment holds the runtime env's variables (Ray sets them in the process)."""
    import psutil

    out = []
    for p in psutil.Process(os.getppid()).children():
        try:
            if IDLE_TITLE in " ".join(p.cmdline()) and fits(p.environ(), job, runtime_env):
                out.append(p.pid)
        except psutil.Error:  # it exited or was taken meanwhile
            continue
    return out


def fits(environ: dict[str, str], job: str, runtime_env: str) -> bool:
    """Whether an idle process with `environ` is a spare for `job`'s actors with `runtime_env`
    (a serialized runtime env): the job's, with every one of the runtime env's variables."""
    try:
        wanted_vars = json.loads(runtime_env or "{}").get("env_vars") or {}
    except ValueError:
        return False
    return environ.get("RAY_JOB_ID") == job and all(environ.get(k) == v for k, v in wanted_vars.items())


def _trace(record: dict) -> None:
    if path := os.environ.get(TRACE_ENV):
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def torch_imported() -> bool:
    """Whether torch and TorchDynamo are imported in this process (a warm spare's are)."""
    return all(name in sys.modules for name in PRELOAD)
