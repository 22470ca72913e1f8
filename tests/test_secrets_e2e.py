"""Secrets by reference against a real Ray head with token auth (tests/conftest.py's cluster: its
`mlflow server` with artifacts on moto S3, TIDAL_STORAGE on S3; the nodes' MLFLOW_TRACKING_URI
holding a user and password): a job with two secrets, one from the head's environment and one from
a file on it, submitted with `tidal submit` and with plain `ray job submit`. Every worker reads
both, and the user's step function prints one; neither value, nor the tracking URI's password, is
in Ray's job list (`ray job list`; Ray 2.60's has no --format json) or the Jobs API (the spec in
`tidal submit`'s entrypoint decoded from its base64), Ray Train's state API, the job's logs and
record, MLflow (params, tags, artifacts), the bucket, or any file the test session wrote. A laptop
whose MLFLOW_TRACKING_URI holds a password, or a spec whose checkpoint.storage does, is refused
at `tidal submit` and leaves nothing on the Jobs API."""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, restore_env, tiny_spec
from tests.secrets_probe import NAMES, digest
from tidal.cli import main
from tidal.launch.jobs import connect
from tidal.output import parse_record
from tidal.testing.heads import ray_head

pytestmark = pytest.mark.slow
NODE_VAR = "TIDAL_TEST_NODE_HF_TOKEN"


@pytest.fixture(scope="module", autouse=True)
def node_secrets(tmp_path_factory) -> Iterator[dict[str, str]]:
    """The cluster's secrets, put there before the head starts (autouse: before `head`): HF_TOKEN in
    the nodes' environment, DB_PASSWORD in a file on them (a mounted Kubernetes Secret, say), and
    the password in the cluster's own MLFLOW_TRACKING_URI (`head` below)."""
    values = {"HF_TOKEN": f"hf-{secrets.token_hex(12)}", "DB_PASSWORD": f"pw-{secrets.token_hex(12)}",
              "uri_password": f"uri-{secrets.token_hex(12)}"}
    path = tmp_path_factory.mktemp("node-secrets") / "db_password"
    path.write_text(values["DB_PASSWORD"] + "\n")
    # State tracking on: Ray Train's state API then holds each run's train_loop_config (the spec).
    node_env = {NODE_VAR: values["HF_TOKEN"], "RAY_TRAIN_ENABLE_STATE_TRACKING": "1"}
    old = {k: os.environ.get(k) for k in node_env}
    os.environ.update(node_env)
    yield {**values, "file": str(path)}
    restore_env(old)


@pytest.fixture(scope="module")
def head(tmp_path_factory, cluster_env, node_secrets) -> Iterator[str]:
    """conftest's head, but the nodes' MLFLOW_TRACKING_URI holds a user and password, as a cluster's
    may (`http://user:password@host:5000`; the tracking server here runs without auth and ignores
    them): a job run through the Jobs API tracks there, and the password must show nowhere."""
    uri = cluster_env["MLFLOW_TRACKING_URI"].replace("http://", f"http://tidal-jobs:{node_secrets['uri_password']}@", 1)
    assert node_secrets["uri_password"] in uri
    tmp = tmp_path_factory.mktemp("head")  # short: Ray's socket paths under it stay below 108 bytes
    with ray_head(tmp, 2, {**cluster_env, "MLFLOW_TRACKING_URI": uri}, ray_tmp=tmp / "ray",
                  auth_mode_in_client=False) as h:
        yield h.address


def secret_spec(tmp: Path, name: str, node_secrets: dict[str, str]):
    """A tiny job whose step function records, per rank, a hash of each secret it sees."""
    probe = tmp / "probe"
    probe.mkdir()
    spec = tiny_spec(tmp, name=name).with_overrides({
        "checkpoint.storage": None, "tracking.uri": None,  # the cluster's: its S3 bucket and mlflow server
        "train.steps": 8, "checkpoint.every_steps": 4, "train.step_fn": "tests.secrets_probe:step",
        "worker_env": {"TIDAL_TEST_PROBE_DIR": str(probe)},
        "env": {"HF_TOKEN": f"env:{NODE_VAR}", "DB_PASSWORD": {"from_file": node_secrets["file"]}},
    })
    return spec, probe


