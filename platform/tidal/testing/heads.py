"""A Ray head on 127.0.0.1 with its dashboard (Jobs API) and token auth, in a session of its own:
for tests and benchmarks that submit jobs the way users do. Stopped by killing its session
(never `ray stop`, which would stop every Ray on the machine)."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from tidal.ray_private import reload_auth_token
from tidal.testing.processes import free_port

# On SIGTERM a `ray start --block` head first drains itself through its GCS, which the teardown's
# signal to the whole session has just stopped, and waits out the 30 s default.
NO_DRAIN_ON_SIGTERM = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}


@dataclass(frozen=True)
class Head:
    address: str  # the dashboard, for the Jobs API
    gcs: str  # for ray.init
    tmp: Path


@contextlib.contextmanager
def ray_head(tmp: Path, num_cpus: int, env: Mapping[str, str]) -> Iterator[Head]:
    """The head, its nodes' environment `env` on top of this process's; this process (and what it
    starts) holds its token (RAY_AUTH_TOKEN, RAY_AUTH_MODE=token) while it runs."""
    token, port, dash = secrets.token_hex(16), free_port(), free_port()
    full = {**os.environ, **NO_DRAIN_ON_SIGTERM, **env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    full.pop("RAY_ADDRESS", None)
    log = tmp / "head.log"
    # Ray's own folder short: its socket paths must stay under 107 bytes (pytest's tmp paths do not)
    ray_tmp = tempfile.mkdtemp(prefix="th-", dir="/tmp")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={port}",
         "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
         f"--num-cpus={num_cpus}", f"--temp-dir={ray_tmp}", "--disable-usage-stats",
         # the agent's default port is taken by any other head on this machine
         f"--dashboard-agent-listen-port={free_port()}"],
        env=full, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)  # noqa: SIM115 - lives as long as the head
    old = {k: os.environ.get(k) for k in ("RAY_AUTH_TOKEN", "RAY_AUTH_MODE", "RAY_ADDRESS")}
    os.environ.update({"RAY_AUTH_TOKEN": token, "RAY_AUTH_MODE": "token"})
    reload_auth_token()  # this process may have read another head's token before
    head = Head(f"http://127.0.0.1:{dash}", f"127.0.0.1:{port}", tmp)
    try:
        wait_for_jobs_api(head.address, proc, log)
        yield head
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        reload_auth_token()
        _stop(proc)
        if os.environ.get("TIDAL_KEEP_TEST_CLUSTER_LOGS") != "1":
            shutil.rmtree(ray_tmp, ignore_errors=True)


def wait_for_jobs_api(address: str, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    from tidal.errors import TidalError
    from tidal.launch.jobs import connect

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited: {log.read_text()[-3000:]}")
        try:
            connect(address).list_jobs()
            return
        except TidalError:
            time.sleep(1)
    raise TimeoutError(f"dashboard at {address} never answered: {log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
    time.sleep(1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # anything of that session still alive
    proc.wait()
