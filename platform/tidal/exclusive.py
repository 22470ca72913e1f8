"""Create a file only if it does not exist yet: on a local or shared filesystem, S3, GCS and Azure Blob Storage.

pyarrow's filesystems have no conditional create, and a job's lease (tidal/lease.py) needs one:
of two starts that create the same generation file, exactly one must win. Each store's own
exclusive create does it: an `O_EXCL` create on a local disk and on NFS (v3 and later); on S3
and S3-compatible stores a conditional PUT (`If-None-Match: *`), through boto3 for that one
object with every option the pyarrow filesystem has (session token, role, CA, proxy); on GCS an insert with `ifGenerationMatch=0` through the JSON API (pyarrow's GCS client
offers no precondition either); on Azure Blob Storage a Put Blob with `If-None-Match: *` through its
REST API, signed with the filesystem's account key or SAS token. An S3, GCS or Azure endpoint is probed once per process and bucket
(the same probe object created twice: the second must be refused), because some S3-compatible
stores ignore the condition (both creates win) and others reject it (every create fails).

A store that has no exclusive create, or whose probe fails, is refused with `NotExclusive`
naming the store and what to do, unless the user accepts a check-then-write lease by setting
`TIDAL_LEASE_UNFENCED=1` (two starts at the same instant could then both run).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from typing import Any

import pyarrow.fs as pafs

from tidal import azure_blob, fs
from tidal.errors import TidalError

log = logging.getLogger("tidal")

UNFENCED_ENV = "TIDAL_LEASE_UNFENCED"
_PROBED: dict[tuple[str, ...], str] = {}  # (kind, endpoint, bucket) -> "" when exclusive, else why not
_PROBE_LOCK = threading.RLock()


class NotExclusive(TidalError):
    """The job's storage cannot create a file exclusively, so one live attempt per job cannot be
    guaranteed there: nothing was started or written."""


class CredentialsRefused(TidalError):
    """The store refused the credentials Tidal signed its create with (HTTP 401/403): nothing was
    started or written."""


def create_exclusive(store: pafs.FileSystem, path: str, data: dict[str, Any]) -> bool:
    """Create `path` holding `data` only if it does not exist; False if it did. NotExclusive when
    the store cannot do it (and TIDAL_LEASE_UNFENCED is not set)."""
    blob = json.dumps(data, indent=2).encode()
    if fs.is_local(store):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)  # exclusive on NFSv3+ too
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        return True
    if isinstance(store, pafs.S3FileSystem):
        return _probed_create("s3", store, path, blob, _s3_create_exclusive)
    if isinstance(store, pafs.GcsFileSystem):
        return _probed_create("gs", store, path, blob, _gcs_create_exclusive)
    if _is_azure(store):
        return _probed_create("abfs", store, path, blob, _azure_create_exclusive)
    return _unfenced(store, path, blob, f"{store.type_name} storage has no exclusive create Tidal can use")


def check_store(store: pafs.FileSystem, path: str) -> None:
    """Refuse (NotExclusive) a store where `create_exclusive(store, path, ...)` could not be
    exclusive, probing an S3 or GCS endpoint the first time: a start calls it before it stamps
    its lease, so that the probe's requests do not age the stamp."""
    if fs.is_local(store):
        return
    if isinstance(store, pafs.S3FileSystem):
        why = _probed("s3", store, path, _s3_create_exclusive)
    elif isinstance(store, pafs.GcsFileSystem):
        why = _probed("gs", store, path, _gcs_create_exclusive)
    elif _is_azure(store):
        why = _azure_refusal(store) or _probed("abfs", store, path, _azure_create_exclusive)
    else:
        why = f"{store.type_name} storage has no exclusive create Tidal can use"
    if why:
        _refuse_unless_opted_out(why)


def _probed(kind: str, store: pafs.FileSystem, path: str, create: Any) -> str:
    bucket = path.partition("/")[0]
    options = _options(store)
    endpoint = options.get("endpoint_override") or options.get("blob_storage_authority") or ""
    key = (kind, str(endpoint), str(options.get("account_name") or ""), bucket)
    with _PROBE_LOCK:
        if key not in _PROBED:
            _PROBED[key] = _probe(store, path, create)
        return _PROBED[key]


