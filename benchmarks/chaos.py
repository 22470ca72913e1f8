"""Chaos: a job of a few hundred steps while worker processes are SIGKILLed at seeded random
times. Reports faults injected and survived, steps lost per fault, and effective training time
(useful step time / wall time), and checks the losses against an undisturbed run.

    python -m benchmarks.chaos [--faults 5] [--steps 300] [--seed 0]   # writes docs/reliability.md
    python -m benchmarks.chaos --fault-every-s 120 --steps 12000 --every 100
        # a fault every 2 minutes of wall time, no reference run; a section of docs/benchmarks.md
    python -m benchmarks.chaos --fault-every-s 120 --steps 2000 --every 50 --memory-pairs 4 [--memory-every 5]
        # the same with the memory tier on and off, in alternating pairs; a section of docs/benchmarks.md
    python -m benchmarks.chaos --fault-every-s 45 --steps 1500 --every 50 --in-place-pairs 4 [--memory-every 10]
        # failure.replace_in_place on and off, in alternating pairs, against the same job with no fault
        # (and its losses, bit for bit); a section of docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import ray

from benchmarks import goodput_check
from benchmarks.common import in_turn, paired_rounds, update_doc
from tidal.testing.chaos import run_chaos, run_periodic
from tidal.testing.timeline import markdown_rows

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

A {r['steps']}-step job (tiny GPT, ZeRO-2, 2 workers, checkpoint every {r['every_steps']} steps; the memory tier off, so
restores read storage: `chaos_spec`) while a seeded
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
    if r.get("timeline") is not None:  # the ledger against the harness's own clock, not the same step times
        out += markdown_rows("under faults", r["timeline"], goodput_check.ledger(r["uri"], r["run_id"]))
    return out.rstrip("\n")


def keep(r: dict[str, Any], path: Path) -> None:
    """The harness's timeline and the ledger's final figures as JSON, to derive the rows again later."""
    path.write_text(json.dumps({"timeline": asdict(r["timeline"]),
                                "ledger": goodput_check.ledger(r["uri"], r["run_id"])}))


MEMORY_KINDS = ("memory", "storage")


def memory_pairs(args: argparse.Namespace) -> str:
    """The periodic job with the memory tier on and off, alternating; each run's effective time,
    steps replayed and the platform's account beside the benchmark's."""
    def measure(i: int, kind: str) -> dict[str, Any]:
        with tempfile.TemporaryDirectory() as d:
            r = run_periodic(Path(d), args.fault_every_s, args.steps, args.every, args.seed + i,
                             args.memory_every if kind == "memory" else None)
            g = goodput_check.ledger(r["uri"], r["run_id"])
            agree = goodput_check.agreement(g, r["useful_s"], r["wall_s"])
        return {f"{kind}_{k}": v for k, v in {
            "effective": r["useful_s"] / r["training_wall_s"], "faults": len(r["faults"]),
            "lost": r["steps_lost"], "done": r["steps_done"], "ledger": agree}.items()}

    rounds = paired_rounds(
        args.memory_pairs, MEMORY_KINDS, measure,
        lambda r: {"gain": r["memory_effective"] - r["storage_effective"]},
        lambda i, r: (f"pair {i + 1}: memory {r['memory_effective']:.1%} ({r['memory_faults']} faults, "
                      f"{r['memory_lost']} steps replayed), storage {r['storage_effective']:.1%} "
                      f"({r['storage_faults']} faults, {r['storage_lost']} replayed)"))
    rows = "\n".join(
        f"| {i + 1} | {r['memory_effective']:.1%} / {r['storage_effective']:.1%} | {r['memory_faults']} / "
        f"{r['storage_faults']} | {r['memory_lost']} / {r['storage_lost']} | "
        f"{'yes' if r['memory_done'] and r['storage_done'] else 'NO'} | {goodput_check.said(r['memory_ledger'])} / "
        f"{goodput_check.said(r['storage_ledger'])} |" for i, r in enumerate(rounds))
    med = {k: statistics.median(r[f"{k}_effective"] for r in rounds) for k in MEMORY_KINDS}
    cmd = (f"python -m benchmarks.chaos --fault-every-s {args.fault_every_s:g} --steps {args.steps} --every {args.every} "
           f"--memory-pairs {args.memory_pairs} --memory-every {args.memory_every} --seed {args.seed}")
    return f"""Command: `{cmd}` ({time.strftime('%Y-%m-%d')}, 2-core CPU machine, one local Ray instance)

