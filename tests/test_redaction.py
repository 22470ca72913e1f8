"""One redaction rule for everything that leaves a process (tidal/redact.py): the rule alone, the
sinks that apply it without Ray, and (slow) a job whose every place holds a credential, searched
for in every sink: console, errors, --output json, the job record, MLflow's params, tags and
artifacts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import ONE_WORKER, tiny_spec
from tidal.cli import main
from tidal.errors import TidalError
from tidal.launch.result import RunResult
from tidal.output import parse_record, print_record
from tidal.redact import MASK, RedactingStream, redact_data, redact_text, redact_uri
from tidal.testing.runs import prepared_store

SECRET = "Sup3rSecretValue42"


@pytest.mark.parametrize(("uri", "shown"), [
    ("s3://AKIAKEY:Sup3rSecretValue42@bucket/runs", "s3://AKIAKEY:***@bucket/runs"),
    ("postgresql://ml:Sup3rSecretValue42@db:5432/mlflow", "postgresql://ml:***@db:5432/mlflow"),
    ("https://Sup3rSecretValue42@github.com/org/repo.git", "https://***@github.com/org/repo.git"),
    ("http://user:p%40ss@127.0.0.1:5000", "http://user:***@127.0.0.1:5000"),
    ("https://b.s3.amazonaws.com/d.jsonl?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIA%2F2026"
     "&X-Amz-Signature=abc123&X-Amz-Expires=60",
     "https://b.s3.amazonaws.com/d.jsonl?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=***"
     "&X-Amz-Signature=***&X-Amz-Expires=60"),
    ("https://storage.googleapis.com/b/o?X-Goog-Signature=ff00&X-Goog-Date=2026&alt=media",
     "https://storage.googleapis.com/b/o?X-Goog-Signature=***&X-Goog-Date=***&alt=media"),
    ("https://a.blob.core.windows.net/c/f?sv=2022-11-02&se=2026-12-01&sp=r&sig=AbC%3D#part",
     "https://a.blob.core.windows.net/c/f?sv=2022-11-02&se=***&sp=***&sig=***#part"),
    ("https://hf.co/x?token=abc&access_token=def&key=ghi&revision=main",
     "https://hf.co/x?token=***&access_token=***&key=***&revision=main"),
])
def test_uri_credentials_are_masked(uri: str, shown: str) -> None:
    assert redact_uri(uri) == shown


@pytest.mark.parametrize("uri", [
    "s3://bucket/runs", "sqlite:////tmp/x/mlflow.db", "file:///data/train.jsonl", "http://127.0.0.1:5000",
    "https://example.com/a%20b/c?page=2&sort=asc#top", "/plain/path", "hf://datasets/org/name",
])
def test_uris_without_credentials_are_unchanged(uri: str) -> None:
    assert redact_uri(uri) == uri


def test_text_masks_uris_assignments_and_secret_variables_of_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMIK7MDENGbPxRfiCY")
    monkeypatch.setenv("MY_SERVICE_TOKEN", "tok-0123456789")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAIOSFODNN7EXAMPLE")  # an id, not a secret
    text = ("error: cannot open s3://AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMIK7MDENGbPxRfiCY@b/runs (denied); "
            "HF_TOKEN=hf_abcdefghij and MLFLOW_TRACKING_PASSWORD: 'pw-inline' sent tok-0123456789")
    out = redact_text(text)
    for secret in ("wJalrXUtnFEMIK7MDENGbPxRfiCY", "hf_abcdefghij", "pw-inline", "tok-0123456789"):
        assert secret not in out
    assert "AKIAIOSFODNN7EXAMPLE" in out and "(denied)" in out and out.startswith("error: cannot open s3://")


def test_short_environment_values_do_not_mask_ordinary_words(monkeypatch) -> None:
    """moto's test key is `test`: masking it everywhere would mangle every message."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    assert redact_text("the tests passed") == "the tests passed"


