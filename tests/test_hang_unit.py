"""A hung group explained (worker/health/hang.py, worker/health/stacks.py): who is named, from what the ranks
answered; the declaration, the answers and the verdict through a real (local) job folder, two
ranks' courts in this process; a real stopped process read from outside; the files that reach
MLflow. No Ray: the end-to-end runs are tests/test_hang.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import tiny_spec
from tidal.fs import UnsafeName
from tidal.storage import RunDir
from tidal.testing.processes import wait_for
from tidal.tracking.artifacts import hang_files
from tidal.tracking.events import HangFound, parse
from tidal.worker.health import avoidance, nodes, stacks
from tidal.worker.health.hang import Answer, HangCourt, _hang_count, explain

ALL_REDUCE = "all_reduce (torch/distributed/distributed_c10d.py:2950) called from _train_step (tidal/worker/loop.py:201)"
GATHER = "all_gather (torch/distributed/distributed_c10d.py:3400) called from exchange (tidal/worker/logsync.py:40)"


def waiting(rank: int, where: str = ALL_REDUCE, node: str = "10.0.0.1") -> Answer:
    return Answer(rank, node, f"node{rank}", 100 + rank, 57, in_collective=True, where=where)


@pytest.mark.parametrize(("world", "answers", "culprits", "why", "said"), [
    # SIGSTOP: rank 1 never answered; what was read of it from outside is in its answer
    (2, {0: waiting(0), 1: Answer(1, "10.0.0.2", "node1", 101, silent=True, state="process state T (stopped)")},
     (1,), "silent", ["rank 1 on node 10.0.0.2 (pid 101) stopped answering (process state T (stopped))",
                      f"rank 0 waits in {ALL_REDUCE}"]),
    (3, {0: waiting(0), 2: waiting(2)}, (1,), "silent", ["rank 1 on node ? (pid 0) stopped answering",
                                                         f"ranks 0, 2 wait in {ALL_REDUCE}"]),
    # a rank that answers but is not in a collective: the others wait for it
    (2, {0: waiting(0), 1: Answer(1, "10.0.0.2", "n1", 101, where="step (tests/hang_step.py:30)")},
     (1,), "outside", ["rank 1 on node 10.0.0.2 (pid 101) is not in a collective: it is in step (tests/hang_step.py:30)",
                       f"rank 0 waits in {ALL_REDUCE}"]),
    # every rank in a collective, one in another than most
    (3, {0: waiting(0), 1: waiting(1, GATHER), 2: waiting(2)}, (1,), "other-collective",
     [f"rank 1 on node 10.0.0.1 (pid 101) waits in another collective: {GATHER}", f"ranks 0, 2 wait in {ALL_REDUCE}"]),
    # every rank in the same one: nobody to blame
    (2, {0: waiting(0), 1: waiting(1)}, (), "all-waiting", ["every rank waits in the same collective",
                                                            f"ranks 0, 1 wait in {ALL_REDUCE}"]),
])
def test_the_verdict_names_the_rank_that_hung_the_group_and_where_the_others_wait(world, answers, culprits, why, said):
    v = explain(world, answers)
    assert (v.culprits, v.why) == (culprits, why)
    for part in said:
        assert part in v.line, v.line


def test_where_a_stack_waits():
    f = stacks.Frame
    in_collective = [f("/x/tidal/worker/loop.py", 201, "_train_step"),
                     f("/v/site-packages/deepspeed/comm/comm.py", 120, "all_reduce"),
                     f("/v/site-packages/torch/distributed/distributed_c10d.py", 2950, "all_reduce")]
    assert stacks.in_collective(in_collective)
    assert stacks.where(in_collective) == ("all_reduce (torch/distributed/distributed_c10d.py:2950) called from "
                                           "_train_step (tidal/worker/loop.py:201)")
    sleeping = [f("/x/tidal/worker/loop.py", 201, "_train_step"), f("/w/tests/hang_step.py", 30, "step")]
    assert not stacks.in_collective(sleeping)
    assert stacks.where(sleeping) == "step (tests/hang_step.py:30)"


def test_own_stacks_hold_every_thread_and_the_training_threads_frames():
    """In a Ray Train worker the training loop is not the main thread: the stacks name the thread
    whose frames count (the watchdog's beat records it), first."""
    release = threading.Event()

    def training_here() -> None:
        release.wait(10)

    t = threading.Thread(target=training_here, name="train-loop")
    t.start()
    try:
        text, frames = stacks.own_stacks(t.ident)
    finally:
        release.set()
        t.join()
    assert "training_here" in [f.func for f in frames] and frames[-1].func == "wait", frames
    assert text.startswith(f'Thread {t.ident} "train-loop"') and "MainThread" in text, text


def test_a_stopped_process_is_read_from_outside():
    """A SIGSTOPped Python: the kernel says T (stopped); py-spy, installed here, reads its stack."""
    child = subprocess.Popen([sys.executable, "-c", "import time\ndef parked():\n    time.sleep(60)\nparked()"])
    try:
        time.sleep(0.3)
        child.send_signal(signal.SIGSTOP)
        time.sleep(0.1)
        seen = stacks.inspect_process(child.pid)
        assert seen["state"].startswith("state T (stopped)"), seen
        if stacks.py_spy() is not None:
            assert "parked" in seen["stacks"], seen["stacks"]
        else:
            assert "py-spy is not installed" in seen["stacks"]
    finally:
        child.kill()
        child.wait()


def test_a_process_wedged_in_native_code_is_read_with_its_native_frames():
    """A live Python that does not answer (here: asleep in C, in time.sleep): py-spy pauses it and
    reads its C frames too, where a rank wedged in a collective's or a driver's code waits."""
    if stacks.py_spy() is None:
        pytest.skip("py-spy is not installed (pip install py-spy): the native frames need it")
    child = subprocess.Popen([sys.executable, "-c", "import time\ndef parked():\n    time.sleep(60)\nparked()"])
    try:
        time.sleep(0.3)
        seen = stacks.inspect_process(child.pid)
        assert "parked" in seen["stacks"] and "time_sleep" in seen["stacks"], seen["stacks"]
    finally:
        child.kill()
        child.wait()


class Said:
    def __init__(self) -> None:
        self.found: list[tuple] = []

    def hang_found(self, *args) -> None:
        self.found.append(args)


def seen_stopped(node_id: str, pid: int) -> dict:
    return {"state": "state T (stopped), wchan do_signal_stop", "stacks": f"py-spy of {pid} on {node_id}"}


def courts(tmp_path, world: int, avoided: list | None = None, answer_s: float = 0.4,
           group: str = "g1", inspect=seen_stopped, unarmed: tuple[int, ...] = (),
           ended: list | None = None) -> tuple[list[HangCourt], Said]:
    events = Said()

    def on_node(a: Answer, hangs: int, on_node: int) -> str:
        avoided.append((a.rank, a.node_id, hangs, on_node))
        return f"node {a.node} avoided"

    out = []
    for r in range(world):
        c = HangCourt(str(tmp_path / "runs"), "job", r, world, events, group=group,
                      here=lambda r=r: (f"10.0.0.{r}", f"node{r}"),
                      inspect=inspect, on_culprit_node=on_node if avoided is not None else None,
                      end=lambda node_id, pid: (ended if ended is not None else []).append((node_id, pid)) or "ended")
        c.answer_s, c.look_every_s = answer_s, 0.02
        if r not in unarmed:
            c.armed()
        out.append(c)
    return out, events


def test_a_rank_that_does_not_answer_the_declaration_is_named_and_read_from_outside(tmp_path):
    (c0, c1, c2), events = courts(tmp_path, 3)
    # rank 2 answers (its step is overdue too); rank 1 is stopped and never does
    declared = threading.Thread(target=lambda: said.append(c0.declare(57, "watchdog: rank 0 finished no step for 30s", 31.0)))
    said: list[str] = []
    declared.start()
    wait_for("rank 2 to answer the declaration", lambda: c2.answer_if_declared(57), 10, every=0.05)
    declared.join()
    line = said[0]
    assert "hang after step 57: rank 1 on node 10.0.0.1" in line and "stopped answering (process state T (stopped)" in line
    assert "rank 0 waits in" in line and "rank 2 waits in" in line and "hangs/g1/" in line, line
    found = events.found[0]
    assert (found[:3], found[4]) == ((57, "tidal-hangs/g1", [1]), 31.0), "for the goodput ledger: the hang's cost"
    files = hang_files(RunDir(str(tmp_path / "runs"), "job"), "tidal-hangs/g1")
    assert sorted(files) == ["stacks-rank0.txt", "stacks-rank1.txt", "stacks-rank2.txt", "verdict.txt"]
    assert "py-spy of" in files["stacks-rank1.txt"] and "did not answer" in files["stacks-rank1.txt"]
    assert "test_a_rank_that_does_not_answer" in files["stacks-rank2.txt"]  # its own threads, main included
    assert c2.wait_for_verdict() == "", "the answering rank leaves the saying to the declaring one"


def test_two_ranks_past_their_deadline_at_once_one_declares_the_other_answers(tmp_path):
    (c0, c1), events = courts(tmp_path, 2)
    said: list[str] = []
    threads = [threading.Thread(target=lambda c=c: said.append(c.declare(9, f"rank {c.rank} hung"))) for c in (c0, c1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(said)[0] == "" and "every rank waits in the same collective" not in sorted(said)[1]
    assert len(events.found) == 1


def test_a_node_whose_rank_hung_the_job_twice_is_avoided(tmp_path):
    avoided: list = []
    for hang in range(2):
        (c0, c1), _ = courts(tmp_path, 2, avoided, 0.05, f"g{hang}")  # rank 1 (node1) stopped, twice
        line = c0.declare(10 + hang, "hung")
    assert avoided == [(1, "node1", 2, 1)]
    assert "node 10.0.0.1 avoided" in line
    assert RunDir(str(tmp_path / "runs"), "job").read_json("tidal-hangs/nodes.json") == {
        "node1": {"node": "10.0.0.1", "hangs": 2}}


def test_hangs_are_counted_per_node():
    a = Answer(1, "10.0.0.2", "n2")
    nodes, due = _hang_count({}, [a])
    assert nodes == {"n2": {"node": "10.0.0.2", "hangs": 1}} and due == []
    nodes, due = _hang_count(nodes, [a, Answer(0, "x", "")])  # a rank that never said its node is not counted
    assert nodes["n2"]["hangs"] == 2 and due == [a]
    assert _hang_count(nodes, [a])[1] == [], "said once, at the second hang"


def test_avoiding_a_hung_node_follows_the_straggler_rules(tmp_path):
    elastic = tiny_spec(tmp_path, name="el", **{"scaling.min_workers": 1, "scaling.max_workers": 3, "train.global_batch": 24})
    said = nodes.avoid_hung_node(elastic, 3, 1, "10.0.0.2", "nodeid-2", 2, 1, 40)
    assert "avoids it for 3600s" in said and "restarting at 2 worker(s)" in said
    a = avoidance.read(elastic)
    assert (a.node_id, a.cause, a.state, a.size) == ("nodeid-2", "hang", "exclude", 2)
    fixed = tiny_spec(tmp_path, name="fixed")  # 2 workers, min 2: without the node the group is too small
    assert "stays in the job" in nodes.avoid_hung_node(fixed, 2, 1, "10.0.0.2", "nodeid-2", 2, 1, 40)
    assert avoidance.read(fixed) is None


def test_the_hang_event_reads_back_as_written():
    e = HangFound(57, "tidal-hangs/g1", [1], "hang after step 57: rank 1 ...", 31.5)
    assert parse({**e.entry(), "id": "x", "ts": 1}) == e


def test_silent_ranks_are_read_at_once_not_one_after_another(tmp_path):
    """Each read waits on a Ray task and py-spy (up to 30 s): read in turn, three silent ranks outlasted
    the answering ranks' wait for the verdict (45 s), and the explanation was lost (issue 77)."""
    together = threading.Barrier(3, timeout=10)

    def inspect(node_id: str, pid: int) -> dict:
        together.wait()  # passes only when the three reads run at the same time
        return seen_stopped(node_id, pid)

    (c0, *_), _ = courts(tmp_path, 4, inspect=inspect, answer_s=0.05)
    line = c0.declare(12, "hung")
    for r in (1, 2, 3):
        assert f"rank {r} on node 10.0.0.{r} (pid {os.getpid()}) stopped answering (process state T (stopped)" in line, line


def test_a_reused_group_key_trusts_no_earlier_groups_files(tmp_path):
    """A group's key names its rendezvous port, which a later group may reuse: an earlier group's answer,
    verdict or place must not stand for this one's (issue 77)."""
    run = RunDir(str(tmp_path / "runs"), "job")
    old = time.time() - 3600
    run.write_json("tidal-hangs/g1/answer-1.json", {"rank": 1, "node": "10.0.0.9", "node_id": "old", "pid": 4242,
                                                    "step": 3, "in_collective": True, "where": ALL_REDUCE, "at": old})
    run.write_json("tidal-hangs/g1/verdict.json", {"text": "an old hang", "at": old})
    run.write_json("tidal-hangs/g1/rank-2.json", {"rank": 2, "node": "10.0.0.9", "node_id": "old", "pid": 4242,
                                                  "at": old})
    read: list[int] = []

    def inspect(node_id: str, pid: int) -> dict:
        read.append(pid)
        return seen_stopped(node_id, pid)

    (c0, c1, _), _ = courts(tmp_path, 3, inspect=inspect, unarmed=(2,))  # rank 2 stopped before it said where
    c1.verdict_s = 0.3
    assert "gave no verdict" in c1.wait_for_verdict(), "an earlier group's verdict is not this hang's"
    line = c0.declare(20, "hung")
    assert "rank 1 on node 10.0.0.1" in line and "rank 1 on node 10.0.0.1 (pid" in line and "10.0.0.9" not in line, line
    assert "rank 2 on node ? (pid 0) stopped answering (it never said where it runs)" in line, line
    assert 4242 not in read, "an earlier group's pid is never read with py-spy"


@pytest.mark.parametrize("pid", ["1; reboot", True, -1, 0, 1, 1 << 40, 3.5])
def test_a_pid_read_from_storage_that_is_no_process_id_is_never_inspected(tmp_path, pid):
    read: list = []
    (c0, _), _ = courts(tmp_path, 2, inspect=lambda node_id, p: read.append(p) or seen_stopped(node_id, p),
                        answer_s=0.05, unarmed=(1,))
    RunDir(str(tmp_path / "runs"), "job").write_json("tidal-hangs/g1/rank-1.json", {
        "rank": 1, "node": "10.0.0.1", "node_id": "node1", "pid": pid, "at": time.time()})
    line = c0.declare(5, "hung")
    assert read == [] and "is not a process id" in line, line
    with pytest.raises(ValueError, match="not a process id"):
        stacks.inspect_process(pid)  # type: ignore[arg-type]


@pytest.mark.parametrize("folder", ["tidal-hangs/../../elsewhere", "../tidal-hangs/g1", "/etc", "checkpoint_000010",
                                    "tidal-hangs/g1/../../x", ""])
def test_a_hang_folder_read_from_the_event_log_must_be_one(tmp_path, folder):
    with pytest.raises(UnsafeName):
        hang_files(RunDir(str(tmp_path / "runs"), "job"), folder)


def test_a_silent_culprit_is_ended_once_its_stacks_are_saved(tmp_path):
    """Ray's teardown gives each worker 5 s to shut down, which a stopped one never does: the declaring
    rank ends it (issue 75: the hung rank's actor is killed)."""
    ended: list = []
    (c0, c1), _ = courts(tmp_path, 2, answer_s=0.05, ended=ended)
    assert "rank 1 on node 10.0.0.1" in c0.declare(7, "hung")
    assert ended == [("node1", os.getpid())], "the silent rank, on its node; not the one that answered"
    files = hang_files(RunDir(str(tmp_path / "runs"), "job"), "tidal-hangs/g1")
    assert "py-spy of" in files["stacks-rank1.txt"], "read before it was ended"


def test_only_a_ray_train_worker_is_ended():
    script = "import time\ntime.sleep(60)"
    other = subprocess.Popen([sys.executable, "-c", script])
    worker = subprocess.Popen([sys.executable, "-c", script, "ray::RayTrainWorker"])  # named as Ray names it
    try:
        time.sleep(0.3)
        worker.send_signal(signal.SIGSTOP)
        assert stacks.end_process(other.pid).startswith("not ended") and other.poll() is None
        assert stacks.end_process(worker.pid) == "ended" and worker.wait(10) == -signal.SIGKILL
        with pytest.raises(ValueError, match="not a process id"):
            stacks.end_process(True)  # type: ignore[arg-type]
    finally:
        for p in (other, worker):
            p.kill()
            p.wait()


def in_place(cs: list[HangCourt]) -> list[HangCourt]:
    for c in cs:
        c.in_place = True  # failure.replace_in_place
    return cs


def test_with_replace_in_place_a_silent_culprit_ended_is_replaced_and_every_live_rank_keeps_its_process(tmp_path):
    """issue 75: a stopped rank, once its stacks are saved and its process ended, is a lost worker Ray Train
    replaces alone; the verdict says so, and the answering rank reads it there instead of exiting."""
    ended: list = []
    cs, events = courts(tmp_path, 3, ended=ended)
    c0, c1, c2 = in_place(cs)
    said: list[str] = []
    declared = threading.Thread(target=lambda: said.append(c0.declare(57, "watchdog: rank 1 gave no heartbeat", 6.0, [1])))
    declared.start()
    wait_for("rank 2 to answer the declaration", lambda: c2.answer_if_declared(57), 10, every=0.05)
    declared.join()
    assert "hang after step 57: rank 1 on node 10.0.0.1" in said[0] and "stacks are in" in said[0], said[0]
    assert ended == [("node1", os.getpid())] and len(events.found) == 1
    assert RunDir(str(tmp_path / "runs"), "job").read_json("tidal-hangs/g1/verdict.json")["action"] == "replace"
    assert c0.replacing, "the declaring rank lives on"
    assert c2.wait_for_verdict() == "" and c2.replacing, "the answering rank lives on too"


@pytest.mark.parametrize("end", [lambda node_id, pid: "no such process here (FileNotFoundError)",
                                 lambda node_id, pid: 1 / 0])
def test_a_silent_culprit_not_ended_restarts_the_group_as_before(tmp_path, end):
    cs, _ = courts(tmp_path, 2, answer_s=0.05)
    c0, _c1 = in_place(cs)
    c0.end = end
    assert "rank 1 on node 10.0.0.1" in c0.declare(7, "hung", 6.0, [1])
    assert not c0.replacing
    assert RunDir(str(tmp_path / "runs"), "job").read_json("tidal-hangs/g1/verdict.json")["action"] == "restart"


def test_a_culprit_alive_but_stuck_restarts_the_group_and_is_not_ended(tmp_path):
    """Every rank answers (a rank wedged in its own code answers from its watchdog's thread): its training
    thread would never raise the lost peer's error, so only a restart ends the hang."""
    ended: list = []
    cs, _ = courts(tmp_path, 2, ended=ended)
    c0, c1 = in_place(cs)
    said: list[str] = []
    threads = [threading.Thread(target=lambda c=c: said.append(c.declare(9, f"rank {c.rank} hung"))) for c in (c0, c1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert "stopped answering" not in "".join(said) and ended == []
    assert not c0.replacing and not c1.replacing


def test_without_the_switch_a_silent_culprit_is_ended_and_the_group_restarts(tmp_path):
    ended: list = []
    (c0, _c1), _ = courts(tmp_path, 2, answer_s=0.05, ended=ended)
    c0.declare(7, "hung", 6.0, [1])
    assert ended == [("node1", os.getpid())] and not c0.replacing
    assert RunDir(str(tmp_path / "runs"), "job").read_json("tidal-hangs/g1/verdict.json")["action"] == "restart"


class ReplacingCourt:
    """A court whose verdict replaces the culprit in place (what HangCourt decides with the switch on)."""

    trainer = None
    replacing = False

    def __init__(self) -> None:
        self.declared: list[str] = []

    def armed(self) -> None:
        pass

    def stopped(self, silent):
        return list(silent)

    def answer_if_declared(self, step: int) -> bool:
        return False

    def wait_for_verdict(self) -> str:
        return ""

    def declare(self, step: int, said: str, stalled_s: float = 0.0, silent=()) -> str:
        self.declared.append(said)
        self.replacing = True
        return f"hang after step {step}: rank 1 stopped answering"


class SilentPeer:
    deadline_s = 5.0
    ended = closed = False

    def silent(self) -> list[int]:
        return [1]

    def declared(self) -> bool:
        return False

    def announce(self) -> None:
        pass

    def end(self) -> None:
        self.ended = True

    def close(self) -> None:
        self.closed = True


class Lines:
    def __init__(self) -> None:
        self.said: list[str] = []

    def say(self, message: str, step: int = 0) -> None:
        self.said.append(message)

    def drain(self, timeout_s: float | None = None) -> bool:
        return True


def test_a_rank_whose_hang_is_replaced_in_place_stands_by_and_exits_only_if_it_never_re_forms(monkeypatch):
    """The watching rank declares once, says the hang and the replacement, and neither exits nor declares
    again while its training thread re-forms the group (its deadlines run on meanwhile); a thread that never
    re-forms (which closes the watchdog) is ended as for any hang."""
    from tidal.worker.health import watchdog as wd

    exits: list[str | None] = []
    monkeypatch.setattr(wd, "POLL_S", 0.02)
    monkeypatch.setattr(wd.StepWatchdog, "_exit", lambda self, said: exits.append(said))
    court, pulse, lines = ReplacingCourt(), SilentPeer(), Lines()
    dog = wd.StepWatchdog(0.05, 0, lines, court=court, pulse=pulse).opened()  # type: ignore[arg-type]
    dog.beat(13)
    try:
        wait_for("the hang declared", lambda: court.declared, 10, every=0.02)
        time.sleep(0.3)  # many step deadlines
        assert exits == [] and len(court.declared) == 1 and pulse.ended
        assert lines.said == ["hang after step 13: rank 1 stopped answering; the silent rank(s) ended and replaced "
                              "in place (failure.replace_in_place): the other ranks keep their processes"]
        dog.standing_by -= wd.REFORM_S  # the training thread never re-formed
        wait_for("the rank to exit", lambda: exits, 10, every=0.02)
        assert "did not re-form the group in 60s" in exits[0]
    finally:
        dog.close()


def test_a_silent_rank_is_hung_by_its_heartbeat_only_when_its_process_is_stopped(tmp_path):
    """Seen in a 67-minute run under load: a rank whose process ran (state R) but whose heartbeat thread got
    no CPU for 5 s was declared hung and ended, and the job failed; a rank that died with its node was declared
    hung too (a death is Ray Train's to see). Only a stopped process is a heartbeat's hang; anything else is
    left to the step deadline, which a rank wedged holding the GIL still meets."""
    states = {"R": "state R (running), wchan 0", "T": "state T (stopped), wchan do_signal_stop",
              "t": "state t (tracing stop), wchan ptrace_stop", "gone": "no such process here (FileNotFoundError)"}
    for seen, hung in [("R", False), ("T", True), ("t", True), ("gone", False), ("unreadable", False)]:
        def state(node_id: str, pid: int, seen: str = seen) -> str:
            if seen == "unreadable":
                raise TimeoutError("the node's raylet did not answer")
            return states[seen]

        (c0, _c1), _ = courts(tmp_path / seen, 2)
        c0.state = state
        assert c0.stopped([1]) == ([1] if hung else []), seen


def test_a_heartbeat_silence_whose_process_runs_is_not_declared(monkeypatch):
    from tidal.worker.health import watchdog as wd

    exits: list[str | None] = []
    monkeypatch.setattr(wd, "POLL_S", 0.02)
    monkeypatch.setattr(wd.StepWatchdog, "_exit", lambda self, said: exits.append(said))
    court, pulse = ReplacingCourt(), SilentPeer()
    court.stopped = lambda ranks: []  # rank 1's process runs: starved of CPU, not stopped
    dog = wd.StepWatchdog(None, 0, Lines(), court=court, pulse=pulse).opened()  # type: ignore[arg-type]
    dog.beat(13)
    try:
        time.sleep(0.3)  # many polls
        assert court.declared == [] and exits == []
    finally:
        dog.close()
