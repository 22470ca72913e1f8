"""A silent rank found by its heartbeat (worker/health/heartbeat.py): the rule as a table, then real
processes beating through a real c10d TCPStore, one stopped with SIGSTOP, one busy in a slow step,
and a store's host stopped or killed. End to end on Ray: tests/test_hang.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import pytest

from tests.conftest import ROOT
from tidal.testing.processes import wait_for
from tidal.worker.health.heartbeat import HOST, Pulse, Seen, silent, watched


@pytest.mark.parametrize(("seen", "last_reply", "rank", "found"), [
    ({1: Seen(5, 97.0)}, 99.0, 0, []),  # beat 3 s ago, deadline 5 s
    ({1: Seen(5, 94.0)}, 99.0, 0, [1]),  # 6 s without a change: silent
    ({1: Seen(0, 0.0)}, 99.0, 0, []),  # never beat: not judged (not started yet)
    ({0: Seen(7, 99.0)}, 94.0, 1, [0]),  # the store has not answered for 6 s: its host, rank 0, is silent
    ({0: Seen(7, 99.0)}, None, 1, []),  # the store never answered yet: nothing to judge
    ({1: Seen(7, 99.0)}, 94.0, 0, []),  # rank 0 hosts the store: its own replies say nothing of it
    ({0: Seen(7, 90.0)}, 94.0, 1, [0]),  # both signs of the same rank: named once
    ({3: Seen(2, 90.0)}, 94.0, 2, [0, 3]),
])
def test_a_rank_is_silent_when_its_beat_or_its_store_stops_for_the_deadline(seen, last_reply, rank, found):
    assert silent(seen, last_reply, now=100.0, deadline_s=5.0, rank=rank) == found


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


def client_of(port: int) -> object:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=2))


@pytest.mark.slow
def test_a_stopped_rank_is_named_silent_and_a_busy_one_is_not():
    import torch.distributed as dist

    store = host_here()
    pulse = Pulse(0, 2, 2.0, store=lambda: dist.PrefixStore("t", store), beat_s=0.2)
    try:
        with child(1, store.port, "busy") as busy:
            wait_for("the busy rank's beat", lambda: pulse.seen.get(1, Seen(0, 0)).count > 0, timeout=30)
            assert busy.stdout is not None and busy.stdout.readline().strip() == "done"  # 6 s of a slow step
            assert pulse.silent() == [], "a slow step does not stop the heartbeat"
            os.kill(busy.pid, signal.SIGSTOP)
            assert wait_for("the stopped rank named", lambda: pulse.silent(), timeout=30) == [1]
    finally:
        pulse.close()


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