def _probed_create(kind: str, store: pafs.FileSystem, path: str, blob: bytes, create: Any) -> bool:
    if why := _probed(kind, store, path, create):
        return _unfenced(store, path, blob, why)
    return create(store, path, blob)


def _probe(store: pafs.FileSystem, path: str, create: Any) -> str:
    """"" when the store refuses a second exclusive create of one object; else why not."""
    probe = f"{path.rsplit('/', 1)[0]}/probe-{uuid.uuid4().hex}.tmp"  # not a generation file name
    where = _describe(store, path)
    try:
        try:
            if not create(store, probe, b"{}"):
                return f"{where} refused to create a new object conditionally"
            if create(store, probe, b"{}"):
                return f"{where} ignores the condition on its create (a second create of one object succeeded)"
        except _Rejected as e:
            return f"{where} rejects a conditional create ({e})"
        return ""
    finally:
        with contextlib.suppress(OSError):
            store.delete_file(probe)


def _refuse_unless_opted_out(why: str) -> None:
    if os.environ.get(UNFENCED_ENV) != "1":
        raise NotExclusive(
            f"{why}, so Tidal cannot guarantee one live attempt per job there (two starts of one job at the "
            "same instant could both train into the same checkpoints and MLflow run).\n"
            "  use a storage with an exclusive create: a local or shared (NFS) path, AWS S3 or an S3-compatible "
            "store that honours If-None-Match (MinIO, Ceph RGW 18+), gs:// on Google Cloud Storage, or Azure Blob "
            "Storage with an account key or SAS token\n"
            f"  or accept a check-then-write lease on this storage: set {UNFENCED_ENV}=1 (docs/reliability.md)")


def _unfenced(store: pafs.FileSystem, path: str, blob: bytes, why: str) -> bool:
    _refuse_unless_opted_out(why)
    log.warning("[tidal] %s; %s=1: the lease checks then writes (two starts of one job at the same instant are "
                "not excluded)", why, UNFENCED_ENV)
    if fs.exists(store, path):
        return False
    store.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with store.open_output_stream(path) as f:
        f.write(blob)
    return True


class _Rejected(OSError):
    """The store answered a conditional create with 'not supported' (not a precondition failure)."""


def _conditional(request: urllib.request.Request, where: str, taken: tuple[int, ...], denied: str = "") -> bool:
    """Send a conditional create through a store's REST API: True when it created `where`, False when
    the store answered one of `taken` (another create won); _Rejected when it does not support the
    condition; CredentialsRefused (saying `denied`) for a 401 or 403 when `denied` is given;
    OSError for any other failure."""
    try:
        with urllib.request.urlopen(request, timeout=60):
            return True
    except urllib.error.HTTPError as e:
        if e.code in taken:
            return False
        if denied and e.code in (401, 403):
            raise CredentialsRefused(f"{denied} (HTTP {e.code} {e.reason})") from None
        if e.code in (400, 501):
            raise _Rejected(f"HTTP {e.code}") from None
        raise OSError(f"could not create {where}: HTTP {e.code} {e.reason}") from None
    except urllib.error.URLError as e:
        raise OSError(f"could not create {where}: {e.reason}") from None


def _describe(store: pafs.FileSystem, path: str) -> str:
    options = _options(store)
    endpoint = options.get("endpoint_override") or options.get("blob_storage_authority")
    if _is_azure(store):  # the account is the root: abfs://CONTAINER@ACCOUNT, as Azure's docs write it
        where = f"abfs://{path.partition('/')[0]}@{options.get('account_name') or '?'}"
        return where + (f" (endpoint {endpoint})" if endpoint and not str(endpoint).startswith(".") else "")
    scheme = {"s3": "s3", "gcs": "gs"}.get(store.type_name, store.type_name)
    return f"{scheme}://{path.partition('/')[0]}" + (f" (endpoint {endpoint})" if endpoint else "")


