"""The goodput account: every second of a job's wall time in exactly one bucket.

Why by hand: neither Ray, DeepSpeed nor MLflow keeps a per-job account of where time went
(Ray's metrics are per process and forget a restarted group; Google's goodput library is tied
to its own TPU job records). This one is built from events Tidal already writes.

The job's wall time runs from its first launch (the driver's start) to its end, across every
restart, resize, preemption and relaunch. The account keeps a cursor: each event, at its time
`ts`, hands out the interval from the cursor to `ts` among the buckets, by what the event says
happened in it, and moves the cursor to `ts`. The shares of one interval are each clamped to
what is left of it, and the last share takes the rest, so the buckets always sum to the time
since the first launch (up to floating-point rounding). An event older than the cursor (read
late) hands out nothing; an event read twice (a tracker restarted while MLflow was down, or
before its mark was saved, reads the log again) is skipped by its id: the account keeps the id
of every event it took that the log may still hold, and forgets an id only once the log has
dropped that event (`forget`, by the tracker), so a re-read of any length is folded once.

Events (their `kind`, tracking/events.py) and the interval each one closes:
- `launched` (driver): queue wait (the admission's seat), then start-up (Ray, trainer). The time
  between a job's launches, when no driver ran, is `other`; a driver that parks its job
  (admission/parking.py) writes one too (`parked`), and the time until its successor's launch
  is `queue` (the job waited in the queue with no driver).
- `group_started` (rank 0, after its setup): the gap before the group's own setup (Ray starting
  the group: start-up; after a resize or a preemption's drain: resize_preemption), its setup
  (start-up: process, imports, engine, group formation) and its restore.
- `metrics` (rank 0, at each log step): evaluation (`eval_s`), the steps since the last one
  (`step_time_s` each) split into replayed (steps at or below the highest step logged before),
  checkpoint stall (the optimizer's waits for a background write, `checkpoint_gate_s`), data
  wait, straggler wait, the slowdown of steps right after a save (their step time over the
  median of recent steps with no save before them: measured, not assumed zero) and productive;
  what is left (the log step's collective, logging) is `other`. A group's first step carries its
  one-time costs (the first collectives' set-up, allocations: 5x a step after a restart here);
  the worker reports it (`first_step_s`) and its excess over the group's next step time moves
  from the step's bucket to start-up, so a replayed step costs what a step costs and a warm-up
  is paid by the restart that caused it (with one step per log interval, at the next one).
- `checkpoint` (rank 0, after a save): the save's stall.
- `hang` (the rank that declared a hang, worker/health/hang.py): the steps finished since the last event
  are lost with the group (replayed); the rest, from the last finished step to the detection and
  the stacks' capture, is the hang, and so is the time until the group's failure (ending it).
- `failure` (controller): the steps since the last event are lost with the group (replayed);
  a gap well over the job's interval between events (HANG_RATIO times it, and HANG_MIN_S more)
  is a hang, the rest of it (a hang no `hang` event declared: a fixed failure.step_timeout_s
  that Ray Train's own timeout ends, an older worker). A group that failed before its
  `group_started` (a kill inside its restore): the time since the last event is start-up.
- `group_ending` (rank 0: admission's resize, a straggler's node out or back, a preemption's
  drain): the time until the next group starts is resize_preemption; so is the gap before a group
  of another size that follows a running one with no failure (Ray Train's elastic regrowth).
  A drain withdrawn (its deadline passed, the node kept, the same group trains on): the wait, up
  to its next log step, is resize_preemption too.
- `group_ended` (driver: Ray Train's `fit()` returned, the group is gone): the group's end since
  the last event is resize_preemption after a resize's ending, else `other`.

Worker-seconds (and cost) are seconds times the workers held: a group's workers from its
`group_started` to its `failure` or `group_ended`, none between groups (Ray starting a group,
a suspended job's wait for its seat) nor between launches (the workers went with their driver).
- the job's end (`finish`): the last save's upload and the group's teardown are `other`.
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

BUCKETS = ("productive", "replayed", "queue", "startup", "restore", "checkpoint_stall", "post_save_slowdown",
           "data_wait", "eval", "straggler_wait", "hang", "resize_preemption", "other")
HANG_RATIO = 3.0  # a gap before a failure longer than this many expected intervals...
HANG_MIN_S = 5.0  # ...and this many seconds more than one is a hang
BASELINE_KEEP = 20  # recent clean step times the post-save slowdown is measured against
RESIZE_REASONS = ("resize", "straggler", "preemption")  # a group_ending reason whose gap is resize_preemption
# TIDAL_GOODPUT=0 in the driver's environment: the job's tracker keeps no account (no `goodput*`
# metric, gauge or summary line). For measuring what the account costs (benchmarks.goodput_overhead).
OFF_VAR = "TIDAL_GOODPUT"


def kept() -> bool:
    """Whether this process's tracker keeps the goodput account (the default)."""
    return os.environ.get(OFF_VAR, "1") != "0"


