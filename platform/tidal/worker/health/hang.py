"""A hung group, explained before it ends: which rank stopped, where the others wait, and every
rank's stacks, agreed through the job's storage by the ranks' watchdog threads.

A hang stalls every rank of a group at once (collectives are synchronous), so every rank's
watchdog (worker/health/watchdog.py) sees it. The first past its deadline *declares* the hang: it
creates `tidal-hangs/<group>/declared.json` exclusively (tidal/exclusive.py: of two ranks
declaring at the same instant one wins, the other answers). Every rank whose step is overdue by
half its deadline looks for a declaration once a second and *answers* it with its own stacks,
read from its watchdog's thread, which runs while the training thread waits in a collective. A
rank that does not answer within `ANSWER_S` has stopped answering, even if its process lives (a
SIGSTOP stops every thread; a wedged call holding the GIL stops every Python thread): the
declaring rank reads it from outside, on its node (worker/health/stacks.py: py-spy, /proc). Then it
writes the verdict (`explain`, a pure function), emits it (a console line, and a `HangFound`
event the tracker turns into MLflow artifacts, tracking/artifacts.py) and exits; Ray restarts the
group from its last complete checkpoint as after any fault. With failure.replace_in_place, culprits that
stopped answering are ended first and, when decide (worker/health/decide.py) says `replace`, no live rank
exits: their collectives lose the ended ranks and re-form in place (worker/loop.py), the verdict says so. A node whose rank was found the
culprit of two hangs is avoided like a straggler's (worker/health/nodes.py, by the decision
in worker/health/decide.py).

Why the job's storage and no new process: the ranks already share it (event log, checkpoints,
the lease), it survives the group and the driver, and the tracker reads it. Nothing is written
while a group trains but one small file per rank at its start (where it runs); the looking
happens only while a rank's step is overdue. Why not Ray's own hang detection: Ray 2.60's opt-in
NCCL detector confirms a hang after 600 s and does not cover gloo (NOTES-RAY-DEEPSPEED.md).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from tidal.exclusive import create_exclusive
from tidal.storage import RunDir
from tidal.worker.health import stacks
from tidal.worker.health.decide import AVOID_AFTER, Hang, decide
from tidal.worker.health.heartbeat import Pulse, generation_suffix, stopped
from tidal.worker.health.nodes import avoid_hung_node
from tidal.worker.health.watchdog import ARM_AFTER, Deadline, StepWatchdog

HANG_DIR = "tidal-hangs"
NODES_FILE = f"{HANG_DIR}/nodes.json"  # culprit hangs per node id: two make a node avoided
ANSWER_S = 5.0  # how long the declaring rank waits for the others' answers (they look once a second)
VERDICT_S = 45.0  # how long an answering rank waits for the verdict before it exits anyway
# How long the declaring rank reads its silent ranks from outside, all at once: well inside VERDICT_S with
# ANSWER_S, so the answering ranks are still there when the verdict comes (read one after another, 30 s
# each, they were not, and the explanation was lost).
SILENT_READ_S = 30.0
CONFIRM_EVERY_S = 2.0  # how often a watchdog reads its silent peers' processes while their beat stays unheard
STALE_S = 5.0  # a file of this group's is at most this much older than the court's start (clocks, start order)


@dataclass(frozen=True)
class Answer:
    """What one rank said (or, for a silent rank, what was read of it from outside)."""

    rank: int
    node: str = "?"
    node_id: str = ""
    pid: int = 0
    step: int = 0
    silent: bool = False
    in_collective: bool = False
    where: str = ""
    state: str = ""  # a silent rank's process state (/proc)


@dataclass(frozen=True)
class Verdict:
    culprits: tuple[int, ...]
    why: str  # "silent", "outside", "other-collective" or "all-waiting"
    line: str


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def explain(world: int, answers: Mapping[int, Answer]) -> Verdict:
    """Who hung the group, from every rank's answer (`answers` holds silent ranks too, as read
    from outside). A rank that did not answer is the culprit; else one not inside a collective
    (the others wait for it there); else those in another collective than most; else no rank is
    to blame (every rank waits in the same collective: a network fault, a peer outside the job)."""
    def who(r: int) -> str:
        a = answers.get(r, Answer(r))
        return f"rank {r} on node {a.node} (pid {a.pid})"

    everyone = range(world)
    silent = [r for r in everyone if r not in answers or answers[r].silent]
    talking = [r for r in everyone if r not in silent]
    if silent:
        culprits, why = silent, "silent"
        head = "; ".join(f"{who(r)} stopped answering" + (f" ({answers[r].state})" if r in answers and
                                                         answers[r].state else "") for r in silent)
    elif outside := [r for r in talking if not answers[r].in_collective]:
        culprits, why = outside, "outside"
        head = "; ".join(f"{who(r)} is not in a collective: it is in {answers[r].where}" for r in outside)
    else:
        groups: dict[str, list[int]] = {}
        for r in talking:
            groups.setdefault(answers[r].where, []).append(r)
        if len(groups) > 1:
            most = max(groups.values(), key=len)
            culprits, why = sorted(r for g in groups.values() if g is not most for r in g), "other-collective"
            head = "; ".join(f"{who(r)} waits in another collective: {answers[r].where}" for r in culprits)
        else:
            culprits, why = [], "all-waiting"
            head = "every rank waits in the same collective (a network fault, or a peer outside the job?)"
    rest: dict[str, list[int]] = {}
    for r in talking:
        if r not in culprits:
            rest.setdefault(answers[r].where, []).append(r)
    waits = "; ".join(f"{_ranks(rs)} wait{'s' if len(rs) == 1 else ''} in {w}" for w, rs in rest.items())
    return Verdict(tuple(culprits), why, head + (f"; {waits}" if waits else ""))


def group_key() -> str:
    """The same on every rank of one worker group, new for the next: Ray Train sets the
    process group's rendezvous address per group (ray/train/torch/config.py)."""
    return (f"port{os.environ.get('MASTER_PORT', '0')}-{os.environ.get('MASTER_ADDR', 'local').replace(':', '_')}"
            f"{generation_suffix()}")


