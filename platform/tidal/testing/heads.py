"""A Ray head on this machine with its dashboard (Jobs API) and token auth, in a session of its own:
for tests and benchmarks that submit jobs the way users do, or that need a head started with flags
of their own (the fake multi-node autoscaler). Stopped by killing its session and what it started
(never `ray stop`, which would stop every Ray on the machine)."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tidal.ray_private import reload_auth_token
from tidal.testing.processes import (
    free_ports,
    patched_env,
    start_in_session,
    stop_session,
    wait_for,
    wait_for_server,
)

KEEP_LOGS_ENV = "TIDAL_KEEP_TEST_CLUSTER_LOGS"  # =1 keeps a test head's Ray temp dir for reading


@dataclass(frozen=True)
class Head:
    address: str  # the dashboard, for the Jobs API
    gcs: str  # for ray.init
    tmp: Path  # its log (head.log)
    ray_tmp: Path  # Ray's temp dir: sessions, logs, the address `ray start` records
    token: str


@contextlib.contextmanager
def ray_head(tmp: Path, num_cpus: int, env: Mapping[str, str], *, args: Sequence[str] = (),
             port: int | None = None, node_ip: str = "127.0.0.1", ray_tmp: Path | None = None,
             auth_mode_in_client: bool = True, connect: bool = False, token: str | None = None) -> Iterator[Head]:
    """The head, its nodes' environment `env` on top of this process's, `args` added to `ray start`.

    While it runs this process (and what it starts) holds its token in RAY_AUTH_TOKEN, and
    RAY_AUTH_MODE=token unless `auth_mode_in_client` is False (a test that the client sends the
    token by itself). `connect`: this process is its Ray driver (`ray.init`) until the end.
    `port` and `token`: those of a head that was lost, for one started again in its place."""
    token = token or secrets.token_hex(16)
    # the ports given (`port`, any `--...-port=N` in `args`) are free now too: never drawn again
    given = {port} | {int(a.rpartition("=")[2]) for a in args if re.fullmatch(r"--[\w-]*port=\d+", a)}
    drawn = free_ports(4, exclude=given)
    port, dash, client_port, agent_port = port or drawn[0], *drawn[1:]
    full = {**os.environ, **env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    full.pop("RAY_ADDRESS", None)
    log = tmp / "head.log"
    # Ray's own folder short: its socket paths must stay under 107 bytes (pytest's tmp paths do not)
    own_tmp = ray_tmp is None
    ray_tmp = Path(tempfile.mkdtemp(prefix="th-", dir="/tmp")) if ray_tmp is None else ray_tmp
    proc = start_in_session(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={port}",
         f"--node-ip-address={node_ip}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
         f"--num-cpus={num_cpus}", f"--temp-dir={ray_tmp}", "--disable-usage-stats",
         f"--ray-client-server-port={client_port}",
         # the agent's default port (52365) is taken by any other head on this machine: its agent then
         # dies and every submission fails with "No available agent to submit job"
         f"--dashboard-agent-listen-port={agent_port}", *args],
        log, env=full)
    client = {"RAY_AUTH_TOKEN": token} | ({"RAY_AUTH_MODE": "token"} if auth_mode_in_client else {})
    head = Head(f"http://127.0.0.1:{dash}", f"{node_ip}:{port}", tmp, ray_tmp, token)
    try:
        with patched_env(client):
            reload_auth_token()  # this process may have read another head's token before
            try:
                wait_for_jobs_api(head.address, proc, log)
                if connect:
                    _connect(head.gcs)
                yield head
            finally:
                if connect:
                    import ray

                    ray.shutdown()
    finally:
        reload_auth_token()  # the token this process held before
        # SIGKILL, no SIGTERM first: nothing of a test head is kept, and its graceful stop took
        # 3.6 s, or all of stop_session's 30 s grace when its raylet outlived its GCS (2 of 4 stops
        # measured on 2026-11-29). A lost head is killed like this too (test_head_restart).
        stop_session(proc, grace_s=0)
        if own_tmp and os.environ.get(KEEP_LOGS_ENV) != "1":
            shutil.rmtree(ray_tmp, ignore_errors=True)


def _connect(gcs: str) -> None:
    import ray

    def connected() -> bool:
        try:
            ray.init(address=gcs, logging_level="WARNING")
            return True
        except ConnectionError:
            return False

    wait_for(f"the head at {gcs} to accept a driver", connected, timeout=60, every=1.0)


def wait_for_jobs_api(address: str, proc, log: Path, timeout: float = 300) -> None:
    """Until the dashboard at `address` lists jobs (the Jobs API answers, with this process's token)."""
    from tidal.errors import TidalError
    from tidal.launch.jobs import connect

    def answers() -> bool:
        try:
            connect(address).list_jobs()
            return True
        except TidalError:
            return False

    wait_for_server(answers, proc, log, f"the Jobs API at {address}", timeout)


def wait_accepting_jobs(address: str, timeout: float = 120) -> None:
    """Until the head's Jobs API has run a no-op job (no working dir): its node agent has registered
    and a job supervisor has started once.

    For a head that keeps an upload only briefly (RAY_RUNTIME_ENV_TEMPORARY_REFERENCE_EXPIRATION_S,
    600 s by default): a first submission that waits for the agent (`submit` retries until it has
    registered) can find its package deleted before its runtime env downloads it, and the job fails
    ("Failed to download runtime_env file package"). Seen once on CI with a 10 s hold."""
    from tidal.jobs_api import submit_accepted
    from tidal.launch.chain import TERMINAL
    from tidal.launch.jobs import connect

    client, sid = connect(address), f"tidal-warmup-{secrets.token_hex(3)}"
    submit_accepted(client, timeout, entrypoint="true", submission_id=sid)
    wait_for("the no-op job to end", lambda: str(client.get_job_status(sid).value) in TERMINAL, timeout)
