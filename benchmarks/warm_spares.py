"""Warm spares: a worker kill's cost with them against without, what they hold in memory, and the
quickstart's start with them on and off.

    python -m benchmarks.warm_spares [--pairs 4] [--no-doc]

Kill: a 2-worker ZeRO-2 job (tidal.testing.chaos's GPT d64 L2, a checkpoint every 10 steps), each run
in a process of its own with its own local Ray instance (spares live as long as their Ray job),
`failure.warm_spares` at its default and at 0, the order alternating by round. Its steps are slowed
(tests/slow_step.py) until one worker is SIGKILLed: once the job has trained 10 steps and, with
spares, the node's spares are warm (without: 20 s later). The figure: seconds from the kill to the
first step the restarted group trained (rank 0's loss trace): detection, the new group's processes,
imports, engine, restore and one step. Each spare's memory is read just before the kill.
Quickstart: `tidal run jobs/quickstart.yaml` (log every step) in a process of its own: seconds
from the command to its first step, and to its end, spares at the default and at 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    ROOT,
    child_run,
    first_step_after,
    median,
    paired_rounds,
    pairs_main,
    read_trace,
    write_spec,
)
from tidal.testing.processes import wait_for

SECTION = "Warm spares: a worker kill and the first start"
STEPS = 300
KINDS = ("cold", "spares")
MARK = "WARM-SPARES-RESULT "


def child(kind: str, folder: Path) -> dict[str, Any]:
    """One kill run, in this process (started by `run` as a child)."""
    import ray

    import tidal
    from tidal.testing.chaos import chaos_spec
    from tidal.testing.processes import kill, our_processes
    from tidal.testing.spares import memory_mib, warm_spares
    from tidal.worker.metrics import LOSS_TRACE_ENV
    from tidal.worker.spares import TRACE_ENV, wanted

    os.environ["RAY_ADDRESS"] = "local"
    slow = folder / "slow"
    slow.touch()
    spec = chaos_spec(folder, kind, STEPS, 10)
    spec = spec.with_overrides({
        "failure.warm_spares": wanted(2, None, idle_cpus=1) if kind == "spares" else 0, "train.step_fn": "tests.slow_step:step",
        "worker_env": {**spec.worker_env, TRACE_ENV: str(folder / "starts"), "TIDAL_TEST_STEP_S": "0.05",
                       "TIDAL_TEST_HOLD": str(slow)}})
    loss_trace = Path(spec.worker_env[LOSS_TRACE_ENV])
    out: dict[str, Any] = {}

    def inject() -> None:
        try:
            wait_for("step 10", lambda: any(r["step"] >= 10 for r in read_trace(loss_trace)), 300)
            if kind == "spares":
                job = ray.get_runtime_context().get_job_id()
                ready = wait_for("warm spares", lambda: warm_spares(job, wanted(2, None, idle_cpus=1)), 300, every=0.1)
                out["spare_mib"] = memory_mib(ready)
            else:
                time.sleep(20)
            workers = wait_for("training workers", lambda: our_processes("RayTrainWorker"), 60)
            out["kill"] = time.time()
            kill(workers[-1])
        finally:
            slow.unlink()

    injector = threading.Thread(target=inject, daemon=True)
    injector.start()
    tidal.run(spec)
    injector.join(timeout=10)
    kill_at = out["kill"]
    out["kill_to_step_s"] = first_step_after(loss_trace, kill_at)
    starts = [json.loads(line) for line in (folder / "starts").read_text().splitlines()]
    out["restarted_warm"] = [s["warm"] and s["process_started"] < kill_at
                             for s in starts if "pid" in s and s["train_started"] > kill_at]
    return out


def one(kind: str, folder: Path) -> dict[str, Any]:
    return child_run("benchmarks.warm_spares", MARK, kind, folder)[0]


def quickstart(kind: str, folder: Path) -> dict[str, float]:
    """`tidal run jobs/quickstart.yaml`: seconds to its first step and to its end."""
    import yaml

    from tidal.spec.job import JobSpec
    from tidal.testing.runs import prepared_store
    from tidal.worker.metrics import LOSS_TRACE_ENV

    folder.mkdir(parents=True)
    spec = JobSpec.model_validate(yaml.safe_load((ROOT / "jobs" / "quickstart.yaml").read_text())).with_overrides({
        "train.log_every": 1, "checkpoint.storage": str(folder / "runs"), "failure.warm_spares": 0 if kind == "cold" else None,
        "tracking.uri": prepared_store(folder / "mlflow.db"), "worker_env": {LOSS_TRACE_ENV: str(folder / "trace")}})
    path = write_spec(spec, folder / "quickstart.yaml")
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "tidal", "run", str(path)], capture_output=True, text=True,
                          timeout=900, cwd=ROOT, env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    end = time.time() - t0
    if proc.returncode:
        raise RuntimeError(proc.stdout[-3000:] + proc.stderr[-3000:])
    first = min(r["ts"] for r in read_trace(folder / "trace")) - t0
    return {f"{kind}_first_s": first, f"{kind}_wall_s": end}


def run(pairs: int, tmp: Path) -> dict[str, list[dict[str, Any]]]:
    return {"kills": kill_rounds(pairs, tmp), "starts": start_rounds(pairs, tmp)}


def kill_rounds(pairs: int, tmp: Path) -> list[dict[str, Any]]:
    return paired_rounds(pairs, KINDS, lambda i, kind: {kind: one(kind, tmp / f"kill-{i}-{kind}")},
                          lambda r: {"ratio": r["spares"]["kill_to_step_s"] / r["cold"]["kill_to_step_s"]},
                          lambda i, r: f"round {i + 1}: kill -> first new step without spares "
                          f"{r['cold']['kill_to_step_s']:.1f} s, with {r['spares']['kill_to_step_s']:.1f} s "
                          f"({r['ratio']:.2f}); restarted warm {r['spares']['restarted_warm']}")


def start_rounds(pairs: int, tmp: Path) -> list[dict[str, Any]]:
    return paired_rounds(pairs, KINDS, lambda i, kind: quickstart(kind, tmp / f"quick-{i}-{kind}"),
                           lambda r: {}, lambda i, r: f"round {i + 1}: quickstart first step without spares "
                           f"{r['cold_first_s']:.1f} s, with {r['spares_first_s']:.1f} s; end {r['cold_wall_s']:.1f} / "
                           f"{r['spares_wall_s']:.1f} s")


def report(rounds: dict[str, list[dict[str, Any]]], pairs: int) -> str:
    kills, starts = rounds["kills"], rounds["starts"]
    kill_rows = "\n".join(
        f"| {i + 1} | {r['cold']['kill_to_step_s']:.1f} s | {r['spares']['kill_to_step_s']:.1f} s | {r['ratio']:.2f} | "
        f"{sum(r['spares']['restarted_warm'])} of {len(r['spares']['restarted_warm'])} |" for i, r in enumerate(kills))
    mib = [m for r in kills for m in r["spares"].get("spare_mib", [])]
    start_rows = "\n".join(
        f"| {i + 1} | {r['cold_first_s']:.1f} s | {r['spares_first_s']:.1f} s | {r['cold_wall_s']:.1f} s | "
        f"{r['spares_wall_s']:.1f} s |" for i, r in enumerate(starts))
    return f"""Command: `python -m benchmarks.warm_spares --pairs {pairs}` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, CPU
