"""Ray Jobs: submit a Tidal job to a cluster, and follow, list or stop it (JobSubmissionClient).

The job a cluster runs is `python -m tidal.launch.entrypoint <spec>`, which calls the same
`run(spec)` as `tidal run`. Authentication follows Ray 2.60: the token comes from
RAY_AUTH_TOKEN, the file in RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token, and is sent as a bearer
header (Ray's own client sends it only when RAY_AUTH_MODE=token is set; we always do).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import secrets
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tidal.admission.naming import QUEUE_JOB_VAR
from tidal.admission.quotas import cluster_quotas, resolve_scheduling
from tidal.admission.view import queue_record, queue_rows
from tidal.errors import ClusterError, SpecError, TidalError
from tidal.jobs_api import AGENT_WAIT_S, submit_accepted
from tidal.launch import chain, job_logs
from tidal.launch.chain import TERMINAL
from tidal.launch.connect import warn_plain_token
from tidal.launch.result import RunResult
from tidal.launch.submission import (
    FORWARDED_ENV,
    JobState,
    forwarded_env,
    package_working_dir,
    start_failure,
)
from tidal.output import parse_record
from tidal.ray_auth import auth_headers, auth_token
from tidal.ray_private import walk_working_dir, working_dir_upload_cap
from tidal.spec.job import JobSpec
from tidal.spec.secrets import refuse_credentials
from tidal.spec.sections import trial_name

ALWAYS_EXCLUDE = [".git", ".venv", "venv", "__pycache__", "*.egg-info", ".ipynb_checkpoints",
                  "tidal-runs", "mlruns", "mlartifacts", "mlflow.db", "*.db-journal", ".pytest_cache", ".ruff_cache"]
T = TypeVar("T")
# `tidal list/status --output json` hold these always; progress fields are null before the first step is in MLflow.
JOB_FIELDS = ("id", "name", "status", "team", "priority", "start_time")
PROGRESS_FIELDS = ("step", "steps", "loss", "tokens_per_s", "world_size")


def connect(address: str | None = None) -> Any:
    """A JobSubmissionClient for `address` (default: RAY_ADDRESS), with the auth header set."""
    from ray.job_submission import JobSubmissionClient

    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise ClusterError("no cluster address: pass --address http://HEAD:8265 or set RAY_ADDRESS")
    token = auth_token()
    warn_plain_token(address, token is not None)
    headers = auth_headers(token)
    try:
        return JobSubmissionClient(address, headers=headers)
    except Exception as e:  # noqa: BLE001 - Ray raises bare ConnectionError/RuntimeError; translate them
        raise _friendly(e, address, token) from None


def _friendly(e: Exception, address: str, token: str | None) -> TidalError:
    text = str(e)
    if any(s in text for s in ("401", "403", "Unauthorized", "authentication", "Authentication")):
        what = "no auth token was found" if token is None else "the cluster refused the auth token"
        return ClusterError(
            f"{address} requires Ray token authentication and {what}.\n"
            "Copy the token from the head node (~/.ray/auth_token) and either set RAY_AUTH_TOKEN=<token>, "
            "point RAY_AUTH_TOKEN_PATH at a file holding it, or save it to ~/.ray/auth_token."
        )
    if any(s in text for s in ("Connection refused", "Failed to connect", "Max retries", "ConnectionError")):
        return ClusterError(f"cannot reach the Ray dashboard at {address}: is the head running, and is that its "
                            "dashboard address (http://HEAD:8265)?")
    return ClusterError(f"Ray Jobs API at {address}: {text.strip().splitlines()[-1] if text.strip() else type(e).__name__}")


def upload_limit() -> int:
    """Bytes Ray accepts for a working_dir: the dashboard's request cap and the GCS object cap."""
    return working_dir_upload_cap()


def working_dir_size(root: Path, excludes: list[str]) -> tuple[int, list[tuple[int, str]]]:
    """Bytes Ray would upload from `root` (its own walk: .gitignore, .rayignore and `excludes`),
    and the largest files, so a refusal can say what to exclude."""
    files: list[tuple[int, str]] = []

    def visit(p: Path) -> None:
        if p.is_file() and not p.is_symlink():
            files.append((p.stat().st_size, str(p.relative_to(root))))

    walk_working_dir(root, excludes, visit)
    return sum(s for s, _ in files), sorted(files, reverse=True)[:5]