def _zeros() -> dict[str, float]:
    return dict.fromkeys(BUCKETS, 0.0)


@dataclass
class State:
    """The account so far; JSON-serialisable (`asdict`, `State.load`): the tracker keeps it in its mark."""

    start: float | None = None  # the first launch (s since the epoch)
    cursor: float | None = None  # time up to which every second is in a bucket
    end: float | None = None  # the job's end, once finished
    seconds: dict[str, float] = field(default_factory=_zeros)
    worker_s: dict[str, float] = field(default_factory=_zeros)  # seconds x workers held
    cost: dict[str, float] = field(default_factory=_zeros)
    unpriced: dict[str, float] = field(default_factory=_zeros)  # worker-seconds before any price was known
    price: float | None = None  # per worker-hour, from the nodes' price labels (the latest group's)
    priced: bool = False  # whether any price was ever known
    world: int = 0  # workers held now (0 while no group runs)
    mode: str = "new"  # new, launching, running, hung, failed, ending, ended
    ending: str = ""  # why the group is ending (a group_ending reason)
    last_step: int = 0  # the last step logged by this group (its resume step at first)
    reported: int = 0  # the highest step ever logged
    step_time: float = 0.0  # the last interval's seconds per step
    last_train: float = 0.0  # the last interval's training seconds (what a failure's gap is held against)
    after_save: bool = False  # the last event of this group was a save
    clean: list[float] = field(default_factory=list)  # recent step times with no save before them
    restarts: int = 0
    launches: int = 0
    replayed_steps: int = 0
    step_s: float = 0.0  # step time of first executions (what a benchmark counting step times sees)
    first_due: bool = False  # the group's first timed step is still to be logged
    warm_held: list[Any] = field(default_factory=list)  # [bucket, seconds it may give, first step's s]
    seen: set[str] = field(default_factory=set)  # ids of the events taken that the log may still hold

    @classmethod
    def load(cls, data: dict[str, Any] | None) -> State:
        if not data:
            return cls()
        names = set(cls.__dataclass_fields__)
        state = cls(**{k: v for k, v in data.items() if k in names})
        state.seen = set(state.seen)
        for d in (state.seconds, state.worker_s, state.cost, state.unpriced):
            for b in BUCKETS:  # a bucket a later Tidal added
                d.setdefault(b, 0.0)
        return state

    def dump(self) -> dict[str, Any]:
        return {**asdict(self), "seen": sorted(self.seen)}

    @property
    def wall(self) -> float:
        return 0.0 if self.start is None or self.cursor is None else self.cursor - self.start

    @property
    def goodput(self) -> float | None:
        """Productive seconds over the wall time so far; None before any time has passed."""
        return self.seconds["productive"] / self.wall if self.wall > 0 else None


