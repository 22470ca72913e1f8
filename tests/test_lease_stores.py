"""One live attempt per job on every store (tidal/exclusive.py, tidal/lease.py): each store's own
exclusive create (GCS's `ifGenerationMatch=0` on a GCS JSON API on 127.0.0.1), a clear refusal
where a store has none or ignores it (a filesystem without an exclusive create, a GCS endpoint
that ignores the precondition, an S3-compatible store that ignores `If-None-Match`: moto's server
behind a proxy that drops it), Azure Blob Storage's `If-None-Match: *` on Azurite, the user's
explicit opt-out, and a tie made visible by the nonce each creator writes."""

from __future__ import annotations

import base64
import json
import threading
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from tidal import exclusive
from tidal import lease as lease_mod
from tidal.errors import JobAlreadyRunning
from tidal.exclusive import NotExclusive
from tidal.lease import Lease
from tidal.testing.object_stores import (
    AZURITE_ACCOUNT,
    AZURITE_KEY,
    azure_filesystem,
    azurite_blob,
    azurite_path,
    gcs_filesystem,
    gcs_server,
    if_none_match_dropped,
)


def on_store(monkeypatch, store: pafs.FileSystem, root: str) -> None:
    """Every lease of this test on `store` under `root` (a bucket/prefix, as fs.resolve gives it)."""
    monkeypatch.setattr(lease_mod, "lease_path", lambda _s, name: (store, f"{root}/{name}.lease"))


