"""Azure Blob Storage from an `abfs://` URI, with the credentials and endpoint Azure's own tools read.

Why: pyarrow builds an Azure filesystem from a URI with DefaultAzureCredential (Entra ID) unless
the URI carries a key, and exposes none of it afterwards; Azure users set a storage account up
through the environment instead, and Tidal's lease must sign its one conditional create
(tidal/exclusive.py) with a key or SAS token it can see. So the filesystem is built here from
the URI's account, container and path and, in this order:
- a key in the URI itself (`abfs://ACCOUNT:KEY@HOST/...`, pyarrow's own form),
- `AZURE_STORAGE_CONNECTION_STRING` (Azure CLI, adlfs/fsspec, Azure Functions and Azurite's docs;
  `AccountKey`, `SharedAccessSignature`, `BlobEndpoint`, `EndpointSuffix`,
  `UseDevelopmentStorage=true`), when its `AccountName` is the URI's account,
- `AZURE_STORAGE_KEY` (Azure CLI) or `AZURE_STORAGE_ACCOUNT_KEY` (adlfs), then
  `AZURE_STORAGE_SAS_TOKEN` (both), unless `AZURE_STORAGE_ACCOUNT` / `AZURE_STORAGE_ACCOUNT_NAME`
  names another account.
The endpoint is the URI's own host when it names one (an emulator: `abfs://ACCOUNT@127.0.0.1:10000/
CONTAINER/...?enable_tls=false`), else the connection string's `BlobEndpoint` (Azurite's), else
Azure's. With none of these the filesystem is pyarrow's own (Entra ID), which Tidal reads and
writes through but whose lease is refused, naming what to set (`refusal`).
"""

from __future__ import annotations

import os
import urllib.parse
from dataclasses import dataclass

import pyarrow.fs as pafs

CONNECTION_ENV = "AZURE_STORAGE_CONNECTION_STRING"
KEY_ENVS = ("AZURE_STORAGE_KEY", "AZURE_STORAGE_ACCOUNT_KEY")
SAS_ENV = "AZURE_STORAGE_SAS_TOKEN"
ACCOUNT_ENVS = ("AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_ACCOUNT_NAME")
DEFAULT_SUFFIX = "core.windows.net"
# Azurite's documented development account: what `UseDevelopmentStorage=true` means (public: it opens only the emulator)
DEV_ACCOUNT = "devstoreaccount1"
DEV_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
DEV_BLOB_ENDPOINT = "http://127.0.0.1:10000/devstoreaccount1"


@dataclass(frozen=True)
class Credential:
    """A key or SAS token for one account, and where it came from (named in errors, never its value)."""

    key: str = ""
    sas: str = ""
    source: str = ""  # e.g. "AZURE_STORAGE_CONNECTION_STRING's AccountKey"


def is_azure_uri(uri: str) -> bool:
    return uri.split("://", 1)[0].lower() in ("abfs", "abfss")


def resolve(uri: str, env: dict[str, str] | None = None) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path within it) for an abfs:// URI, with the environment's key or SAS token."""
    env = dict(os.environ if env is None else env)
    store, path = pafs.FileSystem.from_uri(uri)
    options = _options(store)
    account = str(options.get("account_name") or "")
    conn = _connection(env, account)
    cred = _credential(uri, env, account, conn)
    authority, scheme = _endpoint(options, conn)
    if not cred.key and not cred.sas and not authority:
        return store, path  # pyarrow's own: Entra ID (DefaultAzureCredential)
    kwargs: dict[str, str] = {}
    if authority:
        # An Azure cloud's Data Lake host (hierarchical namespace accounts) is its own: `.dfs.SUFFIX`
        dfs = ".dfs." + authority[len(".blob."):] if authority.startswith(".blob.") else authority
        kwargs = {"blob_storage_authority": authority, "dfs_storage_authority": dfs,
                  "blob_storage_scheme": scheme, "dfs_storage_scheme": scheme}
    if cred.key:
        kwargs["account_key"] = cred.key
    elif cred.sas:
        kwargs["sas_token"] = cred.sas.lstrip("?")
    return pafs.AzureFileSystem(account_name=account, **kwargs), path