def fold(state: State, entry: dict[str, Any]) -> State:
    """Take one event log entry (`kind`, `ts` in ms, `step`, `values`, ...); returns `state`, changed."""
    eid = entry.get("id")
    if eid is not None:
        if eid in state.seen:
            return state
        state.seen.add(eid)
    ts = float(entry.get("ts", 0)) / 1000
    if state.mode == "ended" and ts <= (state.end or 0.0):  # from before the end, read after it: spent already
        return state
    kind = entry.get("kind") or ("checkpoint" if "checkpoint_bytes" in entry.get("values", {}) else "metrics")
    values = entry.get("values") or {}
    if kind == "launched":
        _launched(state, ts, float(values.get("t0", ts)), float(values.get("queue_s", 0.0)), bool(values.get("parked")))
        return state
    if state.start is None:  # a log from before launches were recorded: the account starts here
        state.start = state.cursor = ts
    handler = {"group_started": _group_started, "metrics": _metrics, "checkpoint": _checkpoint,
               "hang": _hang, "failure": _failure, "group_ending": _group_ending,
               "group_ended": _group_ended}.get(kind)
    if handler is not None:
        handler(state, ts, entry, values)
    return state


def forget(state: State, ids: set[str]) -> None:
    """Events the log no longer holds (sent and dropped): they cannot be read again."""
    state.seen -= ids


def finish(state: State, now: float) -> State:
    """The job's end (or a launch's): the time since the last event is `other`."""
    if state.start is None or state.mode == "ended":  # nothing ran since the last end (a finished job run again)
        return state
    _spend(state, _take(state, now), [], "other")
    state.mode, state.end, state.world = "ended", state.cursor, 0
    return state


# --- one handler per kind ----------------------------------------------------------------
def _launched(state: State, ts: float, t0: float, queue_s: float, parked: bool = False) -> None:
    state.launches += 1
    if state.start is None:
        state.start = state.cursor = t0
    else:  # a relaunch: no driver ran since the last event, and no workers outlive their driver
        state.world = 0
        _spend(state, _take(state, t0), [], "queue" if state.mode == "parked" else "other")
    state.world, state.mode = 0, "parked" if parked else "launching"
    span = _take(state, ts)
    _spend(state, span, [("queue", queue_s)], "startup")


def _group_started(state: State, ts: float, entry: dict[str, Any], values: dict[str, Any]) -> None:
    span = _take(state, ts)
    restore_s, setup_s = float(values.get("restore_s", 0.0)), float(values.get("setup_s", 0.0))
    before = max(0.0, span - restore_s - setup_s)  # Ray starting the group, under the old state's workers
    world = int(values.get("world", state.world) or state.world)
    # Ray Train's own elastic resize (a node came back) ends a running group with no failure: a resize too.
    resized = state.mode == "running" and bool(state.world) and world != state.world
    gap = ("resize_preemption" if resized or (state.mode == "ending" and state.ending in RESIZE_REASONS)
           else "startup")
    _spend(state, before, [], gap)
    state.world = world
    _spend(state, span - before, [("restore", restore_s)], "startup")
    state.mode, state.ending = "running", ""
    state.last_step = int(entry.get("step", 0))
    state.after_save, state.clean = False, []
    state.first_due, state.warm_held = True, []