def race(storage: str, n: int = 4) -> list[str]:
    results: list[str] = []

    def start() -> None:
        try:
            Lease(storage, "job", ttl=30).acquire()
            results.append("won")
        except JobAlreadyRunning:
            results.append("refused")

    threads = [threading.Thread(target=start) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(results)


def one_won_leaving_one_generation(storage: str, store: pafs.FileSystem) -> None:
    """Of 4 racing starts on `storage` (its bucket/prefix `tidal/runs` on `store`), one won generation 1,
    and the store's probe left nothing behind."""
    assert race(storage) == ["refused", "refused", "refused", "won"]
    holder = lease_mod.latest(store, "tidal/runs/job.lease")
    assert holder is not None and holder.generation == 1
    names = [i.base_name for i in store.get_file_info(pafs.FileSelector("tidal/runs/job.lease"))]
    assert names == ["000000000001.json"], "the probe left nothing behind"


def no_exclusive_create(tmp_path: Path) -> pafs.FileSystem:
    """A filesystem pyarrow can use but that has no exclusive create (fsspec's, through pyarrow)."""
    import fsspec

    return pafs.PyFileSystem(pafs.FSSpecHandler(fsspec.filesystem("file")))


def test_a_store_without_an_exclusive_create_is_refused_naming_it_and_what_to_do(tmp_path, monkeypatch):
    monkeypatch.delenv(exclusive.UNFENCED_ENV, raising=False)
    on_store(monkeypatch, no_exclusive_create(tmp_path), str(tmp_path / "runs"))
    with pytest.raises(NotExclusive) as e:
        Lease("elsewhere://runs", "job").acquire()
    text = str(e.value)
    assert "fsspec" in text and "no exclusive create" in text and f"{exclusive.UNFENCED_ENV}=1" in text
    assert not (tmp_path / "runs" / "job.lease").exists() or not any((tmp_path / "runs" / "job.lease").iterdir())


def test_the_user_may_accept_a_check_then_write_lease_explicitly(tmp_path, monkeypatch):
    monkeypatch.setenv(exclusive.UNFENCED_ENV, "1")
    on_store(monkeypatch, no_exclusive_create(tmp_path), str(tmp_path / "runs"))
    assert Lease("elsewhere://runs", "job").acquire() == 1
    with pytest.raises(JobAlreadyRunning):
        Lease("elsewhere://runs", "job").acquire()


def test_a_tie_on_one_generation_is_seen_and_the_overwritten_holder_stops(tmp_path):
    """A store that let two creates of one generation file both succeed: the start whose write
    came first finds the other's nonce there at its next renewal and stops, as its writers do."""
    storage = str(tmp_path / "runs")
    first = Lease(storage, "job", ttl=30)
    first.acquire()
    check = first.check()
    path = Path(first._file(1))
    other = {**json.loads(path.read_text()), "host": "gpu-node-7", "pid": 4242, "nonce": "another-start"}
    path.write_text(json.dumps(other))  # the second "winner" wrote last
    assert not first.renew() and first.lost.is_set()
    assert first.taken_by is not None and first.taken_by.host == "gpu-node-7"
    assert not check.current(fresh=True)
    assert json.loads(path.read_text())["nonce"] == "another-start", "the stopped holder wrote nothing"


def test_a_create_whose_read_back_shows_another_nonce_is_lost(tmp_path, monkeypatch):
    storage = str(tmp_path / "runs")
    real = lease_mod.create_exclusive

    def both_win(store, path, data) -> bool:  # a store ignoring the condition, the other start's write last
        real(store, path, data)
        Path(path).write_text(json.dumps({**data, "nonce": "another-start", "host": "gpu-node-7", "pid": 4242}))
        return True

    monkeypatch.setattr(lease_mod, "create_exclusive", both_win)
    with pytest.raises(JobAlreadyRunning, match="gpu-node-7"):
        Lease(storage, "job").acquire()


@pytest.mark.slow
def test_on_gcs_exactly_one_of_racing_starts_wins(tmp_path, monkeypatch):
    with gcs_server(tmp_path / "gcs.log") as endpoint:
        on_store(monkeypatch, gcs_filesystem(endpoint), "tidal/runs")
        one_won_leaving_one_generation("gs://tidal/runs", gcs_filesystem(endpoint))


@pytest.mark.slow
def test_a_gcs_endpoint_that_ignores_the_precondition_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv(exclusive.UNFENCED_ENV, raising=False)
    with gcs_server(tmp_path / "gcs.log", honour_preconditions=False) as endpoint:
        on_store(monkeypatch, gcs_filesystem(endpoint), "tidal/runs")
        with pytest.raises(NotExclusive, match=r"gs://tidal \(endpoint 127.0.0.1:\d+\) ignores the condition"):
            Lease("gs://tidal/runs", "job").acquire()


@pytest.mark.slow
def test_an_s3_store_that_ignores_if_none_match_is_refused_and_a_real_one_is_not(tmp_path, monkeypatch, bucket):
    import os

    monkeypatch.delenv(exclusive.UNFENCED_ENV, raising=False)
    name = bucket.removeprefix("s3://")
    with if_none_match_dropped(tmp_path / "proxy.log", os.environ["AWS_ENDPOINT_URL"]) as proxy:
        store = pafs.S3FileSystem(endpoint_override=proxy.removeprefix("http://"), scheme="http",
                                  access_key="test", secret_key="test", region="us-east-1")
        on_store(monkeypatch, store, f"{name}/runs")
        with pytest.raises(NotExclusive, match="ignores the condition") as e:
            Lease(f"{bucket}/runs", "job").acquire()
        assert f"s3://{name}" in str(e.value) and "MinIO" in str(e.value)
        left = store.get_file_info(pafs.FileSelector(f"{name}/runs", allow_not_found=True, recursive=True))
        assert [i.path for i in left if i.type == pafs.FileType.File] == [], "no generation, no probe left"
    monkeypatch.undo()
    assert race(f"{bucket}/runs") == ["refused", "refused", "refused", "won"]  # moto itself honours it


@pytest.mark.slow
def test_a_conditional_put_keeps_the_stores_session_token(tmp_path, monkeypatch):
    """STS credentials (an assumed role's key, secret and session token) on an S3 API that checks
    them (moto's server with IAM auth on): the lease's conditional PUT signs with the token too."""
    import boto3

    from tidal.testing.processes import patched_env
    from tidal.testing.servers import moto_s3

    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
    trust = {"Version": "2012-10-17",
             "Statement": [{"Effect": "Allow", "Principal": {"AWS": "*"}, "Action": "sts:AssumeRole"}]}
    # moto checks credentials after its first 4 requests: the bucket, the role, its policy, the assumption.
    with moto_s3(tmp_path / "moto.log", server_env={"INITIAL_NO_AUTH_ACTION_COUNT": "4"},
                 buckets=("tidal-sts",)) as endpoint:
        iam = boto3.client("iam")
        iam.create_role(RoleName="trainer", AssumeRolePolicyDocument=json.dumps(trust))
        iam.put_role_policy(RoleName="trainer", PolicyName="s3", PolicyDocument=json.dumps(policy))
        creds = boto3.client("sts").assume_role(RoleArn="arn:aws:iam::123456789012:role/trainer",
                                                RoleSessionName="tidal-test")["Credentials"]
        sts = {"access_key": creds["AccessKeyId"], "secret_key": creds["SecretAccessKey"],
               "session_token": creds["SessionToken"]}
        # Given to pyarrow's filesystem, as a program building its own does:
        store = pafs.S3FileSystem(endpoint_override=endpoint.removeprefix("http://"), scheme="http",
                                  region="us-east-1", **sts)
        on_store(monkeypatch, store, "tidal-sts/runs")
        assert Lease("s3://tidal-sts/runs", "job").acquire() == 1
        with pytest.raises(JobAlreadyRunning):
            Lease("s3://tidal-sts/runs", "job").acquire()
        # And in the standard AWS environment, as a cluster's nodes have them:
        monkeypatch.undo()
        with patched_env({"AWS_ACCESS_KEY_ID": sts["access_key"], "AWS_SECRET_ACCESS_KEY": sts["secret_key"],
                          "AWS_SESSION_TOKEN": sts["session_token"]}):
            assert Lease("s3://tidal-sts/env-runs", "job").acquire() == 1


needs_azurite = pytest.mark.skipif(azurite_path() is None, reason="Azurite is not installed (npm install -g azurite; "
                                   ".ci/run installs it where npm is)")


@pytest.mark.slow
@needs_azurite
def test_on_azure_blob_storage_exactly_one_of_racing_starts_wins(tmp_path, monkeypatch):
    """Azure was refused before (no exclusive create Tidal used): a Put Blob with If-None-Match, signed
    with the filesystem's account key, on Azure's own emulator, which checks both."""
    monkeypatch.delenv(exclusive.UNFENCED_ENV, raising=False)
    with azurite_blob(tmp_path) as endpoint:
        on_store(monkeypatch, azure_filesystem(endpoint), "tidal/runs")
        one_won_leaving_one_generation("abfs://tidal/runs", azure_filesystem(endpoint))
        exclusive._PROBED.clear()
        wrong = azure_filesystem(endpoint, key=base64.b64encode(b"x" * 64).decode())  # Azurite checks the signature
        with pytest.raises(exclusive.CredentialsRefused, match="HTTP 403"):
            exclusive.create_exclusive(wrong, "tidal/runs/other.json", {})


AZURE_VARS = ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_KEY", "AZURE_STORAGE_ACCOUNT_KEY",
              "AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_ACCOUNT_NAME")
