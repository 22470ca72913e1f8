"""Tracking behind MLflow's own authentication, as the cluster configs run it: a real
`mlflow server --app-name basic-auth` on 127.0.0.1 with the shipped basic_auth.ini (no permission by
default). A Tidal job (`tidal run` of the quickstart on a local Ray instance) tracks with its user's
credentials from MLflow's own variables, which reach the tracker actor through the environment as
MLFLOW_TRACKING_URI does; a client without credentials is refused (401); another team's user cannot
read the experiment (403) until MLflow's own permission API grants it."""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import shutil
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import ROOT, mlflow_server, restore_env
from tests.helpers import tidal_cli

pytestmark = pytest.mark.slow

CREDENTIALS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
PASSWORDS = {"admin": secrets.token_hex(12), "team-a": secrets.token_hex(12), "team-b": secrets.token_hex(12)}


def as_user(user: str | None) -> dict[str, str | None]:
    """Set MLflow's client variables for `user` (None: no credentials); returns what they were."""
    old = {k: os.environ.get(k) for k in CREDENTIALS}
    for k in CREDENTIALS:
        os.environ.pop(k, None)
    if user is not None:
        os.environ.update(dict(zip(CREDENTIALS, (user, PASSWORDS[user]), strict=True)))
    return old


def status_of(uri: str, path: str, user: str | None, **params: str) -> int:
    """The HTTP status of GET `path` on the server, as `user` (None: no Authorization header)."""
    request = urllib.request.Request(f"{uri}{path}?{urllib.parse.urlencode(params)}")
    if user is not None:
        basic = base64.b64encode(f"{user}:{PASSWORDS[user]}".encode()).decode()
        request.add_header("Authorization", f"Basic {basic}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            json.load(response)
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    """The server, with two team users created by the admin through MLflow's own auth client."""
    from mlflow.server import get_app_client

    tmp = tmp_path_factory.mktemp("mlflow-auth")
    with mlflow_server(tmp, str(tmp / "artifacts"), admin_password=PASSWORDS["admin"]) as uri:
        old = as_user("admin")
        try:
            admin = get_app_client("basic-auth", tracking_uri=uri)
            for team in ("team-a", "team-b"):
                admin.create_user(username=team, password=PASSWORDS[team])
        finally:
            restore_env(old)
        yield uri


@pytest.fixture(scope="module")
def tracked_job(server, tmp_path_factory) -> dict[str, str]:
    """team-a's quickstart, a few steps, tracked to the server with team-a's credentials."""
    tmp = tmp_path_factory.mktemp("job")
    shutil.copy(ROOT / "jobs" / "quickstart.yaml", tmp / "quickstart.yaml")  # its ./tidal-runs lands in tmp
    old = as_user("team-a")
    extra = {"MLFLOW_TRACKING_URI": server, "MLFLOW_EXPERIMENT_NAME": "team-a-experiments", "RAY_ADDRESS": "local"}
    old |= {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        proc = tidal_cli("run", str(tmp / "quickstart.yaml"), "--set", "train.steps=12", "--set", "train.log_every=4",
                         "--set", "train.warmup_steps=2", "--set", "checkpoint.every_steps=6",
                         "--set", "model.d_model=64", "--set", "model.n_head=2", cwd=tmp, timeout=540)
    finally:
        restore_env(old)
    (tmp / "job.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The last id named: a server that answers late has the header say "MLflow run None", then "created".
    run_id = re.findall(r"MLflow run\s+([0-9a-f]{32})", proc.stdout)[-1]
    return {"run_id": run_id, "output": proc.stdout + proc.stderr}


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): credentials by reference are unit-tested (test_secrets, test_submission)
def test_a_job_tracks_with_its_users_credentials(server, tracked_job):
    status = status_of(server, "/api/2.0/mlflow/runs/get", "team-a", run_id=tracked_job["run_id"])
    assert status == 200, tracked_job["output"][-4000:]
    old = as_user("team-a")
    try:
        client = MlflowClient(server)
        run = client.get_run(tracked_job["run_id"])
        experiment = client.get_experiment(run.info.experiment_id)
        losses = client.get_metric_history(run.info.run_id, "loss")
    finally:
        restore_env(old)
    assert experiment.name == "team-a-experiments" and run.info.status == "FINISHED"
    steps = [m.step for m in losses]
    assert {4, 8, 12} <= set(steps) and len(steps) == len(set(steps))  # every logged step reached the server
    shown = json.dumps({"params": run.data.params, "tags": run.data.tags}) + tracked_job["output"]
    assert PASSWORDS["team-a"] not in shown


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): MLflow's own auth refusing a client
def test_a_client_without_credentials_is_refused(server, tracked_job):
    assert status_of(server, "/api/2.0/mlflow/runs/get", None, run_id=tracked_job["run_id"]) == 401
    assert status_of(server, "/api/2.0/mlflow/experiments/search", None, max_results="10") == 401
    old = as_user(None)
    try:
        with pytest.raises(Exception, match="401|Unauthorized|credentials"):
            MlflowClient(server).get_run(tracked_job["run_id"])
    finally:
        restore_env(old)


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): MLflow's own permissions
def test_another_team_cannot_read_the_experiment_until_granted(server, tracked_job):
    from mlflow.server import get_app_client

    run_id = tracked_job["run_id"]
    assert status_of(server, "/api/2.0/mlflow/runs/get", "team-a", run_id=run_id) == 200
    assert status_of(server, "/api/2.0/mlflow/runs/get", "team-b", run_id=run_id) == 403
    assert status_of(server, "/api/2.0/mlflow/metrics/get-history", "team-b", run_id=run_id, metric_key="loss") == 403
    old = as_user("admin")
    try:
        experiment_id = MlflowClient(server).get_run(run_id).info.experiment_id
        get_app_client("basic-auth", tracking_uri=server).grant_user_permission(
            "team-b", "experiment", experiment_id, "READ")
    finally:
        restore_env(old)
    # the 403 was MLflow's permission model, not a broken user: a grant opens the same request
    assert status_of(server, "/api/2.0/mlflow/runs/get", "team-b", run_id=run_id) == 200