def test_nested_data_masks_secret_keys_and_strings_at_any_depth() -> None:
    data = {"tracking": {"uri": f"http://u:{SECRET}@h:5000"}, "env": {"HF_TOKEN": SECRET, "LEVEL": "debug"},
            "list": [f"s3://k:{SECRET}@b/x", 3, None], "steps": 10, "api_key": SECRET}
    out = redact_data(data)
    assert SECRET not in json.dumps(out)
    assert out["env"]["LEVEL"] == "debug" and out["steps"] == 10 and out["list"][1:] == [3, None]
    assert data["tracking"]["uri"].endswith("@h:5000") and SECRET in data["api_key"]  # the input is untouched


def test_spec_params_and_printed_spec_are_redacted_but_the_spec_keeps_its_values(tmp_path) -> None:
    storage = f"s3://KEY:{SECRET}@bucket/runs"
    spec = tiny_spec(tmp_path, **{"checkpoint.storage": storage, "tracking.uri": f"http://u:{SECRET}@127.0.0.1:5000"})
    assert SECRET not in json.dumps(spec.flat()) and SECRET not in json.dumps(spec.redacted())
    assert spec.flat()["checkpoint.storage"] == "s3://KEY:***@bucket/runs"
    assert spec.checkpoint.storage == storage  # where it is used, the value is whole


def test_a_spec_without_credentials_is_tracked_as_before(tmp_path) -> None:
    spec = tiny_spec(tmp_path)
    data = spec.model_dump(mode="json")
    assert spec.redacted() == {**data, "env": {}}


def test_job_record_and_summary_are_redacted(capsys) -> None:
    print_record({"name": "j", "storage": f"s3://K:{SECRET}@b/runs", "tracking_uri": f"http://u:{SECRET}@h"})
    result = RunResult("j", "run1", f"http://u:{SECRET}@h", f"s3://K:{SECRET}@b/runs", {"loss": 1.0})
    print(result.summary())
    out = capsys.readouterr().out
    assert SECRET not in out
    assert parse_record(out)["storage"] == "s3://K:***@b/runs"


def test_errors_are_shown_redacted() -> None:
    e = TidalError(f"cannot reach http://u:{SECRET}@127.0.0.1:1/ (refused)")
    assert SECRET not in str(e) and "(refused)" in str(e)


def test_redacting_stream_masks_what_is_printed_through_it(capsys) -> None:
    stream = RedactingStream(sys.stdout)
    print(f"[tidal] storage s3://K:{SECRET}@b/runs", file=stream, flush=True)
    assert capsys.readouterr().out == f"[tidal] storage s3://K:{MASK}@b/runs\n"


def test_validate_prints_no_credential(tmp_path, capsys) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(f"name: j\ncheckpoint:\n  storage: s3://KEY:{SECRET}@bucket/runs\n"
                   f"tracking:\n  uri: http://user:{SECRET}@127.0.0.1:5000\n")
    assert main(["validate", str(job)]) == 0
    out = capsys.readouterr()
    assert SECRET not in out.out + out.err and "s3://KEY:***@bucket/runs" in out.out


def test_cli_errors_are_printed_redacted(tmp_path, capsys) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(f"name: j\ncheckpoint:\n  storage: s3://KEY:{SECRET}@bucket/runs\n  nonsense: 1\n")
    assert main(["validate", str(job), "--set", f"data.source=https://x/d?sig={SECRET}"]) == 2
    out = capsys.readouterr()
    assert SECRET not in out.out + out.err and "nonsense" in out.err


def test_runs_json_is_redacted(tmp_path, capsys) -> None:
    """`tidal runs --output json` of a run whose params hold credentials as an older Tidal logged them."""
    import mlflow

    uri = prepared_store(tmp_path / "mlflow.db")
    client = mlflow.tracking.MlflowClient(uri)
    exp = client.create_experiment("tests", str(tmp_path / "art"))
    run = client.create_run(exp, run_name="old", tags={"tidal.job": "old", "tidal.run_dir": f"s3://K:{SECRET}@b/old"})
    client.log_param(run.info.run_id, "checkpoint.storage", f"s3://K:{SECRET}@b")
    assert main(["runs", "--uri", uri, "--experiment", "tests", "--output", "json"]) == 0
    out = capsys.readouterr()
    assert "old" in out.out and SECRET not in out.out + out.err