@dataclass
class Job:
    """A Tidal job submitted to a Ray cluster (returned by `tidal.submit`)."""

    submission_id: str
    address: str
    spec: JobSpec | None = None
    # links already found from a parked driver to the next (launch/chain.py): they never change
    _links: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def _client(self) -> Any:
        return connect(self.address)

    def _now(self, client: Any) -> chain.Link:
        """The Ray job that is this job now: the submission itself, or where it went on after
        parking while it waited in the cluster's queue (admission/parking.py)."""
        return chain.walk(client, self.submission_id, self._links)[-1]

    def status(self) -> JobState:
        """PENDING, RUNNING, SUCCEEDED, FAILED or STOPPED; under the cluster's admission a running
        driver's job is QUEUED, RUNNING, SHRUNK or SUSPENDED, where this machine reads the cluster's
        queue (TIDAL_STORAGE or TIDAL_QUEUE set here: docs/sharing.md). A job that failed before
        its entrypoint ran has the Jobs API's reason in `.reason` (redacted)."""
        client = self._client()
        now = self._now(client)
        state = now.state
        if state in ("RUNNING", "QUEUED") and (row := queue_record(self.submission_id, os.environ)):
            return JobState(str(row["state"]))
        if state != "FAILED":
            return JobState(state)
        if now.reason:
            return JobState(state, now.reason)
        info = client.get_job_info(now.submission_id)  # why it failed: only a failed job's is read
        return JobState(state, start_failure(state, info.error_type, info.message))

    def logs(self) -> str:
        """Everything the job has printed so far; for a job that failed before its entrypoint ran
        (which printed nothing), a last line with the Jobs API's reason."""
        client = self._client()
        text = "".join(client.get_job_logs(link.submission_id)
                       for link in chain.walk(client, self.submission_id, self._links) if link.started)
        return text + self._failure_note()

    def _failure_note(self) -> str:
        reason = self.status().reason
        return f"[tidal] job {self.submission_id} failed before its entrypoint ran: {reason}\n" if reason else ""

    def follow(self, poll_s: float = 1.0) -> Iterator[str]:
        """Yield the job's output as it comes, until the job ends.

        Streams through Ray's log websocket (`tail_job_logs`), which needs an asyncio loop of its
        own; inside a running loop (a Jupyter kernel) that cannot be had, and the logs are polled
        every `poll_s` seconds instead, as they are if the stream breaks off.
        """
        client, seen = self._client(), 0
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            seen = yield from job_logs.stream(client, self.submission_id, poll_s)
        if seen is not None:
            yield from job_logs.poll(client, self.submission_id, poll_s, seen)
        if successor := self._went_on_as(poll_s):  # parked: the job goes on as another Ray job
            yield from successor.follow(poll_s)
        elif note := self._failure_note():  # nothing was printed: say why it never started
            yield note

    def _went_on_as(self, poll_s: float) -> Job | None:
        successor = chain.went_on_as(self._client(), self.submission_id, poll_s)
        return Job(successor, self.address, self.spec) if successor else None

    def wait(self, timeout: float | None = None, poll_s: float = 1.0) -> str:
        """Block until the job ends (or `timeout` seconds pass); returns its final status."""
        deadline = None if timeout is None else time.time() + timeout
        while (state := self.status()) not in TERMINAL:
            if deadline is not None and time.time() > deadline:
                raise TimeoutError(f"job {self.submission_id} still {state} after {timeout}s")
            time.sleep(poll_s)
        return state

    def stop(self) -> bool:
        """Ask the cluster to stop the job; True if it was running (or waiting in the queue with no
        driver: it then never starts)."""
        client = self._client()
        now = self._now(client)
        if not now.started:
            return chain.cancel(client, now.submission_id, self.submission_id)
        return bool(client.stop_job(now.submission_id))

    def progress(self) -> dict[str, Any]:
        """The latest step's progress: step, steps, loss, tokens/s, world size (empty before the first
        step reached MLflow, or while the job's MLflow cannot be read from here)."""
        return read_progress(self.record())

    def record(self) -> dict[str, Any]:
        """Where the job tracks and stores, as it recorded at start: name, tracking_uri, experiment,
        mlflow_run_id, storage. Empty before the job has opened its run."""
        return parse_record(self.logs())

    def mlflow_run_id(self) -> str | None:
        return self.record().get("mlflow_run_id")

    def tracking_uri(self) -> str | None:
        """The MLflow tracking URI the job actually used."""
        return self.record().get("tracking_uri")

    def metrics(self) -> Any:
        """A pandas DataFrame of the run's metrics from MLflow, one row per step."""
        from tidal.tracking.reader import metrics_frame

        rec = self._opened_record()
        return self._from_mlflow(rec, lambda: metrics_frame(rec["tracking_uri"], rec["mlflow_run_id"]))

    def result(self, timeout: float | None = None) -> RunResult:
        """Wait for the job to end, then what it left behind, as `tidal.run` returns it: the newest
        checkpoint, the last metrics, the MLflow run and where it is, and the error if it failed."""
        from mlflow.tracking import MlflowClient

        state = self.wait(timeout)
        rec = self._opened_record()
        client = self._client()
        info = client.get_job_info(self._now(client).submission_id)
        metrics = self._from_mlflow(rec, lambda: dict(MlflowClient(rec["tracking_uri"]).get_run(
            rec["mlflow_run_id"]).data.metrics))
        wall_s = ((info.end_time or 0) - (info.start_time or 0)) / 1000
        error = None if state == "SUCCEEDED" else (info.message or f"the job ended {state}")
        return RunResult(rec["name"], rec["mlflow_run_id"], rec["tracking_uri"], rec["storage"],
                         {k: v for k, v in metrics.items() if not k.startswith("system/")}, max(wall_s, 0.0), error)

    def _opened_record(self) -> dict[str, Any]:
        rec = self.record()
        if not rec.get("mlflow_run_id"):
            raise TidalError(f"job {self.submission_id} has not opened its MLflow run (status {self.status()}); "
                             f"see its output: tidal logs {self.submission_id} --address {self.address}")
        return rec

    def _from_mlflow(self, rec: dict[str, Any], read: Callable[[], T]) -> T:
        try:
            return read()
        except Exception as e:  # noqa: BLE001 - say which store could not be read, and how to reach it
            raise TidalError(
                f"cannot read MLflow run {rec['mlflow_run_id']} from {rec['tracking_uri']}, where job "
                f"{self.submission_id} tracked it ({type(e).__name__}: {str(e).splitlines()[0][:200]}). Reach that "
                "tracking server from here (e.g. an SSH tunnel to the head's MLflow port), or read the run on the "
                "cluster") from None


