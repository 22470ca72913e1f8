"""Shared fixtures. Ray-backed tests share one local Ray instance for the whole session (starting
one costs 6-7 s; the modules that ask for it run one after another, see `pytest_collection_modifyitems`);
each test gets its own storage folder and MLflow SQLite file."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.slow_step import slow_env
from tidal.spec.job import JobSpec
from tidal.testing.heads import ray_head
from tidal.testing.processes import free_port as free_port
from tidal.testing.processes import restore_env as restore_env
from tidal.testing.processes import stop_session as stop_session
from tidal.testing.processes import venv_tools_first
from tidal.testing.runs import metric_history as metric_history
from tidal.testing.runs import prepared_store
from tidal.testing.servers import mlflow_server as mlflow_server
from tidal.testing.servers import moto_s3 as moto_s3

ROOT = Path(__file__).resolve().parents[1]

venv_tools_first()  # every process of the suite, test heads included, uses this venv's ninja
# The Train controller polls workers this often; the default 2 s makes every test slower and
# leaves a checkpoint unregistered if a worker dies within that window after reporting it.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "0.5")  # default 5 s


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`extended` tests (pyproject.toml: variants and soak runs beyond the suite's budget) run only
    when `-m` names them (`-m extended`, `-m "slow or extended"`): the README's `python -m pytest -q`
    and `.ci/run` run the same suite. They are slow tests too, so `-m "not slow"` never takes one.

    Then the modules that use conftest's `head` move, whole and in their order, after the others,
    and those that use `ray_local` to the end of the run: one after another, each group shares one
    Ray (a head, a local instance), which no other module's Ray meets."""
    extended = [item for item in items if item.get_closest_marker("extended")]
    for item in extended:
        if not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
    if extended and "extended" not in (config.getoption("markexpr") or ""):
        config.hook.pytest_deselected(items=extended)
        items[:] = [item for item in items if not item.get_closest_marker("extended")]
    on_head = {item.module for item in items if _uses_shared_head(item)}
    on_local = {item.module for item in items if "ray_local" in getattr(item, "fixturenames", ())}
    # stable: the order is kept within each group
    items.sort(key=lambda item: 2 if getattr(item, "module", None) in on_local else
               1 if getattr(item, "module", None) in on_head else 0)


def _uses_shared_head(item: pytest.Item) -> bool:
    """Asks for conftest's `head`, not a `head` of its module's own (test_secrets_e2e's)."""
    return "head" in getattr(item, "fixturenames", ()) and not hasattr(getattr(item, "module", None), "head")


