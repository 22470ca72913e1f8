"""tidal.testing's process handling, which every real server of the suite stands on: a stopped
server takes everything it started with it, even what left its process group; waits say what
never came; an environment a fixture changed is put back."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tidal.testing.processes import (
    descendants,
    free_port,
    free_ports,
    kill_session,
    patched_env,
    start_in_session,
    stop_session,
    wait_for,
)

# A parent that starts a child in a session of its own (as Ray's and MLflow's servers do), prints
# the child's pid, and ignores SIGTERM (as a server that drains first does).
STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(600)
"""


def _start_stubborn(tmp_path: Path) -> tuple[subprocess.Popen, int]:
    log = tmp_path / "server.log"
    proc = start_in_session([sys.executable, "-c", STUBBORN], log)
    child = wait_for("the child's pid", lambda: log.read_text().strip(), timeout=30)
    return proc, int(child)


@pytest.mark.slow
def test_stopping_a_server_ends_its_group_and_what_it_started_elsewhere(tmp_path):
    proc, child = _start_stubborn(tmp_path)
    assert child in [p.pid for p in descendants(proc.pid)]
    stop_session(proc, grace_s=0.5)  # SIGTERM ignored: SIGKILL after the grace
    assert proc.returncode is not None
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


@pytest.mark.slow
def test_killing_a_session_is_immediate_and_waits_for_its_members(tmp_path):
    log = tmp_path / "sleeper.log"
    proc = start_in_session([sys.executable, "-c", "import subprocess, sys, time; "
                             "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"], log)
    wait_for("the grandchild", lambda: descendants(proc.pid), timeout=30)
    members = descendants(proc.pid)
    kill_session(proc)
    assert proc.returncode == -9 and not [p for p in members if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_a_free_port_is_free_and_on_loopback():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # nobody holds it


def test_ports_drawn_together_are_distinct_and_skip_the_ones_taken():
    """A head's four ports drawn one at a time once came out twice the same (CI, 2026-11-29:
    "dashboard_agent_http is trying to use a port number 56285 that is used by other components"):
    a port is free again as soon as its draw closes it. 500 single draws here repeated 7-16 ports
    (10 tries); 500 sockets stay well inside a default open-file limit of 1024."""
    taken = free_port()
    ports = free_ports(500, exclude=(taken,))
    assert len(set(ports)) == 500 and taken not in ports
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


def test_a_wait_that_never_ends_names_what_it_waited_for():
    with pytest.raises(TimeoutError, match="the answer"):
        wait_for("the answer", lambda: None, timeout=0.3, every=0.05)
    assert wait_for("a value", lambda: 42, timeout=1) == 42


def test_a_timed_out_wait_says_what_its_context_showed_and_a_broken_context_hides_nothing():
    with pytest.raises(TimeoutError, match="first RUNNING; then:\nfirst: FAILED, package deleted"):
        wait_for("first RUNNING", lambda: None, timeout=0.1, every=0.05, context=lambda: "first: FAILED, package deleted")
    with pytest.raises(TimeoutError, match=r"waiting for the answer; its context could not be read \(KeyError"):
        wait_for("the answer", lambda: None, timeout=0.1, every=0.05, context=lambda: {}["job"])


def test_patched_env_puts_back_set_and_unset_variables(monkeypatch):
    monkeypatch.setenv("TIDAL_TEST_A", "before")
    monkeypatch.delenv("TIDAL_TEST_B", raising=False)
    with pytest.raises(RuntimeError), patched_env({"TIDAL_TEST_A": None, "TIDAL_TEST_B": "during"}):
        assert "TIDAL_TEST_A" not in os.environ and os.environ["TIDAL_TEST_B"] == "during"
        raise RuntimeError("a fixture that fails half-way")
    assert os.environ["TIDAL_TEST_A"] == "before" and "TIDAL_TEST_B" not in os.environ


def test_no_test_file_imports_another():
    """A helper two test files need lives in tests/helpers.py (or tidal.testing, for servers): a test
    file imported by another runs its module-level code twice and ties two suites' fixtures together."""
    import ast
    import re

    tests = Path(__file__).resolve().parent
    found = []
    # Only the files whose text names a test module are parsed: parsing all of them was 1.7 s of the quick tier.
    maybe = re.compile(r"tests\.test_|from tests import")
    for path in sorted(tests.glob("*.py")):
        text = path.read_text()
        if not maybe.search(text):
            continue
        for node in ast.walk(ast.parse(text)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name}:{node.lineno} imports {n}" for n in names
                      if n.startswith("tests.test_") or (isinstance(node, ast.ImportFrom) and n == "tests"
                                                         and any(a.name.startswith("test_") for a in node.names))]
    assert not found, found