def test_tidal_submit_keeps_secrets_on_the_workers(head, cluster_env, node_secrets, tmp_path, monkeypatch,
                                                   tmp_path_factory):
    monkeypatch.chdir(ROOT)
    for var in ("MLFLOW_TRACKING_URI", "TIDAL_STORAGE"):
        monkeypatch.delenv(var, raising=False)  # the cluster decides
    spec, probe = secret_spec(tmp_path, "secret-submit", node_secrets)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    assert main(["submit", str(path), "--address", head, "--follow"]) == 0
    job_id = next(j.submission_id for j in connect(head).list_jobs() if (j.metadata or {}).get("tidal.job") == spec.name)
    check_secrets_kept(head, job_id, cluster_env, node_secrets, probe, tmp_path_factory)


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): plain `ray job submit` runs in test_one_live_attempt; the secrets path in the tidal submit test
def test_plain_ray_job_submit_keeps_secrets_on_the_workers(head, cluster_env, node_secrets, tmp_path,
                                                           tmp_path_factory):
    spec, probe = secret_spec(tmp_path, "secret-plain", node_secrets)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    job_id = f"secret-plain-{secrets.token_hex(4)}"
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    for var in ("MLFLOW_TRACKING_URI", "TIDAL_STORAGE"):
        env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, "-m", "ray.scripts.scripts", "job", "submit", "--address", head, "--working-dir", str(ROOT),
         "--submission-id", job_id, "--", "tidal", "run", str(path)],
        env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_secrets_kept(head, job_id, cluster_env, node_secrets, probe, tmp_path_factory, printed=proc.stdout + proc.stderr)


def check_secrets_kept(head: str, job_id: str, cluster_env: dict[str, str], node_secrets: dict[str, str],
                       probe: Path, tmp_path_factory, printed: str = "") -> None:
    values = [node_secrets[k] for k in (*NAMES, "uri_password")]
    # Every rank read both.
    seen = {p.name: json.loads(p.read_text()) for p in probe.glob("*.json")}
    assert seen == {f"{r}.json": {k: digest(node_secrets[k]) for k in NAMES} for r in (0, 1)}, seen

    # Ray: the job list (CLI and API), the job's info, its logs and the record in them.
    client = connect(head)
    listed = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "job", "list", "--address", head],
                            env={**os.environ, "RAY_AUTH_MODE": "token"},
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0 and job_id in listed.stdout, listed.stderr[-2000:]
    logs = client.get_job_logs(job_id)
    record = parse_record(logs)
    assert record.get("mlflow_run_id"), logs[-2000:]
    runs = train_runs(head)
    assert record["name"] in runs, "Ray Train's state API lists the run (and its train_loop_config)"
    assert "the probe sees *** as its token" in logs, "the user's print of its secret reached the logs, masked"
    infos = repr(client.list_jobs())
    ray_views = {"ray job list": decoded(listed.stdout), "Ray Train state API": runs, "list_jobs": decoded(infos),
                 "get_job_info": decoded(repr(client.get_job_info(job_id))), "logs": logs, "record": json.dumps(record),
                 "printed": printed}

    # MLflow: params, tags, and every artifact of the run.
    import mlflow
    from mlflow.tracking import MlflowClient

    run = MlflowClient(cluster_env["MLFLOW_TRACKING_URI"]).get_run(record["mlflow_run_id"])
    artifacts = Path(mlflow.artifacts.download_artifacts(run_id=run.info.run_id, dst_path=str(probe.parent / "art"),
                                                         tracking_uri=cluster_env["MLFLOW_TRACKING_URI"]))
    files = [p for p in artifacts.rglob("*") if p.is_file()]
    assert files, "the run has artifacts (its spec.yaml at least)"
    mlflow_views = {"params": json.dumps(run.data.params), "tags": json.dumps(run.data.tags),
                    **{f"artifact {p.name}": p.read_bytes().decode(errors="replace") for p in files}}
    for where, text in {**ray_views, **mlflow_views}.items():
        for value in values:
            assert value not in text, f"a secret value is in {where}"

    # Every object in the cluster's bucket (checkpoints, the job's files, MLflow's artifacts) and every
    # file this test session wrote (the head's Ray logs, MLflow's database...), but the secret file itself.
    import boto3

    s3 = boto3.client("s3")
    bucket = cluster_env["TIDAL_STORAGE"].removeprefix("s3://").split("/")[0]
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
            for o in page.get("Contents", [])]
    assert any("checkpoint_000000008" in k for k in keys), "the job checkpointed into the bucket"
    for key in keys:
        body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        assert not [v for v in values if v.encode() in body], f"a secret value is in s3://{bucket}/{key}"
    for p in Path(tmp_path_factory.getbasetemp()).rglob("*"):
        if p.is_file() and not p.is_symlink() and str(p) != node_secrets["file"]:
            data = p.read_bytes()
            assert not [v for v in values if v.encode() in data], f"a secret value is in {p}"