def _metrics(state: State, ts: float, entry: dict[str, Any], v: dict[str, Any]) -> None:
    span = _take(state, ts)
    step = int(entry.get("step", 0))
    if v.get("world_size"):
        state.world = int(v["world_size"])
    if v.get("cost_per_hour") is not None and state.world:
        _set_price(state, float(v["cost_per_hour"]) / state.world)
    n = max(0, step - state.last_step)
    st = _num(v.get("step_time_s"))
    warm = st is None  # every step of the interval was a warm-up step (compilation): start-up
    st = st or 0.0
    eval_s = min(_num(v.get("eval_s")) or 0.0, span)
    # a compiled model's warm-up steps beside timed ones: left out of step_time_s, their time is start-up
    warm_n = 0 if warm else min(n, int(_num(v.get("warmup_steps")) or 0))
    warm_s = min(_num(v.get("warmup_s")) or 0.0, span - eval_s) if warm_n else 0.0
    train = min((n - warm_n) * st, span - eval_s - warm_s)
    replay_n = max(0, min(step, state.reported) - state.last_step)
    timed = n - warm_n  # the warm-up steps come first: a restart's replayed steps are warm-up first
    replay = train * max(0, replay_n - warm_n) / timed if timed else 0.0
    fresh = train - replay
    baseline = statistics.median(state.clean) if state.clean else None
    parts = {"checkpoint_stall": _num(v.get("checkpoint_gate_s")) or 0.0,  # the optimizer waited for a write
             "data_wait": n * (_num(v.get("data_wait_s")) or 0.0),
             "straggler_wait": n * (_num(v.get("straggler_wait_s")) or 0.0),
             "post_save_slowdown": n * max(0.0, st - baseline) if state.after_save and baseline is not None else 0.0}
    left = fresh
    for name, want in parts.items():  # each out of the first executions' step time, never beyond it
        parts[name] = min(max(0.0, want), left)
        left -= parts[name]
    # A drain whose deadline passed with the node kept (withdrawn): the wait was the preemption's.
    withdrawn = state.mode == "ending" and state.ending in RESIZE_REASONS
    rest = "resize_preemption" if withdrawn else "startup" if warm or state.mode != "running" else "other"
    _spend(state, span, [("eval", eval_s), ("startup", warm_s), ("replayed", replay), *parts.items(),
                         ("productive", left)], rest)
    state.step_s += fresh
    state.replayed_steps += replay_n
    state.reported = max(state.reported, step)
    if timed and not warm:
        _first_step(state, _num(v.get("first_step_s")), timed, st,
                    ("replayed", replay) if replay_n > warm_n else ("productive", left))
        state.step_time, state.last_train = st, train
        if not state.after_save:
            state.clean = [*state.clean[-(BASELINE_KEEP - 1):], st]
    state.last_step, state.after_save, state.mode = step, False, "running"


def _checkpoint(state: State, ts: float, entry: dict[str, Any], values: dict[str, Any]) -> None:
    _spend(state, _take(state, ts), [], "checkpoint_stall")
    state.after_save = True


def _hang(state: State, ts: float, entry: dict[str, Any], values: dict[str, Any]) -> None:
    span = _take(state, ts)
    if state.mode != "running":  # read after the group's failure (late): nothing more to hand out
        _spend(state, span, [], "hang")
        return
    finished = max(0, int(entry.get("step", state.last_step)) - state.last_step)
    _spend(state, span, [("replayed", finished * state.step_time)], "hang")
    state.mode, state.warm_held = "hung", []


def _failure(state: State, ts: float, entry: dict[str, Any], values: dict[str, Any]) -> None:
    span = _take(state, ts)
    restarted = not entry.get("final")  # the failure Ray Train gives up on restarts nothing
    if state.mode == "hung":  # declared by a rank: until the group ended, the hang's cost
        state.restarts += restarted
        _spend(state, span, [], "hang")
        state.mode, state.world = "failed", 0
        return
    if state.mode == "ending" and state.ending in RESIZE_REASONS:  # Ray ending a drained group
        _spend(state, span, [], "resize_preemption")
        state.world = 0
        return
    state.restarts += restarted
    if state.mode in ("failed", "launching"):  # a group that failed before it was set up: its start
        _spend(state, span, [], "startup")  # (Ray starting it, its setup, a restore a kill cut short)
        state.mode, state.warm_held, state.world = "failed", [], 0
        return
    # The steps trained since the last event are lost with the group: they are trained again.
    expected = max(state.last_train, state.step_time)
    lost = min(span, expected) if state.mode == "running" else 0.0
    hung = span > HANG_RATIO * expected and span - expected > HANG_MIN_S and state.mode == "running"
    _spend(state, span, [("replayed", lost)], "hang" if hung else "other")
    state.mode, state.warm_held, state.world = "failed", [], 0  # until the next group starts, none held


