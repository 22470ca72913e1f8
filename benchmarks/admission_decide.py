"""How long the team queue's decision takes at the size of a real organisation.

    python -m benchmarks.admission_decide [--sizes 100,300,1000,3000] [--repeats 5] [--no-doc]
    python -m benchmarks.admission_decide --driver-memory [--repeats 4]
    python -m benchmarks.admission_decide --registrations [--repeats 4]

Pure CPU, no Ray: `tidal.admission.policy.decide` on a full cluster. Each size is N jobs, half
running and half waiting, in 10 teams (each guaranteed a tenth of the cluster, and allowed to
borrow as much again) at 3 priorities, 1-8 workers each, a third of them elastic, every job
resizable (the worst case: each waiting job may look for room among every running one). The
cluster's capacity is what the running half holds, so nothing fits without preemption. Each size
is decided `--repeats` times on the same input (the first call included); every time is
reported, with the median. Goal (issue #52): under 0.1 s at 1,000 jobs.

`--registrations`: the admission actor's own calls at 1,000 jobs (in-process, no Ray): how long a
driver's registration, a park (admission/parking.py) and the tick that saves them take, each with
1,000 jobs queued; each repeat a fresh actor. These run under the actor's lock: a burst of 1,000
drivers registering at once waits for the sum.

`--driver-memory`: what a queued job costs the head today, where each queued job is its own
driver process waiting for its seat: the memory (RSS and USS) of a fresh Python after the imports
that driver holds (`tidal.launch.trainer`, Ray Train's driver side), against one that imports only
Ray and the seat (what a light waiting process would hold). Imports only: a connected driver adds
Ray's core worker on top of both. Against them, what a parked job costs (a waiting job whose
driver has left, admission/parking.py): the admission actor's growth per job with 1,000 parked.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from datetime import date
from typing import Any

from tidal.admission.decision import QueuedJob, RunningJob
from tidal.admission.policy import decide
from tidal.admission.quotas import Quotas

SECTION = "The team queue's decision at 100 to 3,000 jobs"
TEAMS = 10
PRIORITIES = ("low", "normal", "high")


def workload(n: int, seed: int = 0) -> tuple[int, list[RunningJob], list[QueuedJob], Quotas]:
    """N jobs on a full cluster: half running (holding all of its capacity), half waiting."""
    rng = random.Random(seed)
    running, queue = [], []
    for i in range(n):
        team, priority = f"team{i % TEAMS}", rng.choice(PRIORITIES)
        hi = rng.randint(1, 8)
        lo = rng.randint(1, hi) if rng.random() < 1 / 3 else hi
        if i % 2 == 0:
            running.append(RunningJob(f"run-{i}", team, priority, lo, hi, hi, last_resize=0.0,
                                      submitted_at=float(i)))
        else:
            queue.append(QueuedJob(f"wait-{i}", team, priority, lo, hi, submitted_at=float(i)))
    capacity = sum(r.slots for r in running)
    share = max(1, capacity // TEAMS)
    quotas = Quotas.model_validate({
        "min_resize_interval_s": 60, "defaults": {"team": "team0"},
        "teams": {f"team{t}": {"onprem": {"guaranteed": share, "borrow": share}} for t in range(TEAMS)}})
    return capacity, running, queue, quotas


def time_decide(n: int, repeats: int) -> tuple[list[float], list[float], int, int]:
    """Seconds per decision, wall and this process's CPU (every repeat; the CPU time is what a
    loaded machine disturbs least), and how many jobs the last decision admitted and touched."""
    capacity, running, queue, quotas = workload(n)
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        d = decide(capacity, running, queue, quotas, now=10_000.0)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return wall, cpu, len(d.admit), len(d.shrink) + len(d.suspend)


PROBE = """
import json, os, psutil
{imports}
m = psutil.Process().memory_full_info()
print(json.dumps({{"rss": m.rss, "uss": m.uss}}))
"""
DRIVERS = {
    "today's queued driver (`tidal run` waiting for its seat)": "import ray\nimport tidal.launch.trainer",
    "a waiting process with only Ray and the seat": "import ray\nimport tidal.admission.seat",
    "Python alone (the floor for any waiting process)": "import time",
}
# What the head holds for a parked job (admission/parking.py): no process, only its entry in the
# admission actor and in the queue document. 1,000 jobs parked behind one running job, in-process.
# An admission actor in-process (no Ray: the Jobs API's calls stood in for) on a cluster of one slot,
# and `reg`, what a driver registers; the probes below start with it.
ACTOR_SETUP = """
import json, os, tempfile, time, psutil, yaml
from tidal.admission.actor import Admitter
n, d = {n}, tempfile.mkdtemp()
quotas = os.path.join(d, "quotas.yaml")
open(quotas, "w").write(yaml.safe_dump({{"capacity": 1, "min_resize_interval_s": 0}}))
a = Admitter(quotas, os.path.join(d, "q.json"), background=False, relauncher=lambda e: "", pinner=lambda s, t: 1,
             stopped=lambda s: False)