def _options(store: pafs.FileSystem) -> dict[str, Any]:
    """The options a pyarrow S3 or GCS filesystem was built with: pyarrow keeps them only in its
    pickle arguments."""
    try:
        reduced = store.__reduce__()[1]
        return reduced[0] if reduced and isinstance(reduced[0], dict) else {}
    except Exception:  # noqa: BLE001 - an older pyarrow: the environment decides, as for boto3 alone
        return {}


# --- S3 -----------------------------------------------------------------------------------------
def _s3_create_exclusive(store: pafs.S3FileSystem, path: str, blob: bytes) -> bool:
    """A conditional PUT (If-None-Match: *), which S3 and S3-compatible stores honour: pyarrow
    has none, so this one object goes through boto3 with the same endpoint and credentials."""
    import botocore.exceptions

    bucket, _, key = path.partition("/")
    s3 = _s3_client(store)
    try:
        s3.put_object(Bucket=bucket, Key=key, Body=blob, IfNoneMatch="*")
    except botocore.exceptions.ClientError as e:
        code = e.response.get("Error", {}).get("Code", "")
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
            return False
        if code in ("NotImplemented", "InvalidArgument", "InvalidRequest") or status == 501:
            raise _Rejected(f"{code or status}") from None
        raise OSError(f"could not create {path}: {code or e}") from None
    return True


_CLIENTS: dict[str, Any] = {}


def _s3_client(store: pafs.S3FileSystem) -> Any:
    """One boto3 client per set of pyarrow options and AWS environment (making one costs tens of milliseconds, and
    boto3's default session is not safe to build clients from in several threads at once). A
    client on an assumed role is rebuilt every 15 minutes, well inside its credentials' hour."""
    import boto3

    kwargs = {k: v for k, v in _options(store).items() if k != "default_metadata"}
    # What boto3 reads from the environment decides too (credentials, profile, endpoint, CA, proxy).
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_") or k.lower().endswith("_proxy")}
    key = json.dumps([kwargs, env], sort_keys=True, default=str)
    if kwargs.get("role_arn"):
        key += f"@{int(time.time() // 900)}"
    with _PROBE_LOCK:
        if key not in _CLIENTS:
            # A session of its own: boto3's default session keeps the credentials it first resolved.
            _CLIENTS[key] = boto3.session.Session().client("s3", **_s3_options(store))
        return _CLIENTS[key]


def _s3_options(store: pafs.S3FileSystem) -> dict[str, Any]:
    """boto3 client options for everything a pyarrow S3 filesystem was built with that decides
    where a request goes and how it is signed: endpoint, region, credentials with their session
    token, an assumed role, a private CA, a proxy, anonymous access, virtual addressing and
    timeouts. What pyarrow took from the environment (AWS_* variables, ~/.aws config and profiles,
    web identity) boto3 reads from the same places itself."""
    from botocore import UNSIGNED
    from botocore.config import Config

    options: dict[str, Any] = {}
    config: dict[str, Any] = {}
    kwargs = _options(store)
    if endpoint := kwargs.get("endpoint_override"):
        scheme = kwargs.get("scheme") or "https"
        options["endpoint_url"] = endpoint if "://" in endpoint else f"{scheme}://{endpoint}"
    if region := kwargs.get("region"):
        options["region_name"] = region
    if kwargs.get("access_key"):
        options["aws_access_key_id"] = kwargs["access_key"]
        options["aws_secret_access_key"] = kwargs.get("secret_key") or ""
        if kwargs.get("session_token"):
            options["aws_session_token"] = kwargs["session_token"]
    if kwargs.get("tls_ca_file_path"):
        options["verify"] = kwargs["tls_ca_file_path"]
    proxy = kwargs.get("proxy_options") or {}
    if proxy.get("host"):
        auth = f"{proxy['username']}:{proxy.get('password') or ''}@" if proxy.get("username") else ""
        port = f":{proxy['port']}" if (proxy.get("port") or -1) > 0 else ""
        url = f"{proxy.get('scheme') or 'http'}://{auth}{proxy['host']}{port}"
        config["proxies"] = {"http": url, "https": url}
    if kwargs.get("anonymous"):
        config["signature_version"] = UNSIGNED
    if kwargs.get("force_virtual_addressing"):
        config["s3"] = {"addressing_style": "virtual"}
    for ours, theirs in (("connect_timeout", "connect_timeout"), ("request_timeout", "read_timeout")):
        if (value := kwargs.get(ours)) is not None and value > 0:
            config[theirs] = value
    if config:
        options["config"] = Config(**config)
    if role := kwargs.get("role_arn"):
        options.update(_assumed(role, kwargs, options))
    return options