only, **the machine shared with other work**: absolute times are loaded ones, the pairs are what to compare)

A worker SIGKILLed in a 2-worker ZeRO-2 job (GPT d64 L2; Ray Train's full restart), seconds from the kill to the
first step of the restarted group, `failure.warm_spares` at 0 (cold: new processes) and at its default (spares),
each run on a local Ray instance of its own, the order alternating by round:

| round | kill -> first new step, cold | with spares | spares / cold | restarted workers that started warm |
|---|---|---|---|---|
{kill_rows}

Medians: cold **{median([r['cold']['kill_to_step_s'] for r in kills]):.1f} s**, with spares
**{median([r['spares']['kill_to_step_s'] for r in kills]):.1f} s** (ratio {median([r['ratio'] for r in kills]):.2f}).
Memory per spare (idle, torch and TorchDynamo imported): RSS median {median([m[0] for m in mib]):.0f} MiB, of which
its own (USS) {median([m[1] for m in mib]):.0f} MiB; a 2-worker node keeps 5.

The quickstart (`tidal run jobs/quickstart.yaml`, logging every step), seconds from the command to its first step
and to its end:

| round | first step, cold | first step, spares | end, cold | end, spares |
|---|---|---|---|---|
{start_rows}

Medians: first step cold {median([r['cold_first_s'] for r in starts]):.1f} s, spares
{median([r['spares_first_s'] for r in starts]):.1f} s; end cold {median([r['cold_wall_s'] for r in starts]):.1f} s,
spares {median([r['spares_wall_s'] for r in starts]):.1f} s (spares start after the first step: a first start
has none to use).
"""


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print(MARK + json.dumps(child(sys.argv[2], Path(sys.argv[3]))), flush=True)
        return
    pairs_main(__doc__, SECTION, "tidal-spares-", run, report)


if __name__ == "__main__":
    main()