def reg(j):
    return {{"job": j, "name": "job", "team": None, "priority": "normal", "min_workers": 1, "max_workers": 1,
            "cpus_per_worker": 1, "gpus_per_worker": 0, "token": "t-" + j, "submission": j}}
"""
PARKED_PROBE = ACTOR_SETUP + """
a.submit(reg("running")); a.tick()
before = psutil.Process().memory_full_info()
for i in range(n):
    j = f"raysubmit_{{i:016x}}"
    a.submit(reg(j))
    assert a.park(j, "t-" + j, j + "-q1")
a.tick()
after = psutil.Process().memory_full_info()
print(json.dumps({{"rss": after.rss - before.rss, "uss": after.uss - before.uss,
                  "doc": os.path.getsize(os.path.join(d, "q.json")), "n": n}}))
"""


def probe(code: str, repeats: int) -> list[dict[str, Any]]:
    """`code` run `repeats` times, each in a fresh interpreter; the JSON each printed last."""
    return [json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                      text=True).stdout.strip().splitlines()[-1]) for _ in range(repeats)]


def parked_memory(repeats: int, n: int = 1000) -> list[str]:
    """Rows for `driver_memory`: the head's memory for `n` parked jobs (the actor's growth)."""
    got = probe(PARKED_PROBE.format(n=n), repeats)
    rss, uss = [g["rss"] / n / 2**10 for g in got], [g["uss"] / n / 2**10 for g in got]
    doc = statistics.median(g["doc"] for g in got) / n
    return [f"| a parked job (no process; admission/parking.py): the admission actor's growth per job, KB, "
            f"{n:,} parked | {', '.join(f'{x:.1f}' for x in rss)} (KB) | {', '.join(f'{x:.1f}' for x in uss)} (KB) | "
            f"{statistics.median(rss) * n / 2**20:.3f} (and {doc:.0f} bytes per job in the queue document) |"]


def driver_memory(repeats: int) -> str:
    """MB of RSS and USS per kind of waiting process, every repeat (each a fresh interpreter)."""
    lines = [f"Command: `python -m benchmarks.admission_decide --driver-memory --repeats {repeats}` ({date.today()}, "
             f"{platform.machine()})", "", "| waiting process | RSS, MB (every run) | USS, MB (every run) | "
             "1,000 queued jobs, GB of RSS |", "|---|---|---|---|"]
    for label, imports in DRIVERS.items():
        got = probe(PROBE.format(imports=imports), repeats)
        rss, uss = [g["rss"] / 2**20 for g in got], [g["uss"] / 2**20 for g in got]
        lines.append(f"| {label} | {', '.join(f'{x:.0f}' for x in rss)} | {', '.join(f'{x:.0f}' for x in uss)} | "
                     f"{statistics.median(rss) * 1000 / 1024:.0f} |")
    return "\n".join(lines + parked_memory(repeats))


REGISTRATIONS = "The admission actor's calls at 1,000 jobs"
REG_PROBE = ACTOR_SETUP + """
for i in range(n):
    a.submit(reg(f"r{{i:05d}}"))