def credential_source(account: str, key: str = "", sas: str = "", env: dict[str, str] | None = None) -> str:
    """Which variable the `key` or `sas` a filesystem for `account` signs with came from, for an
    error message; "" when not the environment's (a key in the storage URI, which `resolve` takes
    first, or a filesystem built by hand)."""
    env = dict(os.environ if env is None else env)
    found = _credential("", env, account, _connection(env, account))
    same = (key and found.key == key) or (sas and found.sas.lstrip("?") == sas.lstrip("?"))
    return found.source if same else ""


def refusal(account: str) -> str:
    """What to set so that Tidal can sign for `account` (no key or SAS token was found)."""
    keys = " or ".join(KEY_ENVS)
    return (f"no account key or SAS token for Azure storage account {account!r} was found: set "
            f"{CONNECTION_ENV} (as `az storage account show-connection-string` prints it), or {keys} to the "
            f"account's key, or {SAS_ENV} to a SAS token (with {ACCOUNT_ENVS[0]}={account} if you name the "
            "account), in the environment of `tidal run` and of every Ray node")


# --- the environment, as Azure's tools read it ------------------------------------------------------
def _connection(env: dict[str, str], account: str) -> dict[str, str]:
    """The connection string's fields when it is for `account` (else {}): `UseDevelopmentStorage=true`
    is Azurite's development account at its default endpoint."""
    text = env.get(CONNECTION_ENV, "")
    fields: dict[str, str] = {}
    for part in text.split(";"):
        name, sep, value = part.strip().partition("=")
        if sep:
            fields[name.strip().lower()] = value.strip()
    if fields.get("usedevelopmentstorage", "").lower() == "true":
        fields = {"accountname": DEV_ACCOUNT, "accountkey": DEV_KEY, "blobendpoint": DEV_BLOB_ENDPOINT}
    return fields if fields.get("accountname") == account else {}


def _credential(uri: str, env: dict[str, str], account: str, conn: dict[str, str]) -> Credential:
    if uri and (key := urllib.parse.unquote(urllib.parse.urlsplit(uri).password or "")):
        return Credential(key=key, source="the storage URI's key")
    if conn.get("accountkey"):
        return Credential(key=conn["accountkey"], source=f"{CONNECTION_ENV}'s AccountKey")
    if conn.get("sharedaccesssignature"):
        return Credential(sas=conn["sharedaccesssignature"], source=f"{CONNECTION_ENV}'s SharedAccessSignature")
    named = next((env[v] for v in ACCOUNT_ENVS if env.get(v)), "")
    if named and named != account:
        return Credential()  # the variables are for another account
    for var in KEY_ENVS:
        if env.get(var):
            return Credential(key=env[var], source=var)
    if env.get(SAS_ENV):
        return Credential(sas=env[SAS_ENV], source=SAS_ENV)
    return Credential()


def _endpoint(options: dict[str, object], conn: dict[str, str]) -> tuple[str, str]:
    """(authority, scheme) to send requests to, in pyarrow's terms: `host:port` for an emulator
    (the account is then the first path segment), `.blob.SUFFIX` for an Azure cloud (the account's
    host); ("", "") for Azure's public cloud, pyarrow's default."""
    authority = str(options.get("blob_storage_authority") or "")
    if authority and not authority.startswith("."):  # the URI named a host (pyarrow's default starts with ".")
        return authority, str(options.get("blob_storage_scheme") or "https")
    account, protocol = conn.get("accountname", ""), conn.get("defaultendpointsprotocol") or "https"
    if endpoint := conn.get("blobendpoint"):
        parts = urllib.parse.urlsplit(endpoint)
        if parts.netloc.startswith(f"{account}.blob."):  # the account's own host in some Azure cloud
            suffix = parts.netloc[len(account):]
            return ("", "") if suffix == f".blob.{DEFAULT_SUFFIX}" else (suffix, parts.scheme or "https")
        return parts.netloc, parts.scheme or "https"  # an emulator (Azurite): path-style
    if (suffix := conn.get("endpointsuffix")) and suffix != DEFAULT_SUFFIX:  # a sovereign cloud
        return f".blob.{suffix}", protocol
    return "", ""


def _options(store: pafs.FileSystem) -> dict[str, object]:
    try:
        reduced = store.__reduce__()[1]
        return reduced[0] if reduced and isinstance(reduced[0], dict) else {}
    except Exception:  # noqa: BLE001 - an older pyarrow: nothing known beyond the URI
        return {}