def read_progress(rec: dict[str, Any]) -> dict[str, Any]:
    """The structured progress the job keeps in its MLflow run (tracking.reader.PROGRESS_TAG), found
    through the record it printed at start; never parsed from the printed progress lines."""
    if not rec.get("mlflow_run_id") or not rec.get("tracking_uri"):
        return {}
    from tidal.tracking.reader import read_progress as from_run

    try:
        return from_run(rec["tracking_uri"], rec["mlflow_run_id"])
    except Exception:  # noqa: BLE001 - progress is informative: unknown here, the job's status still shows
        return {}


def submit(spec: JobSpec, address: str | None = None, working_dir: str | os.PathLike[str] = ".",
           submission_id: str | None = None) -> Job:
    """Send `spec` to the cluster's Ray Jobs API; the cluster runs it with `tidal.run`."""
    if why := trial_name(spec.name):  # only `tidal sweep` names a job `<sweep>-tN`
        raise SpecError([("name", why)])
    root = Path(working_dir).resolve()
    excludes = ALWAYS_EXCLUDE + _inside(root, spec.checkpoint.storage or "./tidal-runs")
    size, largest = working_dir_size(root, excludes)
    limit = upload_limit()
    if size > limit:
        biggest = "\n".join(f"  {s / 2**20:8.1f} MiB  {p}" for s, p in largest)
        raise TidalError(
            f"{root} holds {size / 2**20:.1f} MiB to upload, above Ray's {limit / 2**20:.0f} MiB limit for a "
            f"job's working_dir. Largest files:\n{biggest}\nList big files or folders in .gitignore or "
            ".rayignore, or keep data on shared storage and point data.source at it."
        )
    quotas = cluster_quotas(os.environ)
    if quotas is not None:  # this machine reads the cluster's quota file: a team or priority it lacks fails here
        resolve_scheduling(spec.scheduling.team, spec.scheduling.priority, quotas)
    # The spec's `env` holds references only (spec/secrets.py): the values are read on the workers.
    # Neither the entrypoint nor the runtime_env (both shown to every token holder) may carry a
    # credential anywhere else: a URI's password, a signed URL, a secret in worker_env.
    data = spec.model_dump(mode="json")
    forwarded = forwarded_env(os.environ)
    refuse_credentials(data, forwarded, FORWARDED_ENV)
    client = connect(address)
    payload = base64.urlsafe_b64encode(json.dumps(data).encode()).decode()
    env = {**forwarded, **({"PYTHONPATH": "platform"} if (root / "platform" / "tidal").is_dir() else {})}
    with tempfile.TemporaryDirectory(prefix="tidal-submit-") as tmp:
        package = package_working_dir(root, excludes, Path(tmp))  # a package of its own: see there
        # An id chosen here (Ray's own form), so that a submission retried after a dropped connection
        # is recognised if the first attempt was accepted.
        sid = submission_id or f"raysubmit_{secrets.token_hex(8)}"
        try:
            submit_accepted(client, AGENT_WAIT_S, entrypoint=f"python -m tidal.launch.entrypoint {payload}",
                            runtime_env={"working_dir": str(package), "env_vars": env}, submission_id=sid,
                            metadata={"tidal.job": spec.name, "tidal.steps": str(spec.train.steps)})
        except Exception as e:  # noqa: BLE001 - translate Ray's HTTP errors into a message that says what to do
            raise _friendly(e, address or os.environ.get("RAY_ADDRESS", ""), auth_token()) from None
    return Job(sid, client.get_address(), spec)


