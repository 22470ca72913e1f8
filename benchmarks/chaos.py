"""Chaos: a job of a few hundred steps while worker processes are SIGKILLed at seeded random
times. Reports faults injected and survived, steps lost per fault, and effective training time
(useful step time / wall time), and checks the losses against an undisturbed run.

    python -m benchmarks.chaos [--faults 5] [--steps 300] [--seed 0]   # writes docs/reliability.md
    python -m benchmarks.chaos --fault-every-s 120 --steps 12000 --every 100
        # a fault every 2 minutes of wall time, no reference run; a section of docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import ray

from benchmarks import goodput_check
from benchmarks.common import update_doc
from tidal.testing.chaos import run_chaos, run_periodic

DOC = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"


def periodic_report(r: dict[str, Any], command: str) -> str:
    return f"""Command: `{command}` ({time.strftime('%Y-%m-%d')}, 2-core CPU machine, one local Ray instance)

A {r['steps']}-step job (the chaos job: tiny GPT, ZeRO-2, 2 workers, log every step, a checkpoint every
{r['every_steps']} steps) while a Ray Train worker process is SIGKILLed every {r['period_s']:.0f} s of wall time,
counted from its first step.

| measure | value |
|---|---|
| faults (worker SIGKILL), at steps | {len(r['faults'])}, {r['faults']} |
| worker-group restarts | {r['restarts']} |
| every step done and logged once | {r['steps_done']} |
| kill to new progress, per fault (restart + reload + replay of the lost steps) | {r['recovery_s']} s |
| effective training time, first step to last (useful step time / wall time) | {r['useful_s']:.1f} s / {r['training_wall_s']:.1f} s = **{r['useful_s'] / r['training_wall_s']:.1%}** |
| the same from `tidal.run` called (includes launch: Ray Train controller, workers, engines) | {r['useful_s']:.1f} s / {r['wall_s']:.1f} s = {r['useful_s'] / r['wall_s']:.1%} |

{r['ledger_rows']}
Useful step time is the sum of `step_time_s` over the steps in MLflow (each step once), so replayed steps,
restarts, checkpoints and logging all count as lost time. The platform's own account (docs/reliability.md,
"Where the time went") is read from the job's MLflow run beside it.
"""


def report(r: dict[str, Any], command: str) -> str:
    return f"""Command: `{command}` ({time.strftime('%Y-%m-%d')}, 2-core CPU machine, one local Ray instance)

A {r['steps']}-step job (tiny GPT, ZeRO-2, 2 workers, checkpoint every {r['every_steps']} steps) while a seeded
injector SIGKILLs a random Ray Train worker process at spread-out steps. Node loss, preemption and regrowth are
exercised by `tests/test_elastic.py`; a frozen worker (SIGSTOP) and a rank blocked in its step by `tests/test_hang.py` (see Hangs below).

| measure | value |
|---|---|
| faults injected (worker SIGKILL) at steps | {r['faults_injected']} |
| faults survived (worker-group restarts) | {r['restarts']} |
| steps lost in all / at most per fault | {r['steps_lost']} / {r['max_steps_lost']} (checkpoint interval {r['every_steps']}) |
| every step done and logged once | {r['steps_done']} |
| largest relative difference of any step's loss, in any life (replays included: {r['executions']} executions), vs an undisturbed run | {r['max_rel_loss_diff']:.2e} |
| kill to new progress, per fault (restart + reload + replay) | {r['recovery_s']} s |
| effective training time (useful step time / wall time) | {r['useful_s']:.1f} s / {r['wall_s']:.1f} s = {r['useful_s'] / r['wall_s']:.1%} |
{r['ledger_rows']}

Wall time includes starting Ray, building the DeepSpeed engines and each restart (about 10-20 s on this machine),
so the effective fraction is low for a short job on 2 cores; each restart costs that fixed time plus the replay
of at most one checkpoint interval.
"""


def _ledger_rows(r: dict[str, Any]) -> str:
    """The platform's goodput account beside this benchmark's, for each job it ran (the undisturbed one too)."""
    out = ""
    for name, run_id, uri, useful, wall in (("undisturbed", r.get("ref_run_id"), r.get("ref_uri"), r.get("ref_useful_s"),
                                             r.get("ref_wall_s")),
                                            ("under faults", r["run_id"], r["uri"], r["useful_s"], r["wall_s"])):
        if run_id:
            g = goodput_check.ledger(uri, run_id)
            out += goodput_check.rows(name, g, goodput_check.agreement(g, useful, wall))
    return out.rstrip("\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--faults", type=int, default=5)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fault-every-s", type=float, default=None,
                    help="kill a worker every this many seconds of wall time instead of --faults at spread steps")
    ap.add_argument("--no-doc", action="store_true", help="print the report only (a short invocation)")
    args = ap.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        with tempfile.TemporaryDirectory() as d:
            if args.fault_every_s:
                r = run_periodic(Path(d), args.fault_every_s, args.steps, args.every, args.seed)
            else:
                r = run_chaos(Path(d), args.faults, args.steps, args.every, args.seed)
            r["ledger_rows"] = _ledger_rows(r)  # while the runs' MLflow store is there
    finally:
        ray.shutdown()
    if args.fault_every_s:
        cmd = (f"python -m benchmarks.chaos --fault-every-s {args.fault_every_s:g} --steps {args.steps} "
               f"--every {args.every} --seed {args.seed}")
        if not args.no_doc:
            update_doc("Effective training time under a fault every 2 minutes", periodic_report(r, cmd))
        print(periodic_report(r, cmd))
        return
    cmd = f"python -m benchmarks.chaos --faults {args.faults} --steps {args.steps} --every {args.every} --seed {args.seed}"
    if not args.no_doc:
        update_doc("Worker kills", report(r, cmd), DOC)
    print(report(r, cmd))


if __name__ == "__main__":
    main()
