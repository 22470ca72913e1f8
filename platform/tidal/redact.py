"""The one redaction rule for everything that leaves a process (MLflow, job records, console
lines, errors, `--output json`, printed specs).

Masked: the user-info of any URI (`scheme://user:pw@host` keeps the user, a lone user is taken
for a token), query parameters that carry signatures, credentials or tokens (S3/GCS presigned
URLs, Azure SAS), and the values of secret variables (known names, and any name ending in
`_TOKEN`, `_SECRET`, `_PASSWORD`, `_KEY`...), both as `NAME=value` in text and wherever the value
of such a variable in this process's environment appears. Values are kept where they are used
(storage access, the tracking URI the writer connects to): only what is shown is masked.

No library does this: MLflow's `_redact` helpers cover only its own database URIs, and
`urllib.parse` rebuilds a URI with re-encoded characters, so the rule is written here. It imports
nothing of Tidal's, so every layer may use it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

MASK = "***"

SECRET_VARS = frozenset({
    "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN",
    "RAY_AUTH_TOKEN", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY", "GITHUB_TOKEN",
    "AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN", "AZURE_CLIENT_SECRET", "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_STORAGE_ACCOUNT_KEY",  # adlfs's name for the key (tidal/azure_blob.py reads it)
    "ACCOUNTKEY", "SHAREDACCESSSIGNATURE", "SIG",  # an Azure connection string's fields, a SAS token's signature
    "GOOGLE_APPLICATION_CREDENTIALS_JSON", "DATABRICKS_TOKEN", "OPENAI_API_KEY",
})
_SECRET_SUFFIXES = ("_TOKEN", "_SECRET", "_PASSWORD", "_PASSWD", "_KEY", "_CREDENTIALS", "_CONNECTION_STRING")

# Query parameters (lower-cased) whose values sign or authorize a request. Azure SAS's `se`/`sp`/
# `st` are its expiry, permissions and start: not secret alone, masked as the issue asks since a
# SAS is only useful whole.
_SECRET_PARAMS = frozenset({
    "x-amz-signature", "x-amz-credential", "x-amz-security-token", "signature", "awsaccesskeyid",
    "sig", "se", "sp", "st", "token", "access_token", "id_token", "refresh_token", "key", "api_key",
    "apikey", "password", "passwd", "pwd", "secret", "client_secret", "auth", "credential", "code",
})
_SECRET_PARAM_PREFIXES = ("x-goog-", "x-amz-security", "x-amz-credential", "x-amz-signature")

# A short value would mask ordinary words wherever they appear (moto's test key is `test`); real
# secrets are longer, and their `NAME=value` form is masked at any length.
MIN_VALUE_LEN = 8

_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]+")
# A secret reference (tidal.spec.secrets: where a secret is on the nodes, never its value).
_REFERENCE = re.compile(r"^(?:env:[A-Za-z_][A-Za-z0-9_]*|file:/\S+)$")
_ASSIGN = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)(\s*[=:]\s*)(['\"]?)([^\s'\"&,;]+)")


def is_secret_name(name: str) -> bool:
    """Whether a variable (or mapping key) of this name holds a secret."""
    upper = name.upper()
    return upper in SECRET_VARS or upper.endswith(_SECRET_SUFFIXES)


def redact_uri(uri: str, lone_user: bool = False) -> str:
    """`uri` with its user-info's password (or lone token) and its secret query values masked;
    anything else, characters and their encoding included, as it was. `lone_user`: a user-info with
    no password is a name and stays (an `abfs://` URI's container or account, which tells two
    storages apart), only a password is masked."""
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return uri
    authority_end = next((i for i, c in enumerate(rest) if c in "/?#"), len(rest))
    authority, tail = rest[:authority_end], rest[authority_end:]
    if "@" in authority:
        userinfo, host = authority.rsplit("@", 1)
        user, colon, _ = userinfo.partition(":")
        authority = f"{user}:{MASK}@{host}" if colon else f"{user if lone_user else MASK}@{host}"
    return f"{scheme}://{authority}{_redact_query(tail)}"


def _redact_query(tail: str) -> str:
    path, q, rest = tail.partition("?")
    if not q:
        return tail
    query, h, fragment = rest.partition("#")
    parts = []
    for piece in query.split("&"):
        key, eq, _ = piece.partition("=")
        parts.append(f"{key}={MASK}" if eq and _secret_param(key) else piece)
    return f"{path}?{'&'.join(parts)}{h}{fragment}"


def _secret_param(key: str) -> bool:
    from urllib.parse import unquote

    k = unquote(key).lower()
    return k in _SECRET_PARAMS or k.startswith(_SECRET_PARAM_PREFIXES) or is_secret_name(k)


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values of the secret variables in `environ` (default: this process's), longest first so
    that one secret holding another is masked whole."""
    env = os.environ if environ is None else environ
    found = {v for k, v in env.items() if is_secret_name(k) and len(v) >= MIN_VALUE_LEN}
    return sorted(found, key=len, reverse=True)


