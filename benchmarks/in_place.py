"""A worker kill replaced in place (failure.replace_in_place) against Ray Train's full restart.

    python -m benchmarks.in_place [--pairs 4] [--no-doc]

A 2-worker ZeRO-2 job (tidal.testing.chaos's GPT d64 L2, a checkpoint every 10 steps, memory snapshots
every 5), each run in a process of its own with its own local Ray instance, `failure.replace_in_place`
off (restart) and on (in place), the order alternating by round. Its steps are slowed (tests/slow_step.py)
until the last Ray Train worker process is SIGKILLed, 5 s after the job trained 10 steps. The figure:
seconds from the kill to the first step trained after it (rank 0's loss trace): detection, the new
worker(s), the group formed again, the engine, the restore from memory and one step. In place, the
survivor's process is the one that was there before the kill (said per round).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    child_run,
    first_step_after,
    median,
    paired_rounds,
    pairs_main,
    read_trace,
)
from tidal.testing.processes import wait_for

SECTION = "A worker kill: replaced in place against the full restart"
STEPS = 300
KINDS = ("restart", "in_place")
MARK = "IN-PLACE-RESULT "


def child(kind: str, folder: Path) -> dict[str, Any]:
    """One kill run, in this process (started by `one` as a child)."""
    import tidal
    from tidal.testing.chaos import chaos_spec
    from tidal.testing.processes import kill, our_processes
    from tidal.worker.metrics import LOSS_TRACE_ENV

    os.environ["RAY_ADDRESS"] = "local"
    slow = folder / "slow"
    slow.touch()
    spec = chaos_spec(folder, kind, STEPS, 10, memory_every=5)
    spec = spec.with_overrides({
        "failure.replace_in_place": kind == "in_place", "train.step_fn": "tests.slow_step:step",
        "worker_env": {**spec.worker_env, "TIDAL_TEST_STEP_S": "0.05", "TIDAL_TEST_HOLD": str(slow)}})
    loss_trace = Path(spec.worker_env[LOSS_TRACE_ENV])
    out: dict[str, Any] = {}

    def inject() -> None:
        try:
            wait_for("step 10", lambda: any(r["step"] >= 10 for r in read_trace(loss_trace)), 300)
            time.sleep(5)
            workers = wait_for("training workers", lambda: our_processes("RayTrainWorker"), 60)
            out["kill"], out["others"] = time.time(), [p.pid for p in workers[:-1]]
            kill(workers[-1])
            wait_for("a step after the kill", lambda: any(r["ts"] > out["kill"] for r in read_trace(loss_trace)), 300)
            out["kept"] = [p.pid in out["others"] for p in our_processes("RayTrainWorker")]
        finally:
            slow.unlink(missing_ok=True)

    injector = threading.Thread(target=inject, daemon=True)
    injector.start()
    tidal.run(spec)
    injector.join(timeout=10)
    out["kill_to_step_s"] = first_step_after(loss_trace, out["kill"])
    out["survivor_kept"] = any(out.pop("kept", []))
    return out


def one(kind: str, folder: Path) -> dict[str, Any]:
    result, output = child_run("benchmarks.in_place", MARK, kind, folder)
    return {**result, "replaced_in_place": "replaced in place" in output}


def run(pairs: int, tmp: Path) -> list[dict[str, Any]]:
    return paired_rounds(pairs, KINDS, lambda i, kind: {kind: one(kind, tmp / f"kill-{i}-{kind}")},
                         lambda r: {"ratio": r["in_place"]["kill_to_step_s"] / r["restart"]["kill_to_step_s"]},
                         lambda i, r: f"round {i + 1}: kill -> first step, full restart "
                         f"{r['restart']['kill_to_step_s']:.1f} s, in place {r['in_place']['kill_to_step_s']:.1f} s "
                         f"({r['ratio']:.2f}); survivor kept {r['in_place']['survivor_kept']}")


def report(rounds: list[dict[str, Any]], pairs: int) -> str:
    rows = "\n".join(
        f"| {i + 1} | {r['restart']['kill_to_step_s']:.1f} s | {r['in_place']['kill_to_step_s']:.1f} s | "
        f"{r['ratio']:.2f} | {'yes' if r['in_place']['survivor_kept'] and r['in_place']['replaced_in_place'] else 'no'} |"
        for i, r in enumerate(rounds))
    return f"""Command: `python -m benchmarks.in_place --pairs {pairs}` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, CPU
only, **the machine shared with other work**: absolute times are loaded ones, the pairs are what to compare)

A worker SIGKILLed in a 2-worker ZeRO-2 job (GPT d64 L2, memory snapshots every 5 steps), seconds from the kill to
the first step trained after it, `failure.replace_in_place` off (Ray Train's full restart: new processes for both
ranks) and on (the lost rank replaced alone, the survivor re-forms the group in its own process), each run on a
local Ray instance of its own, the order alternating by round:

| round | kill -> first step, full restart | in place | in place / restart | survivor's process kept, replaced in place |
|---|---|---|---|---|
{rows}

Medians: full restart **{median([r['restart']['kill_to_step_s'] for r in rounds]):.1f} s**, in place
**{median([r['in_place']['kill_to_step_s'] for r in rounds]):.1f} s** (ratio {median([r['ratio'] for r in rounds]):.2f}).
"""


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print(MARK + json.dumps(child(sys.argv[2], Path(sys.argv[3]))), flush=True)
        return
    pairs_main(__doc__, SECTION, "tidal-in-place-", run, report)


if __name__ == "__main__":
    main()
