"""Secrets by reference: a spec's `env` says where each secret is on the cluster's nodes, never its value.

A reference is `env:NODE_VAR` (a variable in the nodes' environment, set where `ray start` runs or
in a pod's env) or `file:/abs/path` (a file on the nodes, e.g. a Kubernetes Secret mounted by
cluster_configs/kuberay/raycluster.yaml). YAML's mapping forms `{from_env: NODE_VAR}` and
`{from_file: /path}` are accepted too and stored as the string form, which is one line in a job
file and works in `--set env.HF_TOKEN=env:HF_TOKEN`.

Everything that leaves the submitter (the Ray job's runtime_env and entrypoint, Ray Train's
train_loop_config, MLflow, the job record) therefore holds references only; `resolve` reads the
values inside each training worker, before any user code runs (worker/session.py).
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import WithJsonSchema

from tidal.errors import TidalError

VAR_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
KINDS = {"from_env": "env", "from_file": "file"}
# What an editor accepts for one `env` entry: the forms parse_ref takes.
SecretRef = Annotated[str, WithJsonSchema({"anyOf": [
    {"type": "string", "pattern": "^(env:[A-Za-z_][A-Za-z0-9_]*|file:/.+)$"},
    {"type": "object", "properties": {"from_env": {"type": "string"}}, "required": ["from_env"],
     "additionalProperties": False},
    {"type": "object", "properties": {"from_file": {"type": "string"}}, "required": ["from_file"],
     "additionalProperties": False},
], "description": "env:NODE_VAR or file:/abs/path (or {from_env: ...} / {from_file: ...})"})]
# Name parts that say a variable holds a credential: such a variable is refused in the published
# `worker_env` (TOKENIZERS_PARALLELISM is fine: parts are compared whole).
SECRET_PARTS = {"TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIALS", "KEY", "APIKEY", "PAT"}
HOW = ("Reference where the value lives on the cluster's nodes instead: `{key}: env:NODE_VAR` (a variable "
       "in the nodes' environment) or `{key}: file:/etc/tidal/secrets/{lower}` (a file on the nodes, e.g. a "
       "mounted Kubernetes Secret); plain non-secret settings go in `worker_env`")


class SecretMissing(TidalError):
    """A referenced secret is not on this node."""


def parse_ref(key: str, value: Any) -> str:
    """The canonical reference (`env:VAR` or `file:/path`) for `env.<key>`'s `value`; ValueError
    (naming the key, never echoing the value: it may be the secret itself) otherwise."""
    if not isinstance(key, str) or not VAR_NAME.match(key):
        raise ValueError(f"{key!r} is not an environment variable name (letters, digits and '_', "
                         "not starting with a digit)")
    if isinstance(value, Mapping):
        return _from_mapping(key, value)
    if isinstance(value, str):
        kind, sep, where = value.partition(":")
        if sep and kind in KINDS.values():
            return _checked(key, kind, where.strip())
    raise ValueError(f"{key}: a value written inline is refused: the spec travels to Ray's job list, the "
                     f"dashboard, Ray Train and MLflow, where every cluster user can read it. "
                     f"{HOW.format(key=key, lower=key.lower())}")


def _from_mapping(key: str, value: Mapping[str, Any]) -> str:
    if len(value) != 1 or next(iter(value)) not in KINDS:
        raise ValueError(f"{key}: a reference is one of `{{from_env: NODE_VAR}}` or `{{from_file: /path}}` "
                         f"(got the keys {sorted(map(str, value))})")
    (field, where), = value.items()
    if not isinstance(where, str):
        raise ValueError(f"{key}: {field} takes a string (a variable name or an absolute path)")
    return _checked(key, KINDS[field], where.strip())


def _checked(key: str, kind: str, where: str) -> str:
    if kind == "env" and not VAR_NAME.match(where):
        raise ValueError(f"{key}: `env:{where}` does not name an environment variable; write `env:NODE_VAR`")
    # A relative path would resolve inside Ray's working-dir cache on the workers, i.e. a file
    # uploaded with the job: a secret published to the cluster after all.
    if kind == "file" and not os.path.isabs(where):
        raise ValueError(f"{key}: `file:{where}` must be an absolute path on the nodes (e.g. "
                         f"/etc/tidal/secrets/{key.lower()}), not a file in the job's working directory")
    return f"{kind}:{where}"


def check_env(value: Any) -> dict[str, str]:
    """The spec's `env`, every value a reference (pydantic validator of JobSpec.env)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError("env: a mapping of NAME: reference, e.g. `HF_TOKEN: env:HF_TOKEN`")
    return {key: parse_ref(key, ref) for key, ref in value.items()}


def check_worker_env(value: dict[str, str]) -> dict[str, str]:
    """The published `worker_env`: refuses a name that says it holds a credential."""
    for key in value:
        if not VAR_NAME.match(key):
            raise ValueError(f"{key!r} is not an environment variable name")
        if looks_secret(key):
            raise ValueError(f"{key}: worker_env is published (Ray's job list, MLflow params) and this name says "
                             f"it holds a credential; move it to `env` as a reference: `env: {{{key}: env:NODE_VAR}}` "
                             f"or `env: {{{key}: file:/etc/tidal/secrets/{key.lower()}}}`")
    return value


def looks_secret(name: str) -> bool:
    return bool(SECRET_PARTS & set(name.upper().split("_")))


