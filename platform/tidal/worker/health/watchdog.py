"""A step-time watchdog: a worker that finishes no step for too long ends its group, so Ray
restarts it from the last checkpoint instead of hanging forever.

A rank stuck in a collective (a peer frozen, a NIC gone quiet) never returns to Python, and
gloo/NCCL timeouts are long or absent. Ray only restarts a group when a worker dies, so the
watchdog makes the stuck worker die: a daemon thread checks the time since the last finished
step and calls os._exit, which no blocked C++ call can hold up. Before it exits, the group's
hang is explained (worker/health/hang.py): which rank stopped, where the others wait, every rank's stacks.
When the verdict replaces the hang's ended culprits in place (failure.replace_in_place), the rank does
not exit: it stands by while its training thread re-forms the group (`_stand_by`).

How long is too long adapts to the job by default (`step_deadline`): a multiple of its own
slowest recent step, never under a floor, so a job of 0.1 s steps is found hung in about the
floor (30 s) instead of the 900 s fixed default this replaced, and a job of 10 s steps is not
taken for hung. A fixed `failure.step_timeout_s` still wins where a user sets one.

A save, an evaluation or a drain is no step: each may rightly take far longer than the step
deadline (a large synchronous checkpoint, a long eval set), and killing a save mid-write wastes
it. So each runs as a `phase` with a deadline of its own, during which the step deadline is
suspended, and which the step times it learns from leave out; a phase past its deadline is hung
like a step, and the message names it.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from tidal.tracking.emitter import Emitter
from tidal.worker.health.heartbeat import Pulse

EXIT_CODE = 70  # EX_SOFTWARE
ARM_AFTER = 2  # step times (between finished steps) before an adaptive deadline is armed: the first
# step (engine warm-up, the first collectives' set-up, compilation) is never one of them
RECENT = 50  # how many recent step times the adaptive deadline looks at
POLL_S = 1.0  # how often the watchdog looks; what it looks at is in memory (a hang's is on storage)
# A group's start (restore, engine build) is the phase "start", under the phase deadline but never past
# this: torch's process-group timeout (30 min by default) would end a collective that waits longer
# without a word, where Tidal names who stopped and saves the stacks.
START_MAX_S = 1500.0
# A hang replaced in place: how long this rank's training thread may take to raise the lost peer's error
# and re-form (which closes this watchdog) before the rank exits as for any hang. Its collective raises in
# milliseconds once the culprit's process is ended; a thread that never does would hang the job unguarded.
REFORM_S = 60.0


@dataclass(frozen=True)
class Deadline:
    """The spec's step deadline: `fixed_s` (failure.step_timeout_s; 0 disables) or, when None,
    `multiple` times the slowest recent step, at least `floor_s`."""

    fixed_s: float | None = None
    multiple: float = 10.0
    floor_s: float = 30.0

    def describe(self, seconds: float) -> str:
        if self.fixed_s is not None:
            return f"failure.step_timeout_s {seconds:g}s"
        return (f"adaptive deadline {seconds:.0f}s: {self.multiple:g}x the slowest recent step, at least "
                f"{self.floor_s:g}s (failure.step_timeout_multiple, step_timeout_floor_s)")


def step_deadline(recent_s: Sequence[float], rule: Deadline, arm_after: int = ARM_AFTER) -> float | None:
    """Seconds without a finished step after which a rank is hung; None: none (disabled).

    `recent_s`: the job's last step times on this rank (seconds between finished steps, phases
    left out). The watchdog's clock starts at a group's first finished step, so none of this
    covers the engine's build. A fixed deadline holds from there; an adaptive one is armed once
    `arm_after` step times are known, and until then is `multiple` times its floor (300 s by
    default: a group's second step may still be warming up, but a hang there is still found)."""
    if rule.fixed_s is not None:
        return rule.fixed_s if rule.fixed_s > 0 else None
    if len(recent_s) < arm_after:
        return rule.multiple * rule.floor_s
    return max(rule.floor_s, rule.multiple * max(recent_s))


@dataclass(frozen=True)
class Phase:
    name: str  # "save", "eval", "drain", "upload" (after the last step)
    deadline_s: float
    started: float  # time.monotonic()


def hung(now: float, last_beat: float | None, timeout_s: float | None, phase: Phase | None) -> str | None:
    """What is hung at `now` (monotonic): the phase's name, "step", or None. `timeout_s` None: no
    step deadline armed."""
    if phase is not None:
        return phase.name if phase.deadline_s > 0 and now - phase.started > phase.deadline_s else None
    if timeout_s is None or last_beat is None:
        return None
    return "step" if now - last_beat > timeout_s else None


class Court(Protocol):
    """Who explains a hang before the watchdog ends its process (worker/health/hang.HangCourt)."""

    trainer: int | None  # the training thread's ident: the one whose stack counts
    replacing: bool  # the last verdict replaces the hang's culprits in place: this rank lives on

    def armed(self) -> None: ...
    def stopped(self, silent: Sequence[int]) -> list[int]: ...
    def answer_if_declared(self, step: int) -> bool: ...
    def wait_for_verdict(self) -> str: ...
    def declare(self, step: int, said: str, stalled_s: float = 0.0, silent: Sequence[int] = ()) -> str: ...


class StepWatchdog:
    def __init__(self, timeout_s: float | None | Deadline, rank: int, events: Emitter, phase_timeout_s: float = 0.0,
                 court: Court | None = None, seed_s: Sequence[float] = (), pulse: Pulse | None = None) -> None:
        """`seed_s`: step times known before this group's first (its resume point's, at the same size):
        the adaptive deadline is armed from the group's second step instead of after the first 300 s.
        `pulse`: the rank's heartbeat (worker/health/heartbeat.py), judged from the first step on."""
        self.rule = timeout_s if isinstance(timeout_s, Deadline) else Deadline(fixed_s=timeout_s)
        self.rank, self.events, self.court = rank, events, court
        self.phase_timeout_s = phase_timeout_s
        self.last_beat: float | None = None  # armed by the first beat: engine build and JIT are slow
        self.recent: deque[float] = deque(seed_s, maxlen=RECENT)
        # From its creation to the first step: the group's start, under a deadline of its own (a hang
        # there used to be found only by torch's 30-minute process-group timeout, with no explanation).
        # failure.phase_timeout_s: 0 (no limit) is the user's word for the start too: a long restore (a
        # universal conversion of a large checkpoint runs outside any collective) must not be cut off.
        start_s = min(phase_timeout_s, START_MAX_S) if phase_timeout_s > 0 else 0.0
        self.current: Phase | None = Phase("start", start_s, time.monotonic())
        self.first = False  # opened(): no step finished yet, the first is under the unarmed deadline
        self.step = 0
        self.pulse = pulse
        self.closed = False
        self.standing_by: float | None = None  # when a verdict to replace in place came (monotonic)
        if self.rule.fixed_s != 0 or pulse is not None:
            threading.Thread(target=self._watch, name="tidal-watchdog", daemon=True).start()

    def beat(self, step: int) -> None:
        if self.court is not None and self.court.trainer is None:
            self.court.trainer = threading.get_ident()  # in a Ray Train worker, not the main thread
        now = time.monotonic()
        if self.current is not None and self.current.name == "start":
            self.current = None
        if self.last_beat is not None and not self.first:  # the group's first step (warm-up) is no step time
            self.recent.append(now - self.last_beat)
        self.step, self.last_beat, self.first = step, now, False

    def opened(self, seed_s: Sequence[float] = ()) -> StepWatchdog:
        """The group's start is over (restore, engine build): its first step runs under the unarmed
        step deadline (step_timeout_multiple x the floor, or the fixed one), and `seed_s` (the resume
        point's step times at this size) arm the adaptive one from the second step."""
        self.recent.extend(seed_s)
        self.current, self.last_beat, self.first = None, time.monotonic(), True
        return self

    def deadline(self) -> float | None:
        return step_deadline([] if self.first else list(self.recent), self.rule)

    @contextmanager
    def phase(self, name: str, deadline_s: float | None = None) -> Iterator[None]:
        """Run `name` under its own deadline (default: failure.phase_timeout_s; 0: none) instead
        of the step deadline, which restarts when the phase ends."""
        self.current = Phase(name, self.phase_timeout_s if deadline_s is None else deadline_s, time.monotonic())
        try:
            yield
        finally:
            self.current = None
            if self.last_beat is not None:
                self.last_beat = time.monotonic()

    def end(self) -> None:
        """Training ended on this rank. What its process still does is no step: the final
        checkpoint's background write, which Ray waits for after the train function returns, and
        the event log's last writes. It runs as the phase "upload" (the phase deadline) for as long
        as the process lives: a step deadline here killed a healthy job's final save mid-write."""
        self.current = Phase("upload", self.phase_timeout_s, time.monotonic())
        if self.pulse is not None:
            self.pulse.end()  # the others' processes may end first: that is no silence

    def close(self) -> None:
        """This rank's group is dissolved (failure.replace_in_place: a peer was lost and the group
        re-forms in this process): judge nothing more, stop the heartbeat, end the watching thread.
        Waiting in the rendezvous is no hang; the next session's watchdog guards the next group."""
        self.closed = True
        self.end()
        if self.pulse is not None:
            self.pulse.close()

    def _watch(self) -> None:
        said = False
        while not self.closed:
            phase = self.current
            fixed = self.rule.fixed_s
            time.sleep(min([POLL_S, *([fixed / 4] if fixed else []),
                            *([phase.deadline_s / 4] if phase and phase.deadline_s > 0 else [])]))
            if self.closed:
                return
            try:
                self._look()
            except Exception as e:  # noqa: BLE001 - a fault in the watchdog must not end it: it guards every step
                if not said:
                    print(f"[tidal] WARNING: rank {self.rank}'s watchdog: {type(e).__name__}: {e}", flush=True)
                    said = True

    def _look(self) -> None:
        if self.standing_by is not None:  # the group re-forms in place: its deadlines are no longer this group's
            if time.monotonic() - self.standing_by > REFORM_S:
                self._exit(f"watchdog: rank {self.rank} did not re-form the group in {REFORM_S:g}s after a hang's "
                           "in-place replacement (failure.replace_in_place)")
            return
        phase = self.current  # read once: the training thread changes it
        deadline, now, last = self.deadline(), time.monotonic(), self.last_beat
        what = hung(now, last, deadline, phase)
        pulse = self.pulse
        silent = pulse.silent() if pulse is not None and (last is not None or phase is not None) else []
        if self.court is not None:
            if last is not None or phase is not None:
                self.court.armed()  # says where this rank runs, once, off the training thread
            # Every rank of a hung group stalls at once: past half its deadline, a rank looks
            # whether another declared the hang, and answers with its stacks.
            since = now - (phase.started if phase is not None else last) if last is not None or phase else 0.0
            limit = (phase.deadline_s if phase is not None else 0.0) or deadline or self.rule.floor_s
            # A heartbeat's hang is declared in seconds: its flag says so at once.
            overdue = since > limit / 2 or (pulse is not None and pulse.declared())
            if what is None and overdue and self.court.answer_if_declared(self.step):
                self._carry_out(self.court.wait_for_verdict())
                return
        if what is None and silent and pulse is not None and self.court is not None:
            silent = self.court.stopped(silent)  # a silence is a hang only where the process is stopped
        if what is None and silent and pulse is not None:
            what = "heartbeat"
            names = f"rank {silent[0]}" if len(silent) == 1 else "ranks " + ", ".join(map(str, silent))
            said = (f"watchdog: {names} gave no heartbeat for {pulse.deadline_s:g}s after step {self.step} "
                    "(failure.heartbeat_timeout_s: stopped, or wedged holding the GIL?)")
            pulse.announce()  # every live rank answers at its next beat
            if self.court is not None:
                said = self.court.declare(self.step, said, now - (last or now), silent)
            self._carry_out(said)
            return
        if what is None:
            return
        if phase is not None:
            said = (f"watchdog: rank {self.rank} spent over {phase.deadline_s:.0f}s in {what} after step {self.step} "
                    "(hung? failure.phase_timeout_s sets this deadline)")
        else:
            said = (f"watchdog: rank {self.rank} finished no step for {deadline:.0f}s after step {self.step} "
                    f"({self.rule.describe(deadline or 0.0)}; stuck in a collective or a dead peer?)")
        if self.court is not None:
            stalled = now - (phase.started if phase is not None else last or now)
            said = self.court.declare(self.step, said, stalled)  # "": another rank declared and says it
        self._carry_out(said)

    def _carry_out(self, said: str | None) -> None:
        """The court's verdict: exit (Ray restarts the group), or, when it replaces the culprits in place,
        stand by for the re-forming (`_stand_by`)."""
        if self.court is not None and self.court.replacing:
            self._stand_by(said)
        else:
            self._exit(said)

    def _stand_by(self, said: str | None) -> None:
        """The hang's culprits are ended and replaced alone (worker/health/decide.py): this rank keeps its
        process. Its training thread, blocked in a collective with them, raises the lost peer's error and
        re-forms the group (worker/loop.py), which closes this watchdog; until then nothing is judged (the
        step or phase deadline runs on while the group re-forms), for REFORM_S at most."""
        if said:
            self.events.say(f"{said}; the silent rank(s) ended and replaced in place (failure.replace_in_place): the "
                            "other ranks keep their processes", self.step)
        self.standing_by = time.monotonic()
        if self.pulse is not None:
            self.pulse.end()  # the ended culprit's beat stays silent: no second hang

    def _exit(self, said: str | None) -> None:
        if said:
            self.events.say(f"{said}; exiting so Ray restarts the group from the last checkpoint", self.step)
        self.events.drain(timeout_s=5.0)  # let the message reach storage; a stuck write must not hold the exit
        os._exit(EXIT_CODE)