def _assumed(role: str, kwargs: dict[str, Any], options: dict[str, Any]) -> dict[str, str]:
    """Credentials for the role pyarrow assumes (role_arn, session_name, external_id), through STS
    with the same base credentials, endpoint and network settings."""
    import boto3

    base = {k: v for k, v in options.items() if k != "endpoint_url"}
    request: dict[str, Any] = {"RoleArn": role, "RoleSessionName": kwargs.get("session_name") or "tidal-lease"}
    if kwargs.get("external_id"):
        request["ExternalId"] = kwargs["external_id"]
    creds = boto3.session.Session().client("sts", **base).assume_role(**request)["Credentials"]
    return {"aws_access_key_id": creds["AccessKeyId"], "aws_secret_access_key": creds["SecretAccessKey"],
            "aws_session_token": creds["SessionToken"]}


# --- GCS ----------------------------------------------------------------------------------------
GCS_SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"


def _gcs_create_exclusive(store: pafs.GcsFileSystem, path: str, blob: bytes) -> bool:
    """An insert with `ifGenerationMatch=0` ("only if no live object has this name") through
    GCS's JSON API, to the endpoint and with the credentials the pyarrow filesystem uses: a 412
    means another create won."""
    options = _options(store)
    bucket, _, key = path.partition("/")
    url = (f"{_gcs_base(options)}/upload/storage/v1/b/{urllib.parse.quote(bucket, safe='')}/o?"
           + urllib.parse.urlencode({"uploadType": "media", "name": key, "ifGenerationMatch": "0"}))
    headers = {"Content-Type": "application/octet-stream"}
    if token := _gcs_token(options):
        headers["Authorization"] = f"Bearer {token}"
    return _conditional(urllib.request.Request(url, data=blob, method="POST", headers=headers), f"gs://{path}", (412,))


def _gcs_base(options: dict[str, Any]) -> str:
    if endpoint := options.get("endpoint_override"):
        return endpoint if "://" in endpoint else f"{options.get('scheme') or 'https'}://{endpoint}"
    for var in ("CLOUD_STORAGE_EMULATOR_ENDPOINT", "STORAGE_EMULATOR_HOST"):
        if host := os.environ.get(var):
            return host if "://" in host else f"http://{host}"
    return "https://storage.googleapis.com"


def _gcs_token(options: dict[str, Any]) -> str:
    """The bearer token pyarrow would send: its own access token, none when anonymous, else the
    application default credentials (google-auth, as google-cloud-cpp reads them)."""
    if options.get("access_token"):
        return str(options["access_token"])
    if options.get("anonymous"):
        return ""
    import google.auth
    import google.auth.transport.requests

    credentials, _ = google.auth.default(scopes=[GCS_SCOPE])
    credentials.refresh(google.auth.transport.requests.Request())
    return str(credentials.token)


# --- Azure Blob Storage ---------------------------------------------------------------------------
AZURE_API = "2021-08-06"  # the Blob service version these requests are signed for
AZURE_DEFAULT_AUTHORITY = "blob.core.windows.net"


def _is_azure(store: pafs.FileSystem) -> bool:
    return store.type_name == "abfs"