AZURE_URI = f"abfs://tidal@{AZURITE_ACCOUNT}.dfs.core.windows.net"  # as Azure's own docs write one


def no_azure_env(monkeypatch) -> None:
    monkeypatch.delenv(exclusive.UNFENCED_ENV, raising=False)
    for var in AZURE_VARS:
        monkeypatch.delenv(var, raising=False)


def connection_string(endpoint: str, key: str = AZURITE_KEY) -> str:
    """What `az storage account show-connection-string` prints, for Azurite at `endpoint`."""
    return (f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={key};"
            f"BlobEndpoint=http://{endpoint}/{AZURITE_ACCOUNT};")


@pytest.mark.slow
@needs_azurite
def test_a_job_on_azurite_reached_only_through_its_abfs_uri_and_the_environment(tmp_path, monkeypatch):
    """What an Azure user sets: an abfs:// storage URI and Azure's own variables (a connection string
    naming the emulator's endpoint; or an account key, with the endpoint in the URI). The job starts
    (its lease, its run folder), two racing starts leave one winner, and a wrong key is refused
    naming what to set."""
    from tidal.errors import TidalError
    from tidal.storage import RunDir

    no_azure_env(monkeypatch)
    with azurite_blob(tmp_path) as endpoint:
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", connection_string(endpoint))
        assert Lease(f"{AZURE_URI}/runs", "started", ttl=30).acquire() == 1
        run = RunDir(f"{AZURE_URI}/runs", "started")
        run.write_json("job.json", {"a": 1})
        assert run.read_json("job.json") == {"a": 1}
        assert race(f"{AZURE_URI}/race", n=2) == ["refused", "won"]
        # The key from Azure CLI's variable, the emulator's endpoint in the URI (pyarrow's form for it)
        monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING")
        monkeypatch.setenv("AZURE_STORAGE_KEY", AZURITE_KEY)
        assert Lease(f"abfs://{AZURITE_ACCOUNT}@{endpoint}/tidal/by-key?enable_tls=false", "job").acquire() == 1
        monkeypatch.delenv("AZURE_STORAGE_KEY")
        exclusive._PROBED.clear()
        wrong = base64.b64encode(b"x" * 64).decode()  # Azurite checks the signature
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", connection_string(endpoint, wrong))
        with pytest.raises(TidalError) as e:
            Lease(f"{AZURE_URI}/wrong", "job").acquire()
        text = str(e.value)
        assert "refused" in text and "AZURE_STORAGE_CONNECTION_STRING" in text and "AccountKey" in text
        assert wrong not in text, "the key is never shown"