The periodic chaos job ({args.steps} steps, tiny GPT, ZeRO-2, 2 workers, log every step, a persistent checkpoint
every {args.every} steps) with a Ray Train worker SIGKILLed every {args.fault_every_s:.0f} s of wall time from its first
step, with `checkpoint.memory: {{every_steps: {args.memory_every}}}` (memory) and without (storage), alternating,
each pair in turn (pair i's kills drawn with seed {args.seed} + i in both kinds). Effective training time: useful
step time (each step once, from MLflow) over the wall time from the first step to the last.

| pair | effective time, memory / storage | faults | steps replayed | every step once | the platform's account against the benchmark's (buckets summed / wall; effective), memory / storage |
|---|---|---|---|---|---|
{rows}

Medians: **{med['memory']:.1%}** with the memory tier, {med['storage']:.1%} without (goal: at least 95% with it).
"""


IN_PLACE_KINDS = ("in_place", "restart")


def _lost_s(g: dict[str, float]) -> float:
    """The ledger's seconds not productive: every bucket but productive, as it booked them."""
    return g.get("goodput_wall_s", 0.0) - g.get("goodput_productive_s", 0.0)


def in_place_run(tmp: Path, args: argparse.Namespace, seed: int, in_place: bool,
                 expected: dict[int, float] | None, period_s: float | None) -> dict[str, Any]:
    """One periodic run (no fault with `period_s` None) and what the platform's ledger said of it."""
    r = run_periodic(tmp, period_s, args.steps, args.every, seed, args.memory_every, in_place, expected)
    g = goodput_check.ledger(r["uri"], r["run_id"])
    r.update(effective=r["useful_s"] / r["training_wall_s"], ledger=g, lost_s=_lost_s(g),
             costs=goodput_check.fault_costs(r["uri"], r["run_id"]),
             agree=goodput_check.agreement(g, r["useful_s"], r["wall_s"]))
    return r


def in_place_pairs(args: argparse.Namespace) -> str:
    """The periodic job with failure.replace_in_place on and off, alternating, beside the same job with
    no fault (run first: its losses are the ones every execution of every step must equal, bit for
    bit). Per fault, the ledger's cost (goodput_check.fault_costs)."""
    with tempfile.TemporaryDirectory() as d:
        ref = in_place_run(Path(d), args, args.seed, False, None, None)
    expected = dict(ref["lives"])
    print(f"no fault: effective {ref['effective']:.1%}, the ledger's goodput {ref['ledger'].get('goodput', 0):.1%}, "
          f"not productive {ref['lost_s']:.1f} s, wall {ref['wall_s']:.0f} s", flush=True)

    def measure(i: int, kind: str) -> dict[str, Any]:
        with tempfile.TemporaryDirectory() as d:
            r = in_place_run(Path(d), args, args.seed + i, kind == "in_place", expected, args.fault_every_s)
        r.pop("lives")
        return {kind: r}

    rounds = paired_rounds(
        args.in_place_pairs, IN_PLACE_KINDS, measure,
        lambda r: {"gain": r["in_place"]["effective"] - r["restart"]["effective"]},
        lambda i, r: f"pair {i + 1}: " + "; ".join(
            f"{k} {r[k]['effective']:.1%}, {len(r[k]['faults'])} faults at {r[k]['faults']}, ledger {r[k]['costs']} s "
            f"a fault, kill to progress {r[k]['recovery_s']} s, survivors kept {r[k]['survivors_kept']}, "
            f"{r[k]['loss_mismatches']} losses off, steps once {r[k]['steps_done']}" for k in IN_PLACE_KINDS))
    return in_place_report(args, ref, rounds)


def _kept(r: dict[str, Any]) -> str:
    k = r["survivors_kept"]
    return f"{sum(k)} of {len(k)}" if len(k) == len(r["faults"]) else f"{sum(k)} of {len(k)} ({len(r['faults'])} kills)"


def in_place_report(args: argparse.Namespace, ref: dict[str, Any], rounds: list[dict[str, Any]]) -> str:
    rows = "\n".join(
        f"| {i + 1} | {k.replace('_', ' ')} | {len(r[k]['faults'])} | {', '.join(f'{x:g}' for x in r[k]['costs'])} | "
        f"{', '.join(f'{x:g}' for x in r[k]['recovery_s'])} | {_kept(r[k])} | {r[k]['effective']:.1%} | "
        f"{r[k]['ledger'].get('goodput', 0):.1%} | {r[k]['steps_lost']} | {r[k]['loss_mismatches']} of "
        f"{r[k]['executions']} | {'yes' if r[k]['steps_done'] else 'NO'} |"
        for i, r in enumerate(rounds) for k in in_turn(i, *IN_PLACE_KINDS))
    med = {k: {"cost_s": statistics.median([c for r in rounds for c in r[k]["costs"]] or [math.nan]),
               "effective": statistics.median(r[k]["effective"] for r in rounds)} for k in IN_PLACE_KINDS}
    cmd = (f"python -m benchmarks.chaos --fault-every-s {args.fault_every_s:g} --steps {args.steps} --every {args.every} "
           f"--in-place-pairs {args.in_place_pairs} --memory-every {args.memory_every} --seed {args.seed}")
    return f"""Command: `{cmd}` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()}-core CPU machine, one local Ray instance,
**the machine shared with other work**: load average {os.getloadavg()[0]:.1f} at the end)

The periodic chaos job ({args.steps} steps, tiny GPT d64 L2, ZeRO-2, 2 workers, log every step, a checkpoint every
{args.every} steps, a memory snapshot every {args.memory_every}) with a Ray Train worker SIGKILLed every
{args.fault_every_s:g} s of wall time from its first step (pair i's victims drawn with seed {args.seed} + i),
`failure.replace_in_place` on (in place) and off (Ray Train's full restart), alternating which goes first, after the
same job with no fault (the switch off): its effective time {ref['effective']:.1%}, the ledger's goodput
{ref['ledger'].get('goodput', 0):.1%}, {ref['lost_s']:.1f} s not productive in {ref['wall_s']:.0f} s.

Per fault, the ledger's cost: the growth of the job's own account's seconds not productive (its running
`goodput_so_far` and `goodput_so_far_wall_s`) from the last step before the fault to the first past it, less an
ordinary step's (`benchmarks.goodput_check.fault_costs`). Kill to progress:
from the kill to the first step past the highest logged before it (MLflow's timestamps). Survivors kept: kills after
which every other worker's pid was still there once rank 0 traced a step after the kill. Losses: every execution of
every step (replays included, rank 0's loss trace) against the undisturbed run's, counted if not bit for bit equal.
Effective: useful step time (each step once, MLflow) over the wall time from the first step to the last.

| pair | kind | faults | ledger's cost per fault | kill to progress, s | survivors kept | effective | ledger's goodput | steps replayed | losses off | every step once |
|---|---|---|---|---|---|---|---|---|---|---|
{rows}

Medians: per fault (every fault of the side) **{med['in_place']['cost_s']:.1f} s in place, {med['restart']['cost_s']:.1f} s full
restart**; effective time (over the pairs) **{med['in_place']['effective']:.1%} / {med['restart']['effective']:.1%}** against
{ref['effective']:.1%} with no fault.
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--faults", type=int, default=5)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fault-every-s", type=float, default=None,
                    help="kill a worker every this many seconds of wall time instead of --faults at spread steps")
    ap.add_argument("--no-doc", action="store_true", help="print the report only (a short invocation)")
    ap.add_argument("--memory-pairs", type=int, default=0,
                    help="with --fault-every-s: this many alternating pairs, memory tier on and off")
    ap.add_argument("--memory-every", type=int, default=5, help="checkpoint.memory.every_steps of --memory-pairs")
    ap.add_argument("--keep", type=Path, default=None,
                    help="write the harness's timeline and the ledger's figures to this JSON file (--faults runs)")
    ap.add_argument("--in-place-pairs", type=int, default=0,
                    help="with --fault-every-s: this many alternating pairs, failure.replace_in_place on and off, "
                    "after the same job with no fault")
    args = ap.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    if args.in_place_pairs:
        try:
            body = in_place_pairs(args)
        finally:
            ray.shutdown()
        print(body)
        if not args.no_doc:
            update_doc("Effective training time under a periodic worker kill: replaced in place against the full restart",
                       body)
        return
    if args.memory_pairs:
        try:
            body = memory_pairs(args)
        finally:
            ray.shutdown()
        print(body)
        if not args.no_doc:
            update_doc("Effective training time under a fault every 2 minutes: memory tier on and off", body)
        return
    try:
        with tempfile.TemporaryDirectory() as d:
            if args.fault_every_s:
                r = run_periodic(Path(d), args.fault_every_s, args.steps, args.every, args.seed)
            else:
                r = run_chaos(Path(d), args.faults, args.steps, args.every, args.seed)
            r["ledger_rows"] = _ledger_rows(r)  # while the runs' MLflow store is there
            if args.keep and r.get("timeline") is not None:
                keep(r, args.keep)
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
