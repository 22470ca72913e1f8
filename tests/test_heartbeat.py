"""A silent rank found by its heartbeat (worker/health/heartbeat.py): the rule as a table, then real
processes beating through a real c10d TCPStore, one stopped with SIGSTOP, one busy in a slow step,
and a store's host stopped or killed. End to end on Ray: tests/test_hang.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import pytest

from tests.conftest import ROOT
from tidal.testing.processes import wait_for
from tidal.worker.health.heartbeat import HOST, Pulse, Seen, silent, watched


@pytest.mark.parametrize(("seen", "last_reply", "calling_since", "rank", "found"), [
    ({1: Seen(5, 97.0)}, 99.0, None, 0, []),  # beat 3 s ago, deadline 5 s
    ({1: Seen(5, 94.0)}, 99.0, None, 0, [1]),  # 6 s without a change: silent
    ({1: Seen(0, 0.0)}, 99.0, None, 0, []),  # never beat: not judged (not started yet)
    ({0: Seen(7, 99.0)}, 99.0, 94.0, 1, [0]),  # a call to the store waits for 6 s: its host, rank 0, is silent
    ({0: Seen(7, 99.0)}, 99.0, 97.0, 1, []),  # 3 s: within the deadline
    ({0: Seen(7, 99.0)}, None, None, 1, []),  # the store never answered yet: nothing to judge
    ({1: Seen(7, 99.0)}, 99.0, 94.0, 0, []),  # rank 0 hosts the store: its own calls say nothing of it
    ({0: Seen(7, 90.0)}, 99.0, 94.0, 1, [0]),  # both signs of the same rank: named once
    ({3: Seen(2, 90.0)}, 99.0, 94.0, 2, [0, 3]),
    # This rank's own last reply is 6 s old, with no call waiting: its process stalled (a GC pass, a
    # long C call), so what it saw of its peer is stale - judged only after its next read. Found in
    # review: a 2.3 s hold in the watching process named a healthy peer silent.
    ({1: Seen(5, 90.0)}, 94.0, None, 0, []),
])
def test_a_rank_is_silent_when_its_beat_or_its_store_stops_for_the_deadline(seen, last_reply, calling_since, rank,
                                                                             found):
    assert silent(seen, last_reply, calling_since, now=100.0, deadline_s=5.0, rank=rank, fresh_s=3.0) == found


def test_each_rank_watches_the_next_round_the_ring():
    assert [watched(r, 4) for r in range(4)] == [1, 2, 3, 0]
    assert watched(0, 2) == 1 and watched(1, 2) == 0


CHILD = textwrap.dedent("""
    import sys, time
    from datetime import timedelta
    import torch.distributed as dist
    from tidal.worker.health.heartbeat import Pulse
    rank, port, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False, timeout=timedelta(seconds=2))
    pulse = Pulse(rank, 2, 2.0, store=lambda: dist.PrefixStore("t", store), beat_s=0.2)
    print("ready", flush=True)
    if mode == "busy":  # a slow step in Python: the training thread holds the GIL most of the time
        end = time.time() + 6
        while time.time() < end:
            sum(range(10_000))
        print("done", flush=True)
    if mode == "gil":  # a long serialisation said first: the GIL held 4 s (twice the deadline) without a switch
        from tidal import gil
        with gil.holding():
            print("holding", flush=True)
            sys.setswitchinterval(100.0)
            end = time.time() + 4
            while time.time() < end:
                pass
            sys.setswitchinterval(0.005)
        print("done", flush=True)
    time.sleep(120)
""")


@contextmanager
def child(rank: int, port: int, mode: str = "idle") -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(rank), str(port), mode], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()


def host_here(port: int = 0) -> object:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=2))


@contextmanager
def watching_here() -> Iterator[tuple[object, Pulse]]:
    """A store hosted in this process and rank 0's pulse on it (deadline 2 s, a beat every 0.2 s)."""
    import torch.distributed as dist

    store = host_here()
    pulse = Pulse(0, 2, 2.0, store=lambda: dist.PrefixStore("t", store), beat_s=0.2)
    try:
        yield store, pulse
    finally:
        pulse.close()


def client_of(port: int) -> object:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=2))


@pytest.mark.slow
def test_a_stopped_rank_is_named_silent_and_a_busy_one_is_not():
    with watching_here() as (store, pulse), child(1, store.port, "busy") as busy:
        wait_for("the busy rank's beat", lambda: pulse.seen.get(1, Seen(0, 0)).count > 0, timeout=30)
        assert busy.stdout is not None and busy.stdout.readline().strip() == "done"  # 6 s of a slow step
        assert pulse.silent() == [], "a slow step does not stop the heartbeat"
        os.kill(busy.pid, signal.SIGSTOP)
        assert wait_for("the stopped rank named", lambda: pulse.silent(), timeout=30) == [1]


def hold_the_gil(seconds: float) -> None:
    """This process's own stall: no other thread runs for `seconds` (a GC pass, a long C call)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
    finally:
        sys.setswitchinterval(before)


@pytest.mark.slow
def test_a_stall_in_the_watching_process_names_no_healthy_peer():
    """Found in review: the watching rank's own 2.3 s hold of the GIL named its healthy peer silent at
    the instant it let go, before its beat thread had read the peer again."""
    with watching_here() as (store, pulse), child(1, store.port):
        wait_for("the peer's beat", lambda: pulse.seen.get(1, Seen(0, 0)).count > 0, timeout=30)
        hold_the_gil(3.0)
        named = pulse.silent()  # read by the watchdog's thread as soon as it runs again
        time.sleep(1.0)
        assert named == [] and pulse.silent() == [], f"a healthy peer named silent: {named}"


@pytest.mark.slow
def test_a_peer_that_said_it_holds_the_gil_is_not_named_while_it_does():
    with watching_here() as (store, pulse), child(1, store.port, "gil") as peer:
        assert peer.stdout is not None and peer.stdout.readline().strip() == "holding"
        named = []
        end = time.monotonic() + 5.0
        while time.monotonic() < end:  # through the 4 s hold and a beat after it
            named += pulse.silent()
            time.sleep(0.1)
        assert peer.stdout.readline().strip() == "done"
        assert named == [], f"a peer that said it holds the GIL was named silent: {named}"
        os.kill(peer.pid, signal.SIGSTOP)  # outside the section, a stop is still found
        assert wait_for("the stopped rank named", lambda: pulse.silent(), timeout=30) == [1]


@pytest.mark.slow
def test_a_stopped_host_is_named_silent_and_a_killed_one_is_left_to_ray():
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with child(HOST, port) as host:
        pulse = Pulse(1, 2, 2.0, store=lambda: dist.PrefixStore("t", client_of(port)), beat_s=0.2)
        try:
            wait_for("the host's beat", lambda: pulse.seen.get(HOST, Seen(0, 0)).count > 0, timeout=30)
            os.kill(host.pid, signal.SIGSTOP)
            assert wait_for("the stopped host named", lambda: pulse.silent(), timeout=30) == [HOST]
            os.kill(host.pid, signal.SIGCONT)
            wait_for("the host answering again", lambda: pulse.silent() == [], timeout=30)
            host.kill()
            host.wait()
            wait_for("the dead host given up", lambda: pulse.gone, timeout=30)
            assert pulse.silent() == [], "a dead process is Ray's fault to handle, not a hang"
        finally:
            pulse.close()