@pytest.fixture(autouse=True)
def _mlflow_tracking_uri_put_back() -> Iterator[None]:
    """A test that points MLflow's fluent API at its store (which also sets MLFLOW_TRACKING_URI)
    must not decide where later tests' jobs track."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    if os.environ.get("MLFLOW_TRACKING_URI") != before:
        import mlflow

        mlflow.set_tracking_uri(before)


def tiny_spec(tmp: Path, name: str = "tiny", **overrides: Any) -> JobSpec:
    """A job that trains in a few seconds on 2 CPU workers; `overrides` use dotted keys."""
    base = JobSpec(
        name=name,
        model={"n_layer": 2, "n_head": 2, "d_model": 64, "vocab_size": 64, "seq_len": 16},
        train={"steps": 24, "micro_batch": 4, "global_batch": 16, "lr": 1e-2, "warmup_steps": 2, "log_every": 1},
        parallelism={"zero_stage": 2},
        scaling={"min_workers": 2, "max_workers": 2},
        # The memory tier (on by default) off: these tests' restores are from storage checkpoints, which a
        # newer memory snapshot would replace. Memory-tier tests set it (checkpoint.memory.every_steps, or {}).
        checkpoint={"every_steps": 8, "keep": 10, "storage": str(tmp / "runs"), "memory": None},
        failure={"max_restarts": 2},
        tracking={"uri": prepared_store(tmp / "mlflow.db"), "experiment": "tests"},
    )
    return base.with_overrides(overrides) if overrides else base


# One worker where the claim holds at any world size: a worker's start (about 12 s of CPU) less.
ONE_WORKER = {"scaling.min_workers": 1, "scaling.max_workers": 1}


def one_worker_spec(tmp: Path, name: str, steps: int, step_s: float, hold: Path | None = None) -> JobSpec:
    """A one-worker job in a folder of its own under `tmp`, each step at least `step_s` long
    (tests/slow_step.py; only while the file `hold` exists, if given), a checkpoint every 5 steps:
    what the admission tests queue behind each other."""
    folder = tmp / name
    folder.mkdir()
    return tiny_spec(folder, name=name, **{
        **ONE_WORKER, "scaling.cpus_per_worker": 1, "train.steps": steps,
        "train.micro_batch": 4, "train.global_batch": 8, "checkpoint.every_steps": 5,
        "train.step_fn": "tests.slow_step:step", "worker_env": slow_env(step_s, hold)})


class _SharedRay:
    """The session's one local Ray instance: started by the first module that asks for `ray_local`,
    kept for the next, stopped at the session's end or before a module that does not ask (one that
    may call ray.init itself, or start a cluster its in-process jobs must find)."""

    def __init__(self) -> None:
        self.up = False

    def start(self) -> None:
        import ray

        if not self.up:
            ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
            self.up = True

    def stop(self) -> None:
        if self.up:
            import ray

            ray.shutdown()
            self.up = False


_shared_ray = _SharedRay()


@pytest.fixture(scope="session")
def _ray_session() -> Iterator[_SharedRay]:
    yield _shared_ray
    _shared_ray.stop()


@pytest.fixture(scope="module")
def ray_local(_ray_session, s3_server) -> Iterator[None]:
    """The shared local Ray instance (2 CPUs, no dashboard). It needs the S3 test server's address in
    this process's environment before it starts, as a cluster's nodes have it: its workers inherit it."""
    _ray_session.start()
    yield


@pytest.fixture(scope="module", autouse=True)
def _no_shared_ray_here(request: pytest.FixtureRequest) -> None:
    """A module that does not use `ray_local` never finds this process connected to it, and one that
    does not use the shared `head` never finds that head running."""
    mine = [i for i in request.session.items if getattr(i, "module", None) is request.module]
    if not any("ray_local" in getattr(i, "fixturenames", ()) for i in mine):
        _shared_ray.stop()
    if not any(_uses_shared_head(i) for i in mine):
        _shared_head.stop()


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory) -> str:
    """One MLflow SQLite store for tests that need no store of their own (creating one takes
    seconds); each test makes its own runs in it."""
    return prepared_store(tmp_path_factory.mktemp("mlflow") / "mlflow.db")


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


class _SharedHead:
    """The session's one Ray head for the modules that only submit to it (`head`): started by the
    first, kept for the next (they run one after another, `pytest_collection_modifyitems`), stopped
    before any other module. A head left running while a later module starts a Ray of its own
    (test_elastic's raylets) makes that module's Ray Train find two clusters on this machine and
    say so into its console every second (seen when test_one_live_attempt ran before test_elastic)."""

    def __init__(self) -> None:
        self.stack: contextlib.ExitStack | None = None
        self.address, self.tmp = "", Path()

    def start(self, tmp: Path, env: dict[str, str]) -> str:
        with contextlib.ExitStack() as stack:
            head = stack.enter_context(ray_head(tmp, 2, env, ray_tmp=tmp / "ray", auth_mode_in_client=False))
            self.address, self.tmp, self.stack = head.address, tmp, stack.pop_all()
        return self.address

    def stop(self) -> None:
        if self.stack is not None:
            stack, self.stack, self.address = self.stack, None, ""
            stack.close()


_shared_head = _SharedHead()


@pytest.fixture(scope="session")
def _head_session() -> Iterator[_SharedHead]:
    yield _shared_head
    _shared_head.stop()


@pytest.fixture(scope="module")
def head(cluster_env, _head_session, tmp_path_factory) -> str:
    """A Ray head on 127.0.0.1 with its dashboard and token auth (tidal.testing.heads), its nodes'
    environment naming the cluster's tracking server and storage; the Jobs API address. The
    session's shared one (`_SharedHead`).
    The head's environment is the cluster's Python environment: `python` and `tidal` from this venv
    (first on PATH, above). This process holds the token but not RAY_AUTH_MODE=token: Tidal's
    clients must send it by themselves, as they do on a laptop."""
    return _head_session.address or _head_session.start(tmp_path_factory.mktemp("head"), cluster_env)


@pytest.fixture(scope="module")
def head_tmp(head) -> Path:
    """`head`'s folder: its log, and under ray/ its temp dir (where `ray start` records its address)."""
    return _shared_head.tmp


@pytest.fixture
def group() -> Iterator[None]:
    """A torch.distributed process group of one (gloo on 127.0.0.1), as a single Ray Train worker has."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
