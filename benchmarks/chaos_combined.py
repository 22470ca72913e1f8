"""Combined-fault chaos: one elastic job on object storage while faults of every kind Tidal claims
to survive land at seeded random times, some of them in the middle of a save or of a resize's
restore. Reports each fault and its cost, steps lost, steps logged twice, every step's loss
(replayed ones included) against an undisturbed run, and the effective training time.

    python -m benchmarks.chaos_combined [--faults 10] [--steps 3000] [--every 25] [--seed 0]
        # writes the "Combined faults" section of docs/reliability.md

The whole cluster is real and on this machine: a moto S3 server (checkpoints, the event log),
an `mlflow server` (tracking), a Ray cluster of one head and two 1-CPU worker nodes
(`ray.cluster_utils.Cluster`), and the job's driver as a `tidal run` subprocess, as a user runs
it. The faults:

- worker: SIGKILL of a Ray Train worker process;
- worker mid-save: the same while a checkpoint is being written (a write paused before its
  manifests by TIDAL_TEST_CHECKPOINT_WRITE_DELAY_S, so the kill lands between a rank's files and its
  manifest);
- node: a worker node removed (the job shrinks to 1 worker), and returned some seconds later
  (it grows back to 2 when Ray Train next looks);
- resize restore: a node removed and the surviving worker killed while it restores the 2-worker
  checkpoint at 1 worker: inside the direct ZeRO-1/2 resize (tidal.worker.checkpoint.repartition: once its
  byte-range copy has begun in the node's restore cache), or inside the universal conversion of a
  checkpoint that still converts;
- driver: SIGKILL of the `tidal run` process, then the same command again (it resumes);
- tracker: SIGKILL of the job's tracker actor;
- mlflow: the tracking server stopped for some seconds and started again.

Every loss a step produced, in every life, is read from the loss trace rank 0 writes when
TIDAL_LOSS_TRACE names a file (tidal.worker.loop): MLflow keeps one point per step (the first),
which would hide a replayed step that trained differently.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")  # this process never becomes a Ray driver

import argparse
import json
import random
import signal
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from benchmarks import goodput_check
from benchmarks.common import Job, read_trace, update_doc, write_spec
from tidal.spec.job import JobSpec
from tidal.storage import RunDir, check_complete
from tidal.testing.clusters import raylet_cluster
from tidal.testing.processes import our_processes, wait_for
from tidal.testing.servers import MlflowServer, moto_s3
from tidal.testing.timeline import LogTail, Timeline, TraceTail, markdown_rows
from tidal.worker.checkpoint.fetch import CACHE_ENV, PREFIX
from tidal.worker.checkpoint.repartition import COPIES

DOC = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"
SECTION = "Combined faults"
KINDS = ("worker", "worker mid-save", "node", "resize restore", "driver", "tracker", "mlflow")
# The faults that stop training: the harness's clock (tidal/testing/timeline.py) splits a group where one
# landed between two of its steps; the tracker's and MLflow's only hold the console's lines back, which
# widens the tolerance of the rows a console line bounds (the steps are timed by the loss trace).
STOPS_TRAINING = ("worker", "worker mid-save", "node", "resize restore", "driver")
WRITE_DELAY_S = 0.5  # each rank's write pauses this long before its manifest: room to kill mid-save


def chaos_spec(storage: str, tracking: str, name: str, steps: int, every: int, trace: Path,
               zero_stage: int = 2) -> JobSpec:
    return JobSpec(
        name=name,
        model={"n_layer": 2, "n_head": 2, "d_model": 128, "vocab_size": 64, "seq_len": 32},
        train={"steps": steps, "micro_batch": 8, "global_batch": 64, "lr": 3e-3, "warmup_steps": 10, "log_every": 1},
        parallelism={"zero_stage": zero_stage},
        scaling={"min_workers": 1, "max_workers": 2, "cpus_per_worker": 1, "elastic_check_s": 10},
        # The memory tier as a user gets it (on by default since issue 76): a restart resumes from a snapshot.
        checkpoint={"every_steps": every, "keep": 3, "storage": storage},
        failure={"max_restarts": 100},
        tracking={"uri": tracking, "experiment": "chaos-combined"},
        # In the spec, not this process's environment: the workers' raylets started before it. The
        # restore cache where this process can watch a resize's copy begin (`_resizing`).
        worker_env={"TIDAL_LOSS_TRACE": str(trace), "TIDAL_TEST_CHECKPOINT_WRITE_DELAY_S": str(WRITE_DELAY_S),
                    CACHE_ENV: str(restore_cache(trace))},
    )


# --- where the job is ------------------------------------------------------------------------------

def _top_step(path: Path) -> int:
    return max((r["step"] for r in read_trace(path)), default=0)


def _save_in_flight(run: RunDir) -> bool:
    """The newest checkpoint folder has its state file but not every manifest yet."""
    folders = run.checkpoints()
    if not folders:
        return False
    problem, _ = check_complete(run.fs, folders[0])
    return problem is not None and "never finished writing" in problem


def restore_cache(trace: Path) -> Path:
    """The job's node-local restore cache (the simulated nodes share this machine's disk)."""
    return trace.parent / f"{trace.stem}-restore-cache"


def _copies(cache: Path) -> set[Path]:
    """The folders of the direct resizes' copies in `cache` (tidal.worker.checkpoint.repartition)."""
    return set(cache.glob(f"{PREFIX}*/{COPIES}*"))