def list_jobs(address: str | None = None) -> list[dict[str, Any]]:
    """Tidal jobs on the cluster, newest first, with their latest progress."""
    client = connect(address)
    queued = {r["job"]: r for r in queue_rows(os.environ)}  # under the cluster's admission, where readable here
    rows, successors, stopped = [], {}, set()
    for info in client.list_jobs():
        meta = info.metadata or {}
        if chain.CANCELLED in meta and info.submission_id:
            stopped.add(info.submission_id)
        if "tidal.job" not in meta or not info.submission_id:
            continue
        record = parse_record(client.get_job_logs(info.submission_id))
        if record.get(chain.PARKED_KEY):
            successors[info.submission_id] = record[chain.PARKED_KEY]
        key = ((info.runtime_env or {}).get("env_vars") or {}).get(QUEUE_JOB_VAR) or info.submission_id
        status, q = str(info.status.value), queued.get(key, {})
        rows.append({"id": info.submission_id, "name": meta["tidal.job"],
                     "status": q["state"] if q and status == "RUNNING" else status,
                     "team": q.get("team"), "priority": q.get("priority"), "start_time": info.start_time or 0,
                     **read_progress(record)})
    ids = {r["id"] for r in rows} | stopped
    successors.update({r["id"]: nxt for r in rows if (nxt := chain.successor_id(r["id"])) in ids})  # logs lost
    rows = chain.merge_rows(rows, successors, stopped)
    return sorted(rows, key=lambda r: r["start_time"], reverse=True)


def _inside(root: Path, storage: str) -> list[str]:
    """Exclude the checkpoint folder when it lies inside the working dir."""
    if "://" in storage:
        return []
    p = (root / storage).resolve()
    try:
        return [str(p.relative_to(root))]
    except ValueError:
        return []
