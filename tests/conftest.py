"""Shared fixtures. Ray-backed tests share one local Ray instance per module (starting one costs
seconds); each test gets its own storage folder and MLflow SQLite file."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tidal.spec.job import JobSpec
from tidal.testing.processes import free_port as free_port
from tidal.testing.processes import venv_tools_first
from tidal.testing.runs import metric_history as metric_history

ROOT = Path(__file__).resolve().parents[1]

venv_tools_first()  # every process of the suite, test heads included, uses this venv's ninja
# The Train controller polls workers this often; the default 2 s makes every test slower and
# leaves a checkpoint unregistered if a worker dies within that window after reporting it.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "0.5")  # default 5 s


@pytest.fixture(autouse=True)
def _mlflow_tracking_uri_put_back() -> Iterator[None]:
    """A test that points MLflow's fluent API at its store (which also sets MLFLOW_TRACKING_URI)
    must not decide where later tests' jobs track."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    if os.environ.get("MLFLOW_TRACKING_URI") != before:
        import mlflow

        mlflow.set_tracking_uri(before)


# For a test head from `ray start --block`: on SIGTERM a head first drains itself through its GCS,
# which the teardown's signal to the whole session has just stopped, and waits out the 30 s default.
NO_DRAIN_ON_SIGTERM = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}


def tiny_spec(tmp: Path, name: str = "tiny", **overrides: Any) -> JobSpec:
    """A job that trains in a few seconds on 2 CPU workers; `overrides` use dotted keys."""
    base = JobSpec(
        name=name,
        model={"n_layer": 2, "n_head": 2, "d_model": 64, "vocab_size": 64, "seq_len": 16},
        train={"steps": 24, "micro_batch": 4, "global_batch": 16, "lr": 1e-2, "warmup_steps": 2, "log_every": 1},
        parallelism={"zero_stage": 2},
        scaling={"min_workers": 2, "max_workers": 2},
        checkpoint={"every_steps": 8, "keep": 10, "storage": str(tmp / "runs")},
        failure={"max_restarts": 2},
        tracking={"uri": f"sqlite:///{tmp}/mlflow.db", "experiment": "tests"},
    )
    return base.with_overrides(overrides) if overrides else base


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory) -> str:
    """One MLflow SQLite store for tests that need no store of their own (creating one takes
    seconds); each test makes its own runs in it."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"


@contextmanager
def moto_s3(log: Path, server_env: dict[str, str] | None = None) -> Iterator[str]:
    """A real S3 API (moto's server) on 127.0.0.1, its endpoint and test credentials set in this
    process's environment (so every client, and every Ray instance started meanwhile, finds it);
    `server_env` goes to the server alone (e.g. moto's request recorder). Yields the endpoint."""
    port = free_port()
    moto = Path(sys.executable).parent / "moto_server"
    proc = subprocess.Popen([str(moto), "-H", "127.0.0.1", "-p", str(port)], stdout=log.open("w"),  # noqa: SIM115
                            stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(server_env or {})})
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"moto_server did not start: {log.read_text()[-2000:]}") from None
                time.sleep(0.2)
        yield env["AWS_ENDPOINT_URL"]
    finally:
        restore_env(old)
        stop_session(proc)


MLFLOW_AUTH_INI = ROOT / "cluster_configs" / "mlflow" / "basic_auth.ini"  # what the cluster configs run


@contextmanager
def mlflow_server(tmp: Path, artifacts: str, env: dict[str, str] | None = None,
                  admin_password: str | None = None) -> Iterator[str]:
    """A real `mlflow server` on 127.0.0.1, its database and log in `tmp`, its artifacts at `artifacts`
    (a path or an s3:// URI); `env` goes to the server alone. Yields its URI; stops its process group.

    With `admin_password`, MLflow's basic-auth app runs as the cluster configs start it: the shipped
    cluster_configs/mlflow/basic_auth.ini (no permission by default), its user store in `tmp` (the
    server's working directory, as on the head), the admin `admin` with that password, and the
    Flask secret key its CSRF protection needs."""
    port = free_port()
    server_env = {**os.environ, **(env or {})}
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        server_env.pop(name, None)  # a client's, not the server's
    auth: list[str] = []
    if admin_password is not None:
        server_env |= {"MLFLOW_AUTH_CONFIG_PATH": str(MLFLOW_AUTH_INI), "MLFLOW_AUTH_ADMIN_PASSWORD": admin_password,
                       "MLFLOW_FLASK_SERVER_SECRET_KEY": uuid.uuid4().hex}  # the app refuses to start without one
        auth = ["--app-name", "basic-auth"]
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "mlflow"), "server", *auth, "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", f"sqlite:///{tmp}/mlflow.db", "--artifacts-destination", artifacts],
        env=server_env, cwd=tmp, stdout=(tmp / "mlflow.log").open("w"), stderr=subprocess.STDOUT,  # noqa: SIM115
        start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300  # seen: 135 s to answer on this 2-core machine under load
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2):  # unauthenticated in basic-auth too
                    break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"mlflow server did not start: {(tmp / 'mlflow.log').read_text()[-3000:]}") from None
                time.sleep(0.5)
        yield uri
    finally:
        if proc.poll() is None:  # one that failed to start has nothing left to stop
            stop_session(proc)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> Iterator[str]:
    """A real S3 API (moto's server) on 127.0.0.1; every client finds it through AWS_ENDPOINT_URL.

    Session-wide and set in the environment before any Ray instance of a module that uses it
    starts, so Ray's workers inherit it as a cluster's nodes would.
    """
    with moto_s3(tmp_path_factory.mktemp("moto") / "moto.log") as endpoint:
        yield endpoint


@pytest.fixture
def bucket(s3_server) -> str:
    """A fresh bucket on the S3 test server: `s3://NAME`."""
    import boto3

    name = f"tidal-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return f"s3://{name}"


def restore_env(old: dict[str, str | None]) -> None:
    """Put back the environment variables a fixture changed (None: it was unset)."""
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def stop_session(proc: subprocess.Popen) -> None:
    """SIGTERM the process group a fixture started (start_new_session=True), SIGKILL if it lingers."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="session")
def cluster_env(tmp_path_factory, s3_server) -> Iterator[dict[str, str]]:
    """What a cluster's nodes say about where jobs keep things: a real `mlflow server` (database on the
    head's disk, artifacts on the shared storage) and TIDAL_STORAGE on the S3 test server.
    One for the session: test_jobs' and test_secrets_e2e's heads each name it (a server's start
    with a new database is the slow part)."""
    import secrets

    import boto3

    tmp = tmp_path_factory.mktemp("tracking")
    bucket = f"cluster-{secrets.token_hex(6)}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    with mlflow_server(tmp, f"s3://{bucket}/mlartifacts", {"MLFLOW_S3_ENDPOINT_URL": os.environ["AWS_ENDPOINT_URL"]}) as uri:
        yield {"MLFLOW_TRACKING_URI": uri, "TIDAL_STORAGE": f"s3://{bucket}/tidal"}