def decoded(text: str) -> str:
    """`text` and, after it, every base64 payload in it decoded: `tidal submit`'s entrypoint carries
    the spec base64-encoded, where a plain search would miss a secret."""
    payloads = re.findall(r"[A-Za-z0-9_\-]{40,}={0,2}", text)
    out = [text]
    for p in payloads:
        try:
            out.append(base64.urlsafe_b64decode(p + "=" * (-len(p) % 4)).decode(errors="replace"))
        except ValueError:
            continue
    return "\n".join(out)


def test_decoded_finds_what_base64_hides():
    secret = "pw-0123456789abcdef"
    payload = base64.urlsafe_b64encode(json.dumps({"tracking": {"uri": f"http://a:{secret}@h"}}).encode()).decode()
    text = f"JobDetails(entrypoint='python -m tidal.launch.entrypoint {payload}')"
    assert secret not in text and secret in decoded(text)


def test_tidal_submit_refuses_a_credential_and_sends_nothing(head, tmp_path, monkeypatch, capsys):  # noqa: F811
    """Today's code sent both: the laptop's MLFLOW_TRACKING_URI verbatim in the runtime_env, the spec
    in the entrypoint, shown to every token holder by `ray job list` and the dashboard."""
    password = f"pw-{secrets.token_hex(12)}"
    monkeypatch.chdir(ROOT)
    path = tmp_path / "job.yaml"
    for name, env, overrides in (
        ("cred-env", {"MLFLOW_TRACKING_URI": f"http://alice:{password}@mlflow.example:5000"}, {}),
        ("cred-storage", {}, {"checkpoint.storage": f"s3://AKIAEXAMPLE:{password}@bucket/runs"}),
    ):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        path.write_text(yaml.safe_dump(tiny_spec(tmp_path, name=name, **overrides).model_dump(mode="json")))
        assert main(["submit", str(path), "--address", head]) != 0
        captured = capsys.readouterr()
        assert "holds a credential" in captured.err and password not in captured.out + captured.err
        for k in env:
            monkeypatch.delenv(k)
    listed = decoded(repr(connect(head).list_jobs()))
    assert password not in listed and "cred-env" not in listed and "cred-storage" not in listed


def train_runs(address: str) -> str:
    """Ray Train V2's state API (its runs and their train_loop_config), as the dashboard shows it to every
    token holder."""
    import urllib.request

    from tidal.ray_auth import auth_token

    request = urllib.request.Request(f"{address}/api/train/v2/runs/v1", headers={"Authorization": f"Bearer {auth_token()}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read().decode()