def _resizing(cache: Path, before: set[Path]) -> bool:
    """A direct resize's copy has begun since `before` was taken: its rank is inside the restore."""
    return bool(_copies(cache) - before)


def _converting(run: RunDir) -> bool:
    """Rank 0's status for a resize's universal conversion says it is under way (tidal.worker.checkpoint.universal)."""
    from tidal import fs

    for folder in run.checkpoints()[:2]:
        for info in fs.list_dir(run.fs, folder):
            if info.base_name.startswith("tidal-converting-"):
                status = fs.read_json(run.fs, info.path) or {}
                if status.get("state") in ("pending", "converting"):
                    return True
    return False


def _until(cond: Callable[[], Any], timeout: float, poll: float = 0.1) -> Any:
    """`cond()`'s first truthy value, a look that raises counting as none; None after `timeout`."""
    def look() -> Any:
        with suppress(Exception):
            return cond()
        return None

    with suppress(TimeoutError):
        return wait_for("a fault's moment", look, timeout, every=poll)
    return None


@dataclass
class Fault:
    kind: str
    at_step: int
    t: float = 0.0
    done: bool = False
    note: str = ""
    stops: list[float] = field(default_factory=list)  # when each kill or node removal it made landed


@dataclass
class Chaos:
    """Carries out the planned faults one after another, each when the job passes its step."""

    cluster: Any  # ray.cluster_utils.Cluster
    mlflow: MlflowServer
    driver: Job
    run: RunDir
    trace: Path
    plan: list[Fault]
    rng: random.Random
    stop: threading.Event = field(default_factory=threading.Event)  # set when the job has ended

    def go(self) -> None:
        for fault in self.plan:
            self._until(lambda f=fault: _top_step(self.trace) >= f.at_step, 3600, 0.3)
            if self.stop.is_set():
                fault.note = "not injected: the job had ended"
                continue
            getattr(self, "_" + fault.kind.replace(" ", "_").replace("-", "_"))(fault)
            fault.done = bool(fault.t)
            self.stop.wait(2.0)

    def _until(self, cond: Callable[[], Any], timeout: float, poll: float = 0.1) -> Any:
        """`_until`, ending early (None) once the job has ended."""
        seen: dict[str, Any] = {}

        def check() -> Any:
            if self.stop.is_set():
                return True
            seen["value"] = cond()
            return seen["value"]

        _until(check, timeout, poll)
        return None if self.stop.is_set() else seen.get("value")

    def _kill_worker(self, fault: Fault) -> bool:
        workers = self._until(lambda: our_processes("RayTrainWorker"), 120, 0.2)
        if not workers:
            fault.note = "no worker found"
            return False
        fault.t = time.time()
        fault.stops.append(fault.t)
        with suppress(psutil.Error):
            self.rng.choice(workers).send_signal(signal.SIGKILL)
        return True

    def _worker(self, fault: Fault) -> None:
        self._kill_worker(fault)

    def _worker_mid_save(self, fault: Fault) -> None:
        if self._until(lambda: _save_in_flight(self.run), 300, 0.05):
            self._kill_worker(fault)
            fault.note = "a checkpoint was being written"
        else:
            fault.note = "no save seen in flight; killed anyway"
            self._kill_worker(fault)

    def _resize_restore(self, fault: Fault) -> None:
        """Take a node away (the job restarts at 1 worker, resizing its 2-worker checkpoint), kill
        the worker while it restores, and give the node back."""
        cache = restore_cache(self.trace)
        before = _copies(cache)
        victim = self._remove_node(fault)
        if victim is None:
            return
        t_removed = time.time()
        where = self._until(lambda: ("direct" if _resizing(cache, before) else None)
                            or ("conversion" if _converting(self.run) else None), 60, 0.01)
        if where:
            self._kill_worker(fault)
            fault.note = f"node removed; the worker killed inside the resize's restore ({where}); node returned"
        else:
            fault.note = "node removed; no resize restore seen in flight within 60 s; node returned"
        self.stop.wait(max(0.0, 15 - (time.time() - t_removed)))
        self.cluster.add_node(num_cpus=1)

    def _node(self, fault: Fault) -> None:
        if self._remove_node(fault) is not None:
            self.stop.wait(self.rng.uniform(10, 20))
            self.cluster.add_node(num_cpus=1)
            fault.note = "node removed, returned"

    def _remove_node(self, fault: Fault) -> Any:
        workers = [n for n in self.cluster.list_all_nodes() if not n.head]
        if not workers:
            fault.note = "no worker node"
            return None
        victim = self.rng.choice(workers)
        fault.t = time.time()
        fault.stops.append(fault.t)
        self.cluster.remove_node(victim)
        return victim

    def _driver(self, fault: Fault) -> None:
        fault.t = time.time()
        fault.stops.append(fault.t)
        self.driver.restart()

    def _tracker(self, fault: Fault) -> None:
        trackers = self._until(lambda: our_processes("TrackerActor"), 60, 0.2)
        if trackers:
            fault.t = time.time()
            with suppress(psutil.Error):
                trackers[0].send_signal(signal.SIGKILL)
        else:
            fault.note = "no tracker found"

    def _mlflow(self, fault: Fault) -> None:
        fault.t = time.time()
        self.mlflow.crash()
        down = self.rng.uniform(5, 15)
        self.stop.wait(down)
        self.mlflow.start()
        fault.note = f"down {down:.0f} s"