def _group_ending(state: State, ts: float, entry: dict[str, Any], values: dict[str, Any]) -> None:
    _spend(state, _take(state, ts), [], "other")
    state.mode, state.ending = "ending", str(entry.get("reason", ""))


def _group_ended(state: State, ts: float, entry: dict[str, Any], values: dict[str, Any]) -> None:
    """The driver saw the group end (fit() returned): its workers are released here."""
    resizing = state.mode == "ending" and state.ending in RESIZE_REASONS
    _spend(state, _take(state, ts), [], "resize_preemption" if resizing else "other")
    state.world, state.warm_held = 0, []
    if state.mode == "running":
        state.mode, state.ending = "ending", ""


def _first_step(state: State, first: float | None, n: int, st: float, given: tuple[str, float]) -> None:
    """A group's first step's excess over its steady step time moves to start-up (see the module's doc).

    `given`: the bucket this interval's steps went to and how much it got (the most that can move).
    The steady time is the interval's other steps; with one step per interval, the next interval's.
    """
    if state.warm_held:  # the last interval was the first step alone: this one is the reference
        bucket, most, held = state.warm_held
        _move(state, bucket, "startup", min(most, held - st))
        state.warm_held = []
    if not state.first_due or first is None:
        return
    state.first_due = False
    bucket, most = given
    if n > 1:
        _move(state, bucket, "startup", min(most, first - (n * st - first) / (n - 1)))
    else:
        state.warm_held = [bucket, most, first]


# --- bookkeeping ------------------------------------------------------------------------
def _take(state: State, ts: float) -> float:
    """The seconds from the cursor to `ts` (none for an event older than the cursor); moves the cursor."""
    if state.cursor is None:
        state.start = state.cursor = ts
        return 0.0
    span = max(0.0, ts - state.cursor)
    state.cursor = max(state.cursor, ts)
    return span


def _spend(state: State, span: float, shares: list[tuple[str, float]], rest: str) -> None:
    """Hand out `span` seconds: each share in turn, clamped to what is left; the rest to `rest`."""
    left = span
    for bucket, want in shares:
        got = min(max(0.0, want), left) if math.isfinite(want) else 0.0
        _add(state, bucket, got)
        left -= got
    _add(state, rest, left)


def _add(state: State, bucket: str, seconds: float) -> None:
    if seconds <= 0:
        return
    state.seconds[bucket] += seconds
    ws = seconds * state.world
    state.worker_s[bucket] += ws
    if state.price is None:
        state.unpriced[bucket] += ws
    else:
        state.cost[bucket] += ws / 3600 * state.price


def _move(state: State, src: str, dst: str, seconds: float) -> None:
    """Move seconds already handed out (to the current group's workers) from one bucket to another."""
    seconds = min(max(0.0, seconds), state.seconds[src]) if math.isfinite(seconds) else 0.0
    if seconds <= 0:
        return
    ws = min(seconds * state.world, state.worker_s[src])
    book, amount = (state.unpriced, ws) if state.price is None else (state.cost, ws / 3600 * state.price)
    amount = min(amount, book[src])
    for d, a in ((state.seconds, seconds), (state.worker_s, ws), (book, amount)):
        d[src] -= a
        d[dst] += a


def _set_price(state: State, per_worker_hour: float) -> None:
    """The latest group's price; worker-seconds spent before any price was known take the first one."""
    if not math.isfinite(per_worker_hour):
        return
    state.price, state.priced = per_worker_hour, True
    for b, ws in state.unpriced.items():
        state.cost[b] += ws / 3600 * per_worker_hour
    state.unpriced = _zeros()


def _num(v: Any) -> float | None:
    """A finite number, or None (a missing value; NaN: a log interval of warm-up steps only)."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None