@pytest.mark.parametrize("env, blob, dfs", [
    # a sovereign cloud: its Data Lake (dfs) host is its own, beside the blob one (hierarchical namespace accounts)
    ({"AZURE_STORAGE_CONNECTION_STRING": "AccountName=acct;AccountKey=a2V5;EndpointSuffix=core.chinacloudapi.cn"},
     ".blob.core.chinacloudapi.cn", ".dfs.core.chinacloudapi.cn"),
    ({"AZURE_STORAGE_CONNECTION_STRING": "AccountName=acct;AccountKey=a2V5;"
                                         "BlobEndpoint=https://acct.blob.core.usgovcloudapi.net/"},
     ".blob.core.usgovcloudapi.net", ".dfs.core.usgovcloudapi.net"),
    # an emulator's one host serves both
    ({"AZURE_STORAGE_CONNECTION_STRING": "AccountName=acct;AccountKey=a2V5;BlobEndpoint=http://127.0.0.1:10000/acct"},
     "127.0.0.1:10000", "127.0.0.1:10000"),
])
def test_the_data_lake_endpoint_is_the_clouds_own(env, blob, dfs):
    from tidal import azure_blob

    store, _ = azure_blob.resolve(AZ, env)
    o = exclusive._options(store)
    assert (o["blob_storage_authority"], o["dfs_storage_authority"]) == (blob, dfs)


@pytest.mark.parametrize("signed_with, source", [
    ({"key": "a2V5LWVudg=="}, "AZURE_STORAGE_KEY"),  # the environment's key, which resolve used
    ({"key": "a2V5LXVyaQ=="}, ""),  # the URI's own key, which resolve takes first: not the variable's
    ({"sas": "sv=1&sig=x"}, ""),
])
def test_a_refused_key_is_said_to_come_from_where_it_did(signed_with, source):
    """A key in the storage URI wins over AZURE_STORAGE_KEY; refused, the message must not send the
    user to fix the variable."""
    from tidal import azure_blob

    env = {"AZURE_STORAGE_KEY": "a2V5LWVudg=="}
    assert azure_blob.credential_source("acct", env=env, **signed_with) == source


def test_azure_without_a_key_or_sas_is_refused_naming_what_to_set(monkeypatch):
    no_azure_env(monkeypatch)
    with pytest.raises(NotExclusive) as e:  # nothing is asked of Azure: the refusal needs no request
        Lease("abfs://tidal@someaccount.dfs.core.windows.net/runs", "job").acquire()
    text = str(e.value)
    for var in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN"):
        assert var in text
    assert "someaccount" in text