def plan_faults(rng: random.Random, n: int, steps: int) -> list[Fault]:
    """n faults, every kind at least once (n >= len(KINDS)), at spread-out steps in order."""
    kinds = list(KINDS) + [rng.choice(KINDS) for _ in range(max(0, n - len(KINDS)))]
    rng.shuffle(kinds)
    width = steps // (n + 2)
    return [Fault(kind, rng.randrange(k * width + 5, (k + 1) * width)) for k, kind in enumerate(kinds, start=1)]


# --- one invocation --------------------------------------------------------------------------------

def run_job(cluster: Any, mlflow: MlflowServer, spec: JobSpec, tmp: Path, faults: list[Fault],
            seed: int) -> dict[str, Any]:
    trace = Path(spec.worker_env["TIDAL_LOSS_TRACE"])
    driver = Job(write_spec(spec, tmp / f"{spec.name}.yaml"), cluster.address, trace, tmp / f"{spec.name}.log")
    chaos = Chaos(cluster, mlflow, driver, RunDir(spec.checkpoint.storage, spec.name), trace, faults,
                  random.Random(seed))
    # The faults run on this (main) thread: Ray's Cluster adds a node only from the main thread.
    ended: dict[str, int] = {}
    waiter = threading.Thread(target=lambda: (ended.setdefault("code", driver.wait_exit(4 * 3600)), chaos.stop.set()),
                              daemon=True)
    t0 = time.time()
    timeline = Timeline(launched=t0)  # the harness's own clock (tidal/testing/timeline.py)
    with LogTail(driver.log, timeline), TraceTail(trace, timeline):
        driver.start()
        waiter.start()
        chaos.go()
        waiter.join()
    code = ended.get("code", -1)
    timeline.ended = time.time()
    # every kill and node removal (a resize restore's fault makes both)
    timeline.kills = sorted((t, 0) for f in faults if f.done and f.kind in STOPS_TRAINING for t in f.stops)
    return {"exit": code, "wall_s": timeline.ended - t0, "trace": read_trace(trace), "log": driver.log,
            "timeline": timeline}


def job_losses(client: Any, experiment: str, job: str) -> tuple[list[Any], list[Any]]:
    """A job's MLflow runs and every loss point they hold."""
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], f"tags.`tidal.job` = '{job}'") if exp else []
    return runs, [m for r in runs for m in client.get_metric_history(r.info.run_id, "loss")]