def redact_text(text: str, secrets: Iterable[str] | None = None) -> str:
    """A message with every URI in it redacted, every `SECRET_NAME=value` masked, and every
    value of `secrets` (default: the secret variables of this process's environment) masked."""
    if not text:
        return text
    values = secret_values() if secrets is None else [s for s in secrets if len(s) >= MIN_VALUE_LEN]
    for value in values:
        text = text.replace(value, MASK)
    text = _URI.sub(lambda m: redact_uri(m.group(0)), text)
    return _ASSIGN.sub(_mask_assignment, text)


def _mask_assignment(m: re.Match[str]) -> str:
    name, sep, quote, value = m.groups()
    if not is_secret_name(name) or value == MASK or _REFERENCE.match(value):
        return m.group(0)
    return f"{name}{sep}{quote}{MASK}"


def redact_data(data: Any, secrets: Iterable[str] | None = None) -> Any:
    """A copy of nested dicts/lists with every string redacted as text, and the value of every
    key named like a secret variable masked whole."""
    values = secret_values() if secrets is None else list(secrets)
    return _redact(data, values)


def _redact(data: Any, values: list[str]) -> Any:
    if isinstance(data, str):
        return redact_text(data, values)
    if isinstance(data, Mapping):
        return {k: MASK if isinstance(k, str) and is_secret_name(k) and isinstance(v, str) and v
                and not _REFERENCE.match(v) else _redact(v, values) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_redact(v, values) for v in data]
    return data


def _masked(text: str, own: list[str]) -> str:
    """`text` redacted, masking `own` values (a worker's resolved secrets) besides this process's
    secret variables'; longest first, so a value that contains another is masked whole."""
    extra = sorted({*secret_values(), *own}, key=len, reverse=True) if own else None
    return redact_text(text, extra)


class RedactingStream:
    """A text stream that redacts what is written to it before passing it on: the CLI and the
    submitted job's entrypoint put it in front of stdout and stderr, so that the driver's prints,
    Ray's copies of the workers' lines (Ray looks up `sys.stdout` at each print) and logging reach
    the console (and `ray job logs`) redacted. `secrets` are values masked besides those of this
    process's secret variables (a worker's resolved secrets, whatever their names)."""

    def __init__(self, inner: Any, secrets: Iterable[str] = ()) -> None:
        self.inner = inner
        self.secrets = [s for s in secrets if len(s) >= MIN_VALUE_LEN]

    def write(self, text: str) -> int:
        self.inner.write(_masked(text, self.secrets))
        return len(text)  # what the caller gave: print() and logging check nothing else

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class RedactingRecords:
    """The process's log record factory, redacting each record's message as RedactingStream
    redacts text. A factory, not a filter: filters sit on one logger or one handler, and libraries
    add their own handlers (Ray Train's worker log files) and loggers after a worker resolved its
    secrets; every record of every logger is made here."""

    def __init__(self, inner: Any, secrets: Iterable[str] = ()) -> None:
        self.inner = inner
        self.secrets = [s for s in secrets if len(s) >= MIN_VALUE_LEN]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        record = self.inner(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - arguments that do not format: logging reports it where it emits
            return record
        masked = _masked(message, self.secrets)
        if masked != message:
            record.msg, record.args = masked, None
        return record


def install(secrets: Iterable[str] = ()) -> None:
    """Put a RedactingStream in front of this process's stdout and stderr and make every log record
    through RedactingRecords, masking `secrets` too: a submitted driver's output and a worker's
    lines, which Ray copies to the job's log and Ray Train to its worker log files."""
    import logging
    import sys

    values = [v for v in secrets if len(v) >= MIN_VALUE_LEN]
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if isinstance(stream, RedactingStream):
            stream.secrets = sorted({*stream.secrets, *values})
        elif stream is not None:
            setattr(sys, name, RedactingStream(stream, values))
    factory = logging.getLogRecordFactory()
    if isinstance(factory, RedactingRecords):
        factory.secrets = sorted({*factory.secrets, *values})
    else:
        logging.setLogRecordFactory(RedactingRecords(factory, values))