# --- end to end: a job whose every place holds a credential -------------------------------------
STORAGE_SECRET, TRACKING_SECRET, ENV_SECRET = "StoreSecret0123456789", "TrackSecret0123456789", "EnvSecret0123456789"


@pytest.mark.slow
def test_no_sink_of_a_job_holds_its_credentials(tmp_path, bucket) -> None:
    """`tidal run` with credentials in `checkpoint.storage`'s user-info (pyarrow and moto accept it),
    in `tracking.uri`'s user-info (requests sends it as basic auth; a plain `mlflow server` ignores
    it) and in secret variables of the job's environment: none reaches the console, MLflow's store
    (params, tags, metrics, artifacts), the job's files in storage or `tidal runs --output json`."""
    import boto3

    from tests.helpers import tidal_cli
    from tidal.testing.processes import patched_env
    from tidal.testing.servers import MlflowServer

    db = tmp_path / "server.db"
    server = MlflowServer(tmp_path, str(tmp_path / "artifacts"), direct_artifacts=True, db=db)
    server.start()
    try:
        tracking = f"http://tidal:{TRACKING_SECRET}@127.0.0.1:{server.port}"
        spec = tiny_spec(tmp_path, name="creds", **{
            "train.steps": 8, "checkpoint.every_steps": 4, **ONE_WORKER,
            "checkpoint.storage": f"s3://AKIATEST:{STORAGE_SECRET}@{bucket[len('s3://'):]}/runs", "tracking.uri": tracking})
        job = tmp_path / "job.yaml"
        job.write_text(json.dumps(spec.model_dump(mode="json")))  # JSON is YAML
        env = {"MLFLOW_TRACKING_USERNAME": "tidal", "MLFLOW_TRACKING_PASSWORD": ENV_SECRET}
        with patched_env(env):
            run = tidal_cli("run", str(job), cwd=tmp_path, timeout=540)
            runs = tidal_cli("runs", "--uri", tracking, "--experiment", "tests", "--output", "json", cwd=tmp_path)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert "[tidal] step 8/8" in run.stdout and runs.returncode == 0 and '"creds"' in runs.stdout, runs.stderr
        sinks = {"tidal run stdout": run.stdout, "tidal run stderr": run.stderr,
                 "tidal runs --output json": runs.stdout + runs.stderr, "MLflow store": _bytes_under(tmp_path, db)}
        s3 = boto3.client("s3")
        for obj in s3.list_objects_v2(Bucket=bucket[len("s3://"):])["Contents"]:
            if not obj["Key"].endswith(".pt"):  # job record, manifests, event log, Ray's state
                sinks[obj["Key"]] = s3.get_object(Bucket=bucket[len("s3://"):], Key=obj["Key"])["Body"].read().decode(
                    errors="replace")
        leaks = [(where, secret) for where, text in sinks.items()
                 for secret in (STORAGE_SECRET, TRACKING_SECRET, ENV_SECRET) if secret in text]
        assert not leaks, leaks
        assert "s3://AKIATEST:***@" in run.stdout  # redacted where shown, not dropped
    finally:
        server.stop()


def _bytes_under(tmp: Path, db: Path) -> str:
    """The MLflow server's database and every artifact it stores, as text."""
    files = [db, *(p for p in (tmp / "artifacts").rglob("*") if p.is_file())]
    return "\n".join(p.read_bytes().decode(errors="replace") for p in files)


def test_a_secret_reference_is_shown_not_masked():
    """`env:VAR` / `file:/path` say where a secret is, never what it is (tidal/spec/secrets.py)."""
    assert redact_text("HF_TOKEN=env:NODE_HF DB_PASSWORD: file:/etc/s/db") == "HF_TOKEN=env:NODE_HF DB_PASSWORD: file:/etc/s/db"
    assert redact_data({"HF_TOKEN": "file:/etc/s/hf", "API_KEY": "abc123456"}) == {"HF_TOKEN": "file:/etc/s/hf", "API_KEY": MASK}