a.tick()
t = time.perf_counter()
for i in range(n, n + 50):
    a.submit(reg(f"r{{i:05d}}"))
sub = (time.perf_counter() - t) / 50
t = time.perf_counter(); a.tick(); tick = time.perf_counter() - t
t = time.perf_counter()
for i in range(n, n + 50):
    assert a.park(f"r{{i:05d}}", f"t-r{{i:05d}}", f"r{{i:05d}}-q1")
park = (time.perf_counter() - t) / 50
print(json.dumps({{"submit": sub, "tick": tick, "park": park}}))
"""


def registrations(repeats: int, n: int = 1000) -> str:
    """ms per registration, per park, and for the tick that saves 50 registrations, at `n` jobs."""
    got = probe(REG_PROBE.format(n=n), repeats)
    cells = {k: [g[k] * 1000 for g in got] for k in ("submit", "park", "tick")}
    rows = "\n".join(f"| {label} | {', '.join(f'{x:.1f}' for x in cells[k])} | **{statistics.median(cells[k]):.1f}** |"
                     for label, k in (("a registration (each of 50)", "submit"), ("a park (each of 50)", "park"),
                                      ("the tick after 50 registrations", "tick")))
    return (f"Command: `python -m benchmarks.admission_decide --registrations --repeats {repeats}` ({date.today()}, "
            f"{platform.machine()}, one Python thread, no Ray; {n:,} jobs queued behind one running)\n\n"
            f"| call | every repeat, ms | median, ms |\n|---|---|---|\n{rows}")


def report(results: dict[int, tuple[list[float], list[float], int, int]], repeats: int) -> str:
    lines = [f"Command: `python -m benchmarks.admission_decide --sizes {','.join(map(str, results))} "
             f"--repeats {repeats}` ({date.today()}, {platform.machine()}, one Python thread, no Ray)", "",
             "| jobs (half running, 10 teams) | every decision, wall ms | median | every decision, CPU ms | median "
             "| admitted / shrunk or suspended |", "|---|---|---|---|---|---|"]
    for n, (wall, cpu, admitted, touched) in results.items():
        lines.append(f"| {n:,} | {', '.join(f'{t * 1000:.1f}' for t in wall)} | **{statistics.median(wall) * 1000:.1f}** "
                     f"| {', '.join(f'{t * 1000:.1f}' for t in cpu)} | {statistics.median(cpu) * 1000:.1f} "
                     f"| {admitted} / {touched} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="100,300,1000,3000")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-doc", action="store_true", help="print only; leave docs/benchmarks.md alone")
    p.add_argument("--driver-memory", action="store_true", help="measure a waiting driver's memory instead")
    p.add_argument("--registrations", action="store_true", help="time the actor's registration, park and tick "
                   "at 1,000 jobs instead")
    args = p.parse_args()
    if args.registrations:
        body = registrations(args.repeats)
        print(body)
        if not args.no_doc:
            from benchmarks.common import update_doc

            update_doc(REGISTRATIONS, body)
        return
    if args.driver_memory:
        print(driver_memory(args.repeats))
        return
    results = {}
    for n in (int(s) for s in args.sizes.split(",")):
        results[n] = time_decide(n, args.repeats)
        print(f"[bench] {n} jobs, wall: " + ", ".join(f"{t:.4f}s" for t in results[n][0]), flush=True)
    body = report(results, args.repeats)
    print(body)
    if not args.no_doc:
        from benchmarks.common import update_doc

        update_doc(SECTION, body)


if __name__ == "__main__":
    main()