def options_for(uri: str, env: dict[str, str]) -> dict:
    from tidal import azure_blob

    store, _ = azure_blob.resolve(uri, env)
    o = exclusive._options(store)
    return {k: o[k] for k in ("account_name", "account_key", "sas_token", "blob_storage_authority",
                              "blob_storage_scheme") if o.get(k)}


AZ = "abfs://c@acct.dfs.core.windows.net/runs"
DEFAULT = {"account_name": "acct", "blob_storage_authority": ".blob.core.windows.net", "blob_storage_scheme": "https"}


@pytest.mark.parametrize("uri, env, expected", [
    (AZ, {}, DEFAULT),  # nothing set: pyarrow's own (Entra ID), which the lease refuses naming what to set
    (AZ, {"AZURE_STORAGE_KEY": "a2V5"}, {**DEFAULT, "account_key": "a2V5"}),  # Azure CLI's variable
    (AZ, {"AZURE_STORAGE_ACCOUNT_KEY": "a2V5"}, {**DEFAULT, "account_key": "a2V5"}),  # adlfs's
    (AZ, {"AZURE_STORAGE_SAS_TOKEN": "?sv=1&sig=x"}, {**DEFAULT, "sas_token": "sv=1&sig=x"}),
    (AZ, {"AZURE_STORAGE_ACCOUNT": "other", "AZURE_STORAGE_KEY": "a2V5"}, DEFAULT),  # another account's key
    (AZ, {"AZURE_STORAGE_CONNECTION_STRING": "AccountName=acct;AccountKey=a2V5;EndpointSuffix=core.windows.net"},
     {**DEFAULT, "account_key": "a2V5"}),
    (AZ, {"AZURE_STORAGE_CONNECTION_STRING": "AccountName=other;AccountKey=a2V5"}, DEFAULT),
    (AZ, {"AZURE_STORAGE_CONNECTION_STRING": "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=a2V5;"
                                             "EndpointSuffix=core.chinacloudapi.cn"},
     {**DEFAULT, "account_key": "a2V5", "blob_storage_authority": ".blob.core.chinacloudapi.cn"}),
    # Azurite's endpoint from the connection string: not pyarrow's default authority
    ("abfs://c@devstoreaccount1.dfs.core.windows.net/runs", {"AZURE_STORAGE_CONNECTION_STRING": "UseDevelopmentStorage=true"},
     {"account_name": "devstoreaccount1", "account_key": AZURITE_KEY, "blob_storage_authority": "127.0.0.1:10000",
      "blob_storage_scheme": "http"}),
    # pyarrow's own emulator form: the host in the URI, the key from the environment
    ("abfs://acct@127.0.0.1:10000/c/runs?enable_tls=false", {"AZURE_STORAGE_KEY": "a2V5"},
     {"account_name": "acct", "account_key": "a2V5", "blob_storage_authority": "127.0.0.1:10000",
      "blob_storage_scheme": "http"}),
])
def test_an_abfs_uri_takes_the_key_sas_and_endpoint_azures_tools_read(uri, env, expected):
    assert options_for(uri, env) == expected


def test_an_abfs_uri_resolves_to_its_container_and_path_for_tidal_and_for_ray():
    from tidal import fs

    store, path = fs.resolve(AZ)
    assert store.type_name == "abfs" and path == "c/runs"
    assert fs.ray_storage(AZ)["storage_path"] == "c/runs" and fs.ray_storage("s3://b/x") == {"storage_path": "s3://b/x"}


def test_azures_keys_are_masked_wherever_tidal_prints_them():
    """A connection string's AccountKey or SharedAccessSignature, and the adlfs-style key variable."""
    from tidal.redact import redact_text

    text = redact_text("AccountName=acct;AccountKey=c2VjcmV0a2V5MTIz;SharedAccessSignature=sv=1&sig=c2ln;"
                       " AZURE_STORAGE_ACCOUNT_KEY=c2VjcmV0a2V5MTIz", secrets=[])
    assert "c2VjcmV0a2V5MTIz" not in text and "sig=c2ln" not in text, text