def _azure_refusal(store: pafs.FileSystem) -> str:
    """Why the lease cannot create on this Azure filesystem ("" when it can): it signs with the
    account key or a SAS token the filesystem holds (tidal/azure_blob.py finds them where Azure's
    tools do); Entra ID credentials would need their own token flow (azure-identity), which Tidal
    does not carry."""
    options = _options(store)
    if options.get("account_key") or options.get("sas_token"):
        return ""
    return (f"Tidal's lease signs its one conditional create with an account key or a SAS token, and "
            f"{azure_blob.refusal(str(options.get('account_name') or '?'))}; Entra ID credentials alone are "
            "not enough")


def _azure_create_exclusive(store: pafs.FileSystem, path: str, blob: bytes) -> bool:
    """A Put Blob with `If-None-Match: *` ("only if no blob has this name": else 409 or 412) to the
    account the pyarrow filesystem reaches, signed as it signs (Shared Key) or with its SAS token:
    pyarrow's Azure filesystem has no conditional create."""
    options = _options(store)
    if why := _azure_refusal(store):
        raise _Rejected(why)
    account, authority = str(options["account_name"]), str(options.get("blob_storage_authority") or "")
    scheme = options.get("blob_storage_scheme") or "https"
    # pyarrow's own addressing: the account's host on Azure (its default authority is ".blob.core.windows.net",
    # a suffix), the account as the first path segment on a host of its own (Azurite)
    if not authority or authority.startswith(".") or authority == AZURE_DEFAULT_AUTHORITY:
        suffix = authority if authority.startswith(".") else f".{AZURE_DEFAULT_AUTHORITY}"
        base, resource = f"{scheme}://{account}{suffix}", f"/{account}"
    else:
        base, resource = f"{scheme}://{authority}/{account}", f"/{account}/{account}"
    quoted = urllib.parse.quote(path)
    headers = {"x-ms-blob-type": "BlockBlob", "x-ms-date": _http_date(), "x-ms-version": AZURE_API,
               "If-None-Match": "*", "Content-Type": "application/octet-stream", "Content-Length": str(len(blob))}
    url = f"{base}/{quoted}"
    if sas := options.get("sas_token"):
        url += "?" + str(sas).lstrip("?")
    else:
        headers["Authorization"] = _shared_key(account, str(options["account_key"]), "PUT", headers,
                                               f"{resource}/{quoted}")
    source = (azure_blob.credential_source(account, str(options.get("account_key") or ""), str(sas or ""))
              or "the storage URI's key or SAS token")
    denied = (f"Azure storage account {account!r} refused the request Tidal signed with {source}: set a valid "
              f"key or SAS token there ({azure_blob.CONNECTION_ENV} with the AccountKey `az storage account "
              f"show-connection-string` prints, {' or '.join(azure_blob.KEY_ENVS)}, or {azure_blob.SAS_ENV})")
    # 409 BlobAlreadyExists or 412 ConditionNotMet: another create won
    return _conditional(urllib.request.Request(url, data=blob, method="PUT", headers=headers), f"abfs://{path}",
                        (409, 412), denied)


def _http_date() -> str:
    import email.utils

    return email.utils.formatdate(usegmt=True)


def _shared_key(account: str, key: str, verb: str, headers: dict[str, str], resource: str) -> str:
    """The Authorization header of Azure Storage's Shared Key scheme (its documented string to sign)."""
    import base64
    import hashlib
    import hmac

    h = {k.lower(): v for k, v in headers.items()}
    length = h.get("content-length", "")
    standard = [verb, h.get("content-encoding", ""), h.get("content-language", ""), "" if length == "0" else length,
                h.get("content-md5", ""), h.get("content-type", ""), "", h.get("if-modified-since", ""),
                h.get("if-match", ""), h.get("if-none-match", ""), h.get("if-unmodified-since", ""), h.get("range", "")]
    ms = "".join(f"{k}:{v.strip()}\n" for k, v in sorted(h.items()) if k.startswith("x-ms-"))
    to_sign = "\n".join(standard) + "\n" + ms + resource
    digest = hmac.new(base64.b64decode(key), to_sign.encode(), hashlib.sha256).digest()
    return f"SharedKey {account}:{base64.b64encode(digest).decode()}"