def _hang_count(nodes: dict[str, Any], culprits: list[Answer]) -> tuple[dict[str, Any], list[Answer]]:
    """The per-node record with this hang's culprits counted in, and the culprits whose node has
    now caused AVOID_AFTER hangs (pure)."""
    nodes = {k: dict(v) for k, v in nodes.items()}
    due = []
    for a in culprits:
        if not a.node_id:
            continue
        entry = nodes.setdefault(a.node_id, {"node": a.node, "hangs": 0})
        entry["hangs"] += 1
        if entry["hangs"] == AVOID_AFTER:
            due.append(a)
    return nodes, due


class HangCourt:
    """One per rank: the hang protocol's reads and writes for this rank's watchdog thread."""

    def __init__(self, storage: str, name: str, rank: int, world: int, events: Any, group: str | None = None,
                 here: Callable[[], tuple[str, str]] | None = None,
                 inspect: Callable[[str, int], dict[str, Any]] = stacks.inspect_on_node,
                 end: Callable[[str, int], str] = stacks.end_on_node,
                 on_culprit_node: Callable[[Answer, int, int], str] | None = None, in_place: bool = False,
                 state: Callable[[str, int], str] = stacks.state_on_node) -> None:
        """`in_place`: failure.replace_in_place (a hang whose silent culprits are ended is a replacement).
        `state`: a process's kernel state on its node (a heartbeat's silence is a hang only when stopped)."""
        self.run = RunDir(storage, name)
        self.rank, self.world, self.events = rank, world, events
        self.group = group or group_key()
        self.dir = f"{HANG_DIR}/{self.group}"
        self.here = here or _ray_here
        self.inspect, self.end, self.on_culprit_node, self.state = inspect, end, on_culprit_node, state
        self.confirmed_at = 0.0  # when `stopped` last read the silent ranks' processes (monotonic)
        self.started = time.time()
        self.answer_s, self.look_every_s = ANSWER_S, 1.0
        self.verdict_s, self.silent_read_s = VERDICT_S, SILENT_READ_S
        self.me: Answer | None = None
        self.answered = False
        self.looked = 0.0
        self.trainer: int | None = None  # the training thread (StepWatchdog.beat's caller): the one whose stack counts
        self.in_place = in_place
        self.replacing = False  # the verdict replaces the culprits in place: this rank lives on (decide's `replace`)

    def _path(self, rel: str) -> str:
        return f"{self.run.path}/{self.dir}/{rel}"

    def _read(self, rel: str) -> dict[str, Any] | None:
        """A file of this group's hang folder, or None when it is an earlier group's: a group's key
        names its rendezvous port, which a later group may reuse, and its stale answers, places and
        verdict must not stand for this group's (a stale place would have its pid read with py-spy)."""
        d = self.run.read_json(f"{self.dir}/{rel}")
        if not d:
            return None
        at = d.get("at")
        fresh = isinstance(at, (int, float)) and not isinstance(at, bool) and at >= self.started - STALE_S
        return d if fresh else None

    def armed(self) -> None:
        """Say where this rank runs (once): a silent rank is then read on its node."""
        if self.me is not None:
            return
        node, node_id = self.here()
        self.me = Answer(self.rank, node, node_id, os.getpid())
        self.run.write_json(f"{self.dir}/rank-{self.rank}.json", {"rank": self.rank, "node": node, "node_id": node_id,
                                                                  "pid": os.getpid(), "host": socket.gethostname(),
                                                                  "at": time.time()})

    def stopped(self, silent: Sequence[int]) -> list[int]:
        """The `silent` ranks (their heartbeat unheard) whose process is stopped on its node: only those are
        a heartbeat's hang (heartbeat.stopped). Read at most every CONFIRM_EVERY_S (a Ray task per rank); a
        rank that cannot be read is not stopped as far as this knows (the step deadline still guards it)."""
        if time.monotonic() - self.confirmed_at < CONFIRM_EVERY_S:
            return []
        self.confirmed_at = time.monotonic()
        out = []
        for r in silent:
            info = self._read(f"rank-{r}.json") or {}
            node_id, pid = info.get("node_id"), stacks.plain_pid(info.get("pid"))
            try:
                if isinstance(node_id, str) and node_id and pid and stopped(self.state(node_id, pid)):
                    out.append(r)
            except Exception:  # noqa: BLE001 - a node gone, Ray busy: no hang declared on a guess
                continue
        return out

    def declaration(self) -> dict[str, Any] | None:
        return self._read("declared.json")  # a reused group key must not find the old hang

    def _stale(self) -> bool:
        """Whether the declaration there is an earlier group's. One being written now (created, not
        yet filled: a local create is not atomic) is not: it is another rank's, of this group."""
        try:
            d = self.run.read_json(f"{self.dir}/declared.json")
        except (OSError, ValueError):
            return False
        return d is not None and float(d.get("at", 0)) < self.started - 5.0

    def answer_if_declared(self, step: int) -> bool:
        """While this rank's step is overdue: if another rank declared a hang, answer it (once)."""
        if self.answered or time.monotonic() - self.looked < self.look_every_s:
            return self.answered
        self.looked = time.monotonic()
        try:
            if self.declaration() is None:
                return False
            self._answer(step)
        except (OSError, ValueError):  # storage hiccup, or a declaration half written: look again next time
            return False
        return True

    def _answer(self, step: int) -> None:
        text, frames = stacks.own_stacks(self.trainer)
        me = self.me or Answer(self.rank, pid=os.getpid())
        self.run.write_json(f"{self.dir}/answer-{self.rank}.json", {
            "rank": self.rank, "node": me.node, "node_id": me.node_id, "pid": me.pid, "step": step,
            "in_collective": stacks.in_collective(frames), "where": stacks.where(frames), "stacks": text,
            "at": time.time()})
        self.answered = True

    def wait_for_verdict(self) -> str:
        """An answering rank waits for the declaring rank's verdict (its exit ends the group; a replace
        in place, `replacing`, keeps this rank's process); if none comes, it exits itself with a line of its own."""
        until = time.monotonic() + self.verdict_s
        while time.monotonic() < until:
            try:
                if (verdict := self._read("verdict.json")) is not None:
                    self.replacing = verdict.get("action") == "replace"
                    return ""  # the declaring rank says it
            except (OSError, ValueError):  # being written: look again
                pass
            time.sleep(0.2)
        return (f"hang: rank {self.rank} answered a hang declared by another rank, which gave no verdict in "
                f"{self.verdict_s:g}s")

    def declare(self, step: int, said: str, stalled_s: float = 0.0, silent: Sequence[int] = ()) -> str:
        """This rank's deadline passed (`stalled_s` after its last finished step): declare the hang,
        or answer another's declaration. Returns the line to say before exiting ("" when another
        rank says it). `silent`: ranks already known to be silent (their heartbeat stopped): their
        answers are not waited for."""
        try:
            won = create_exclusive(self.run.fs, self._path("declared.json"),
                                   {"by": self.rank, "step": step, "at": time.time(), "said": said,
                                    "stalled_s": stalled_s})
            if not won and self._stale():  # an old group's under a reused key
                self.run.write_json(f"{self.dir}/declared.json", {"by": self.rank, "step": step, "at": time.time()})
                won = True
            if not won:
                if not self.answered:
                    self._answer(step)
                return self.wait_for_verdict()
            return self._judge(step, said, stalled_s, silent)
        except Exception as e:  # noqa: BLE001 - explaining a hang must never keep the group hung
            return f"{said} (the hang could not be explained: {type(e).__name__}: {e})"

    def _judge(self, step: int, said: str, stalled_s: float, silent: Sequence[int] = ()) -> str:
        self._answer(step)
        answers = self._collect(silent)
        answers |= self._read_all_silent([r for r in range(self.world) if r not in answers])
        verdict = explain(self.world, answers)
        line = f"hang after step {step}: {verdict.line}"
        folder = f"{self.run.path}/{self.dir}"
        culprits = [answers[r] for r in verdict.culprits]
        avoid, due = self._count(culprits)
        # A replace needs the culprits gone before it is decided; without the switch they are ended after
        # the verdict is written, as before (a survivor's collective raises at their end: Ray restarts the group).
        ended = self.in_place and self._end_silent(culprits)
        action = decide(Hang(self.world, self.in_place, ended, due)).action
        self.replacing = action == "replace"
        self.run.write_json(f"{self.dir}/verdict.json", {"text": line, "culprits": list(verdict.culprits),
                                                         "why": verdict.why, "step": step, "detected": said,
                                                         "action": action, "at": time.time()})
        self.events.hang_found(step, self.dir, list(verdict.culprits), line, stalled_s)
        if not self.in_place:
            self._end_silent(culprits)
        return (f"{line} ({said.removeprefix('watchdog: ')}); every rank's stacks are in the MLflow run's "
                f"artifacts (hangs/{self.group}/) and in {folder}" + (f"; {avoid}" if avoid else ""))

    def _end_silent(self, culprits: list[Answer]) -> bool:
        """End the culprits that stopped answering, once their stacks are saved: Ray's teardown of the
        group gives each worker 5 s to shut down, which a stopped process never does. Whether every
        culprit was silent and is ended (Ray Train then sees lost workers: decide's Hang.ended)."""
        ended = [a for a in culprits if a.silent and a.node_id and a.pid]
        if not ended:
            return False
        # A failure stays in its future, unraised: Ray's teardown ends the process anyway, 5 s later.
        with ThreadPoolExecutor(len(ended), thread_name_prefix="tidal-hang-end") as pool:
            futures = [pool.submit(self.end, a.node_id, a.pid) for a in ended]
        return len(ended) == len(culprits) and all(f.exception() is None and f.result() == "ended" for f in futures)

    def _collect(self, silent: Sequence[int] = ()) -> dict[int, Answer]:
        """The ranks' answers, awaited `answer_s` at most, and not at all from the `silent` ones."""
        until = time.monotonic() + self.answer_s
        answers: dict[int, Answer] = {}
        while True:
            for r in range(self.world):
                if r not in answers and (a := self._read(f"answer-{r}.json")):
                    answers[r] = Answer(r, a.get("node", "?"), a.get("node_id", ""), int(a.get("pid", 0)),
                                        int(a.get("step", 0)), False, bool(a.get("in_collective")), a.get("where", ""))
            if all(r in answers or r in silent for r in range(self.world)) or time.monotonic() >= until:
                return answers
            time.sleep(0.25)

    def _read_all_silent(self, ranks: list[int]) -> dict[int, Answer]:
        """The ranks that did not answer, read at once (each read waits on a Ray task and py-spy), for
        `silent_read_s` at most: a rank not read by then is named with what is known of it."""
        if not ranks:
            return {}
        pool = ThreadPoolExecutor(len(ranks), thread_name_prefix="tidal-hang-read")
        futures = {r: pool.submit(self._read_silent, r) for r in ranks}
        wait(futures.values(), timeout=self.silent_read_s)
        pool.shutdown(wait=False, cancel_futures=True)
        out = {}
        for r, f in futures.items():
            if f.done() and f.exception() is None:
                out[r] = f.result()
            else:
                out[r] = Answer(r, silent=True, state=f"its process could not be read in {self.silent_read_s:g}s")
        return out

    def _read_silent(self, r: int) -> Answer:
        """A rank that did not answer, read from outside on its node, its stacks saved as its answer."""
        info = self._read(f"rank-{r}.json") or {}
        node, node_id, pid = info.get("node", "?"), info.get("node_id", ""), stacks.plain_pid(info.get("pid"))
        a = Answer(r, node if isinstance(node, str) else "?", node_id if isinstance(node_id, str) else "",
                   pid or 0, silent=True)
        if "pid" in info and pid is None:
            state, text = f"the pid it gave ({str(info.get('pid'))[:40]!r}) is not a process id", ""
        elif not a.node_id or not a.pid:
            state, text = "it never said where it runs", ""
        else:
            try:
                seen = self.inspect(a.node_id, a.pid)
                state, text = f"process {seen['state']}", seen["stacks"]
            except Exception as e:  # noqa: BLE001 - a node gone, Ray busy: the verdict still names the rank
                state, text = f"its process could not be read: {type(e).__name__}", ""
        self.run.write_json(f"{self.dir}/answer-{r}.json", {"rank": r, "node": a.node, "node_id": a.node_id,
                                                            "pid": a.pid, "silent": True, "state": state, "stacks": text,
                                                            "at": time.time()})
        return Answer(r, a.node, a.node_id, a.pid, silent=True, state=state)

    def _count(self, culprits: list[Answer]) -> tuple[str | None, bool]:
        """Count this hang against its culprits' nodes; a node at AVOID_AFTER hangs is avoided. The line
        said of it, and whether a node reached that count (only a restart can avoid it)."""
        nodes, due = _hang_count(self.run.read_json(NODES_FILE) or {}, culprits)
        self.run.write_json(NODES_FILE, nodes)
        if self.on_culprit_node is None:
            return None, bool(due)
        on_node = {a.node_id: 0 for a in due}
        for r in range(self.world):  # how many of the group's ranks each such node holds
            info = self._read(f"rank-{r}.json") or {}
            if info.get("node_id") in on_node:
                on_node[info["node_id"]] += 1
        return "; ".join(self.on_culprit_node(a, AVOID_AFTER, on_node[a.node_id]) for a in due) or None, bool(due)