def effective(client: Any, runs: list[Any], losses: list[Any]) -> tuple[float, float]:
    """A job's useful step time (its MLflow `step_time_s`, one point per step) and its wall time
    from the first step's loss to the last's."""
    if not runs or not losses:
        return 0.0, 0.0
    stamps = [m.timestamp / 1000 for m in losses]
    useful = sum(m.value for m in client.get_metric_history(runs[0].info.run_id, "step_time_s"))
    return useful, max(stamps) - min(stamps)


def summarize(spec: JobSpec, ref: dict[str, Any], got: dict[str, Any], faults: list[Fault]) -> dict[str, Any]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(spec.tracking.uri)
    runs, hist = job_losses(client, spec.tracking.experiment, spec.name)
    counts = Counter(m.step for m in hist)
    useful, training_wall = effective(client, runs, hist)
    ref_useful, ref_wall = effective(client, *job_losses(client, spec.tracking.experiment, "undisturbed"))
    expected = {r["step"]: r["loss"] for r in ref["trace"]}
    lives = got["trace"]
    diffs = [_rel(r["loss"], expected[r["step"]]) for r in lives if r["step"] in expected]
    steps = spec.train.steps
    return {
        "runs": len(runs), "exit": got["exit"], "faults": faults,
        "missing": [s for s in range(1, steps + 1) if counts[s] == 0],
        "twice": sorted(s for s, c in counts.items() if c > 1),
        "executions": len(lives), "replayed": len(lives) - len({r["step"] for r in lives}),
        "max_rel_diff": max(diffs, default=float("nan")), "compared": len(diffs),
        **judge(lives, expected), "restarts": restarts(lives),
        "useful_s": useful, "training_wall_s": training_wall, "wall_s": got["wall_s"], "steps": steps,
        "ref_useful_s": ref_useful, "ref_wall_s": ref_wall,
        "every": spec.checkpoint.every_steps, "zero": spec.parallelism.zero_stage,
        "ledger_rows": _ledger_rows(client, spec, ref, got, useful, ref_useful),
    }


def _ledger_rows(client: Any, spec: JobSpec, ref: dict[str, Any], got: dict[str, Any], useful: float,
                 ref_useful: float) -> str:
    """The platform's goodput account of each job beside this benchmark's (its step times over its wall
    time from the first `tidal run` started to the last one's exit)."""
    out = ""
    for name, job, run, use in (("undisturbed", "undisturbed", ref, ref_useful), ("under faults", spec.name, got, useful)):
        runs, _ = job_losses(client, spec.tracking.experiment, job)
        g = goodput_check.ledger(spec.tracking.uri, runs[0].info.run_id) if runs else {}
        out += goodput_check.rows(name, g, goodput_check.agreement(g, use, run["wall_s"]))
        if run.get("timeline") is not None and g:  # against the harness's own clock, not the same step times
            out += markdown_rows(name, run["timeline"], g,
                                 "; the driver's console lags under load: the rows its lines bound are loose")
    return out.rstrip("\n")