def resolve(env: Mapping[str, str], environ: Mapping[str, str] | None = None,
            read: Callable[[str], str] | None = None) -> dict[str, str]:
    """The values `env`'s references name, read on this node; SecretMissing names every key whose
    reference is not here (and the node), never a value."""
    environ = os.environ if environ is None else environ
    read = read or _read_file
    values, problems = {}, []
    for key, ref in env.items():
        kind, _, where = ref.partition(":")
        if kind == "env":
            if where in environ:
                values[key] = environ[where]
            else:
                problems.append(f"env.{key} ({ref}): the variable {where} is not set on this node; set it in the "
                                "environment `ray start` runs in (or the pod's env) on every node")
        else:
            try:
                values[key] = read(where)
            except OSError as e:
                problems.append(f"env.{key} ({ref}): cannot read the file on this node ({e.strerror or e}); "
                                "put it on every node (e.g. mount the Kubernetes Secret: cluster_configs/kuberay)")
    if problems:
        raise SecretMissing(f"secrets missing on node {socket.gethostname()}: " + "; ".join(problems))
    return values


def _read_file(path: str) -> str:
    # A file written with `echo` or `kubectl create secret --from-file` of such a file ends in a
    # newline that is no part of the secret.
    return Path(path).read_text().rstrip("\r\n")


# --- what a submission carries -------------------------------------------------------------
# How to leave a credential to the cluster, by where it was found.
_INSTEAD = {
    "MLFLOW_TRACKING_URI": "unset it here (the cluster's own MLFLOW_TRACKING_URI applies), or give the server's "
                           "address without user-info and set MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD "
                           "in the nodes' environment (where `ray start` runs, or the pod's env)",
    "TIDAL_STORAGE": "unset it here (the cluster's own TIDAL_STORAGE applies), or name the bucket without "
                     "credentials and give the nodes theirs (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in their "
                     "environment, an instance or pod role)",
    "tracking.uri": "leave tracking.uri out (the cluster's MLFLOW_TRACKING_URI applies), or write the address "
                    "without user-info and set MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD in the nodes' "
                    "environment",
    "checkpoint.storage": "leave checkpoint.storage out (the cluster's TIDAL_STORAGE applies), or name the bucket "
                          "without credentials and give the nodes theirs (their environment, an instance or pod "
                          "role)",
}
_DEFAULT_INSTEAD = ("reference it instead: `env: {NAME: env:NODE_VAR}` (a variable in the nodes' environment) or "
                    "`env: {NAME: file:/etc/tidal/secrets/name}` (a file on the nodes), read on the cluster only")


def credential_problems(spec_data: Any, environ: Mapping[str, str], forwarded: tuple[str, ...]) -> list[tuple[str, str]]:
    """(where, what to do) for each credential a submission would carry: a string of the spec (its
    JSON form, every field) or a forwarded variable of the submitter's environment that the one
    redaction rule (tidal.redact) would mask: a URI's password or token, a signed query, a
    `SECRET_NAME=value`. References in `env` are not credentials. Never names the value."""
    from tidal.redact import redact_text

    found: list[tuple[str, str]] = []

    def visit(data: Any, path: str) -> None:
        if isinstance(data, str):
            if redact_text(data, secrets=()) != data:
                found.append((path, _INSTEAD.get(path, _DEFAULT_INSTEAD)))
        elif isinstance(data, Mapping):
            for k, v in data.items():
                visit(v, f"{path}.{k}" if path else str(k))
        elif isinstance(data, (list, tuple)):
            for i, v in enumerate(data):
                visit(v, f"{path}[{i}]")

    visit(spec_data, "")
    for key in forwarded:
        value = environ.get(key, "")
        if value and redact_text(value, secrets=()) != value:
            found.append((f"${key} (this machine's environment)", _INSTEAD.get(key, _DEFAULT_INSTEAD)))
    return found


def refuse_credentials(spec_data: Any, environ: Mapping[str, str], forwarded: tuple[str, ...]) -> None:
    """SubmissionCarriesSecret unless credential_problems finds nothing: what `tidal submit` sends (the
    entrypoint, its runtime_env) is shown to every holder of the cluster's token (`ray job list`,
    the dashboard), so a credential in it is refused before anything is sent."""
    problems = credential_problems(spec_data, environ, forwarded)
    if problems:
        lines = "\n".join(f"  - {where} holds a credential: {how}" for where, how in problems)
        raise SubmissionCarriesSecret(
            "refused: a submission is shown to every holder of the cluster's token (ray job list, the "
            f"dashboard), and this one would carry a credential.\n{lines}")


class SubmissionCarriesSecret(TidalError):
    """A submission would carry a credential (refused before anything is sent)."""


# --- what Ray Train records --------------------------------------------------------------------
SPEC_REF = "spec_ref"  # in train_loop_config: the whole spec, in Ray's object store, when it holds a credential


def carried_spec(spec_data: dict[str, Any], put: Callable[[Any], Any]) -> dict[str, Any]:
    """train_loop_config's spec entries: Ray Train's state API (the dashboard) shows that config to
    every token holder, so the spec goes there redacted; when redaction changed anything (the
    cluster's own MLFLOW_TRACKING_URI or TIDAL_STORAGE holding a credential, resolved into the
    spec on the driver) the workers read the whole spec from the object store (`put`: ray.put),
    which the state API shows as a reference only."""
    from tidal.redact import redact_data

    shown = redact_data(spec_data, secrets=())
    return {"spec": shown} if shown == spec_data else {"spec": shown, SPEC_REF: put(spec_data)}


def with_carried_spec(config: dict[str, Any], get: Callable[[Any], Any]) -> dict[str, Any]:
    """A worker's train_loop_config with the whole spec in place (`get`: ray.get)."""
    return {**config, "spec": get(config[SPEC_REF])} if SPEC_REF in config else config