def _ray_here() -> tuple[str, str]:
    import ray

    return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()


def watchdog(spec: Any, rank: int, world: int, events: Any) -> StepWatchdog:
    """A rank's step watchdog (worker/health/watchdog.py) with the spec's deadline, this module's court and
    the rank's heartbeat, in the group's start until `opened` (with its resume point's step times,
    `resumed_step_times`)."""
    f = spec.failure

    def avoid(a: Answer, hangs: int, on_node: int) -> str:
        return avoid_hung_node(spec, world, a.rank, a.node, a.node_id, hangs, on_node, a.step)

    court = HangCourt(spec.checkpoint.storage, spec.name, rank, world, events, on_culprit_node=avoid,
                      in_place=f.replace_in_place)
    pulse = Pulse(rank, world, f.heartbeat_timeout_s) if world > 1 and f.heartbeat_timeout_s > 0 else None
    return StepWatchdog(Deadline(f.step_timeout_s, f.step_timeout_multiple, f.step_timeout_floor_s), rank, events,
                        f.phase_timeout_s, court=court, pulse=pulse)


def resumed_step_times(found: Any, world: int, floor_s: float) -> list[float]:
    """The step time a checkpoint's state recorded (`step_time_s`: its last log interval's), as many
    times as arm the adaptive deadline, when it was trained at `world` workers; none otherwise (another
    size trains at another speed). Why: a hang in a restarted group's first steps took 300 s to find.
    Read from storage, so it may only shorten the unarmed deadline: a step as long as the floor is
    not taken (the deadline it would give is no shorter than the unarmed one)."""
    state = getattr(found, "state", None) or {}
    st = state.get("step_time_s")
    if not isinstance(st, (int, float)) or isinstance(st, bool) or not 0 < st < floor_s or state.get("world_size") != world:
        return []
    return [float(st)] * ARM_AFTER