def keep(spec: JobSpec, runs: dict[str, dict[str, Any]], path: Path) -> None:
    """Each job's harness timeline and its ledger's final figures as JSON, to derive the rows again later."""
    from mlflow.tracking import MlflowClient

    out = {}
    for job, run in runs.items():
        ids, _ = job_losses(MlflowClient(spec.tracking.uri), spec.tracking.experiment, job)
        out[job] = {"timeline": asdict(run["timeline"]),
                    "ledger": goodput_check.ledger(spec.tracking.uri, ids[0].info.run_id) if ids else {}}
    path.write_text(json.dumps(out))


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2] if xs else float("nan")


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def judge(trace: list[dict[str, Any]], expected: dict[int, float], tail: int = 100) -> dict[str, Any]:
    """What the losses say about the checkpoints, apart from floating-point drift.

    A resize changes the order in which gradients are summed (one worker adds eight micro-batches
    in turn; two add four each and then each other's sums), so a step after a resize differs from
    the undisturbed run by rounding (~1e-8 relative), and training amplifies that difference the
    way it amplifies any nondeterminism (GPU atomics do the same): after some hundred steps single
    losses differ by 1e-3 while the curve is the same. So a checkpoint is judged by what it can
    be held to: a step replayed at the world size of its earlier execution equals it bit for bit;
    the first step of every life is within 1e-6 of its earlier execution (or of the undisturbed
    run); and the last `tail` steps' mean loss is the undisturbed run's, within its spread.
    """
    seen: dict[int, dict[str, Any]] = {}
    same, other, firsts = [], [], []
    previous_life = None
    for life, r in _lives(trace):
        before = seen.get(r["step"])
        if before is not None:
            (same if before["world"] == r["world"] else other).append(abs(r["loss"] - before["loss"]))
        if life != previous_life:
            base = before["loss"] if before is not None else expected.get(r["step"])
            if base is not None:
                firsts.append((_rel(r["loss"], base), life, r))
            previous_life = life
        seen[r["step"]] = r
    last = sorted(seen)[-tail:]
    ref = [expected[s] for s in last if s in expected]
    mean = sum(ref) / max(len(ref), 1)
    spread = (sum((x - mean) ** 2 for x in ref) / max(len(ref), 1)) ** 0.5
    worst_first = max(firsts, key=lambda x: x[0], default=(float("nan"), 0, {"step": 0, "world": 0}))
    return {
        "replays_same_world": len(same), "replay_max_abs": max(same, default=0.0),
        "replays_other_world": len(other), "replay_other_max_abs": max(other, default=0.0),
        "lives": len(firsts), "first_step_max_rel": worst_first[0],
        "first_step_worst": f"step {worst_first[2]['step']} (life {worst_first[1]}, world {worst_first[2]['world']})",
        "tail": len(last), "tail_mean": sum(seen[s]["loss"] for s in last) / max(len(last), 1),
        "tail_ref_mean": mean, "tail_ref_sd": spread,
    }


