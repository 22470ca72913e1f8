"""Multipart uploads a killed writer left incomplete in the job's folder are aborted when an
attempt starts (fs.abort_incomplete_uploads, called by rank 0 through session.abort_dead_uploads),
on a real S3 API (moto's server); uploads elsewhere in the bucket are left alone."""

from __future__ import annotations

import sys

import boto3
import pytest

from tests.conftest import tiny_spec
from tidal import fs
from tidal.storage import RunDir
from tidal.tracking.buffer import MetricsBuffer
from tidal.tracking.emitter import Emitter
from tidal.worker.session import abort_dead_uploads


def start_upload(bucket: str, key: str) -> None:
    s3 = boto3.client("s3")
    name = bucket.removeprefix("s3://")
    upload = s3.create_multipart_upload(Bucket=name, Key=key)
    s3.upload_part(Bucket=name, Key=key, UploadId=upload["UploadId"], PartNumber=1, Body=b"x" * 1024)


def open_uploads(bucket: str) -> list[str]:
    return sorted(u["Key"] for u in boto3.client("s3").list_multipart_uploads(
        Bucket=bucket.removeprefix("s3://")).get("Uploads", []))


def notes(spec) -> list[str]:
    run = RunDir(spec.checkpoint.storage, spec.name)
    return [e["text"] for e in MetricsBuffer(run.fs, run.path).load() if e.get("kind") == "note"]


@pytest.mark.slow
def test_an_attempt_start_aborts_the_jobs_incomplete_uploads_only(bucket, tmp_path):
    spec = tiny_spec(tmp_path, name="job", **{"checkpoint.storage": f"{bucket}/runs"})
    start_upload(bucket, "runs/job/checkpoint_000008/mp_rank_00_model_states.pt")
    start_upload(bucket, "runs/job/checkpoint_000016/zero_pp_rank_1_mp_rank_00_optim_states.pt")
    start_upload(bucket, "runs/job2/checkpoint_000008/mp_rank_00_model_states.pt")  # another job: a prefix of it
    start_upload(bucket, "elsewhere/big.bin")
    # The tracker's or the controller's small write in flight right now (pyarrow uploads in parts).
    start_upload(bucket, "runs/job/tidal-mlflow-sent.json")
    events = Emitter(spec.checkpoint.storage, spec.name)
    abort_dead_uploads(spec, events)
    assert events.drain(timeout_s=30)

    assert open_uploads(bucket) == ["elsewhere/big.bin", "runs/job/tidal-mlflow-sent.json",
                                    "runs/job2/checkpoint_000008/mp_rank_00_model_states.pt"]
    assert notes(spec) == ["aborted 2 incomplete upload(s) an earlier attempt left in the job's folder"]
    assert fs.abort_incomplete_uploads(spec.checkpoint.storage, spec.name) == 0, "nothing left"


@pytest.mark.slow
def test_the_uris_own_endpoint_and_credentials_are_used(bucket, s3_server, monkeypatch):
    start_upload(bucket, "r/job/a.pt")
    for var in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var)
    host = s3_server.removeprefix("http://")
    uri = f"s3://KEY:SECRET@{bucket.removeprefix('s3://')}/r?endpoint_override={host}&scheme=http"
    assert fs.abort_incomplete_uploads(uri, "job") == 1


@pytest.mark.slow
def test_no_boto3_is_one_warning_and_training_goes_on(bucket, tmp_path, monkeypatch):
    spec = tiny_spec(tmp_path, name="noboto", **{"checkpoint.storage": f"{bucket}/runs"})
    start_upload(bucket, "runs/noboto/a.pt")
    monkeypatch.setitem(sys.modules, "boto3", None)  # import boto3 raises ImportError
    events = Emitter(spec.checkpoint.storage, spec.name)
    abort_dead_uploads(spec, events)
    assert events.drain(timeout_s=30)
    [note] = notes(spec)
    assert note.startswith("WARNING: could not abort incomplete uploads") and "pip install boto3" in note
    assert "docs/cluster.md" in note and bucket.removeprefix("s3://") not in note


@pytest.mark.parametrize("storage", ["/tmp/somewhere", "gs://bucket/x"])
def test_other_storage_has_none(storage):
    assert fs.abort_incomplete_uploads(storage, "job") == 0