def restarts(trace: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each restart's cost, from the loss trace's clock: the seconds from the last step of a life
    to the first step of the next, and the steps the new life trained again."""
    out, prev = [], None
    for _, r in _lives(trace):
        if prev is not None and r["step"] != prev["step"] + 1:
            out.append({"after_step": prev["step"], "resumed_at": r["step"], "world": r["world"],
                        "gap_s": r["ts"] - prev["ts"], "replayed": max(prev["step"] - r["step"] + 1, 0)})
        prev = r
    return out


def _lives(trace: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """Each trace record with the number of the life (worker group) that wrote it: a life ends
    where the steps go back or jump."""
    life, last, out = 0, None, []
    for r in trace:
        if last is not None and r["step"] != last + 1:
            life += 1
        out.append((life, r))
        last = r["step"]
    return out


def report(r: dict[str, Any], command: str) -> str:
    rows = "\n".join(f"| {i} | {f.kind} | {f.at_step} | {'yes' if f.done else 'no'} | {f.note} |"
                     for i, f in enumerate(r["faults"], start=1))
    eff = r["useful_s"] / r["training_wall_s"] if r["training_wall_s"] else float("nan")
    gaps = [x["gap_s"] for x in r["restarts"]]
    return f"""Command: `{command}` ({time.strftime('%Y-%m-%d')}, 2-core CPU machine; moto S3, `mlflow server`, a Ray
cluster of a head and two 1-CPU worker nodes, the driver as a `tidal run` process)

A {r['steps']}-step elastic job (1-2 workers, GPT d128 L2, ZeRO-{r['zero']}, a checkpoint every {r['every']} steps on S3,
each write paused {WRITE_DELAY_S} s before its manifests; the memory tier on, as by default: `checkpoint.memory`
unset) under these faults, in this order:

| # | fault | after step | injected | what happened |
|---|---|---|---|---|
{rows}

| measure | value |
|---|---|
| the job ended | exit code {r['exit']}, {r['runs']} MLflow run(s) |
| steps missing from MLflow / logged twice | {len(r['missing'])} / {len(r['twice'])} |
| step executions (every life) / steps replayed | {r['executions']} / {r['replayed']} |
| steps replayed at the world size of their earlier execution: count, largest difference | {r['replays_same_world']}, **{r['replay_max_abs']:.1e}** (goal: 0, bit for bit) |
| steps replayed at another world size: count, largest difference | {r['replays_other_world']}, {r['replay_other_max_abs']:.1e} (rounding: a resize sums gradients in another order) |
| first step of each of the {r['lives']} lives vs its earlier execution or the undisturbed run: largest relative difference | **{r['first_step_max_rel']:.1e}**, {r['first_step_worst']} (goal: <= 1e-6) |
| mean loss of the last {r['tail']} steps: this run / undisturbed (its standard deviation) | **{r['tail_mean']:.5f}** / {r['tail_ref_mean']:.5f} ({r['tail_ref_sd']:.5f}) |
| largest relative difference of any execution's loss vs the undisturbed run ({r['compared']} compared; rounding amplified over steps, see below) | {r['max_rel_diff']:.2e} |
| effective training time, first step to last (useful step time / wall time) | {r['useful_s']:.1f} s / {r['training_wall_s']:.1f} s = **{eff:.1%}** |
| the same from the first `tidal run` (includes launch) | {r['useful_s']:.1f} s / {r['wall_s']:.1f} s |
| the undisturbed run's, for comparison (what logging and checkpoints every {r['every']} steps cost without a fault) | {r['ref_useful_s']:.1f} s / {r['ref_wall_s']:.1f} s = {r['ref_useful_s'] / max(r['ref_wall_s'], 1e-9):.1%} |
{r['ledger_rows']}
| restarts: count, median seconds from a life's last step to the next life's first, steps trained again | {len(gaps)}, **{_median(gaps):.1f} s** (each: {", ".join(f"{g:.0f}" for g in gaps)}), {sum(x["replayed"] for x in r["restarts"])} |

At that median cost per restart, one fault an hour would leave {1 - _median(gaps) / 3600:.1%} of the time to training,
one every ten minutes {1 - _median(gaps) / 600:.1%}.
"""


KEEP = Path(tempfile.gettempdir()) / "tidal-chaos-last"


def _keep(tmp: Path) -> None:
    """The traces, specs and logs of the last invocation, for a person to read after it."""
    import shutil

    shutil.rmtree(KEEP, ignore_errors=True)
    KEEP.mkdir(parents=True)
    for f in tmp.iterdir():
        if f.suffix in (".trace", ".log", ".yaml"):
            shutil.copy(f, KEEP / f.name)
    print(f"traces and logs kept in {KEEP}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", type=int, default=10)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-doc", action="store_true", help="print the report only")
    ap.add_argument("--keep", type=Path, default=None,
                    help="write each job's harness timeline and the ledger's figures to this JSON file")
    ap.add_argument("--zero-stage", type=int, default=2, choices=(1, 2, 3),
                    help="the job's ZeRO stage: its resizes go by byte range at every stage")
    args = ap.parse_args()
    if args.faults < len(KINDS):
        ap.error(f"--faults must be at least {len(KINDS)}: one of each kind ({', '.join(KINDS)})")
    with tempfile.TemporaryDirectory(prefix="tidal-chaos-") as d:
        tmp = Path(d)
        mlflow = MlflowServer(tmp, str(tmp / "artifacts"), direct_artifacts=True)
        try:
            # S3 first: every raylet inherits its endpoint
            with moto_s3(tmp / "moto.log", buckets=("chaos",)), raylet_cluster(workers=2, connect=False) as cluster:
                mlflow.start()
                ref_spec = chaos_spec("s3://chaos/runs", mlflow.uri, "undisturbed", args.steps, args.every,
                                      tmp / "undisturbed.trace", args.zero_stage)
                ref = run_job(cluster, mlflow, ref_spec, tmp, [], args.seed)
                spec = chaos_spec("s3://chaos/runs", mlflow.uri, "chaos", args.steps, args.every, tmp / "chaos.trace",
                                  args.zero_stage)
                faults = plan_faults(random.Random(args.seed), args.faults, args.steps)
                got = run_job(cluster, mlflow, spec, tmp, faults, args.seed)
                r = summarize(spec, ref, got, faults)
                if args.keep:
                    keep(spec, {"undisturbed": ref, spec.name: got}, args.keep)
        finally:
            mlflow.stop()
            _keep(tmp)
        cmd = (f"python -m benchmarks.chaos_combined --faults {args.faults} --steps {args.steps} --every {args.every} "
               f"--seed {args.seed}" + (f" --zero-stage {args.zero_stage}" if args.zero_stage != 2 else ""))
        text = report(r, cmd)
        print(text)
        if r["exit"] != 0:
            print(Path(got["log"]).read_text()[-5000:])
        if not args.no_doc:
            update_doc(SECTION, text, DOC)


if __name__ == "__main__":
    main()
