"""What a cluster config exposes to the network, and which secrets it writes inline.

The rules (docs/security.md says why each one matters):
- an `mlflow server` on any address but loopback runs an authentication app (`--app-name
  basic-auth`, MLflow's own): without it anyone who reaches the port reads, overwrites and deletes
  every team's runs, and through its artifact proxy the bucket, with the head's credentials;
- it binds the head's private address, not every interface (`0.0.0.0`), except inside a
  Kubernetes pod, whose only interface is its private pod IP;
- Ray's dashboard (the Jobs API: whoever holds the token runs code as the cluster) stays on
  loopback (Ray's default), reached by SSH port forwarding or a TLS proxy on the head;
- jobs on a cluster whose MLflow asks for a password carry MLflow's own client variables;
- a secret (a password, a token, a key) is never written inline: it is read from a file or a
  Kubernetes Secret the cluster holds;
- Ray's token auth stays on (`RAY_AUTH_MODE=disabled` anywhere is refused).
Each is a small pure function returning (where, message) pairs, like cluster/configs.py.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterator, Mapping
from typing import Any

Problem = tuple[str, str]
_AUTH_DISABLED = re.compile(r"RAY_AUTH_MODE\s*[=:]\s*[\"']?disabled", re.IGNORECASE)

LOOPBACK = ("127.0.0.1", "localhost", "::1")
WILDCARD = ("0.0.0.0", "::", "[::]", "*")
AUTH_DOC = "docs/security.md"
# MLflow's client variables: a user and password, or a bearer token (mlflow/environment_variables.py).
CREDENTIAL_VARS = (("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"), ("MLFLOW_TRACKING_TOKEN",))
_SECRET_NAME = re.compile(r"(PASSWORD|PASSWD|TOKEN|SECRET|SECRET_KEY|SECRET_ACCESS_KEY|API_KEY|PRIVATE_KEY)$",
                          re.IGNORECASE)
# What MLflow 3.17's basic-auth app needs to start as the configs mean it (mlflow/server/auth/):
# without the first it uses its packaged basic_auth.ini, whose default_permission READ lets every
# user read every team's runs; without the other two it refuses to start on an empty user store.
AUTH_APP_VARS = {
    "MLFLOW_AUTH_CONFIG_PATH": "the settings, e.g. ~/mlflow-conf/basic_auth.ini (cluster_configs/mlflow/): MLflow's "
                               "packaged one has default_permission READ, so every user would read every team's runs",
    "MLFLOW_AUTH_ADMIN_PASSWORD": "the admin's first password, e.g. \"$(cat ~/.tidal/mlflow-admin-password)\": "
                                  "MLflow refuses to start on an empty user store without it",
    "MLFLOW_FLASK_SERVER_SECRET_KEY": "the key of its CSRF protection, e.g. \"$(cat ~/.tidal/mlflow-secret-key)\": "
                                      "MLflow refuses to start without it",
}


def is_secret_name(name: str) -> bool:
    """A variable whose value is a credential by its name (MLFLOW_TRACKING_PASSWORD, RAY_AUTH_TOKEN...)."""
    return bool(_SECRET_NAME.search(name))


def is_public(host: str) -> bool:
    """Every interface, or a literal address routable on the internet. A shell variable or a name
    (`$HEAD_IP`, `head.internal`) is taken as the private address the config means."""
    if host in WILDCARD:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_global
    except ValueError:
        return False


def mlflow_exposure_problems(where: str, flags: Mapping[str, str], single_interface: bool = False) -> list[Problem]:
    """`mlflow server` flags: authentication off loopback, and no bind on every interface.

    `single_interface`: the server runs in a Kubernetes pod, where `0.0.0.0` is the pod's private IP."""
    host = flags.get("host", "127.0.0.1")  # MLflow's default
    if host in LOOPBACK:
        return []
    problems: list[Problem] = []
    if not flags.get("app-name"):
        problems.append((f"{where}.--host", f"MLflow listens on {host} without authentication: anyone who reaches "
                         "that address reads, overwrites and deletes every team's runs, and through its artifact "
                         "proxy the bucket, with the head's credentials. Add --app-name basic-auth (MLflow's own; "
                         "`pip install 'mlflow[auth]'` where the server runs) with MLFLOW_AUTH_CONFIG_PATH and the "
                         f"admin password from a secret, see {AUTH_DOC}; or keep --host 127.0.0.1 and reach it "
                         "through an SSH tunnel"))
    if is_public(host) and not (single_interface and host in WILDCARD):
        problems.append((f"{where}.--host", f"{host} binds MLflow on {_where_bound(host)}; bind the head's private "
                         "address instead: `HEAD_IP=$(hostname -I | awk '{print $1}'); ... mlflow server --host "
                         "$HEAD_IP`, and point MLFLOW_TRACKING_URI at http://$HEAD_IP:5000 on the head"))
    return problems


def auth_app_problems(where: str, flags: Mapping[str, str], env: Mapping[str, Any] | set[str]) -> list[Problem]:
    """`mlflow server --app-name basic-auth` gets the variables it needs from its own environment."""
    if flags.get("app-name") != "basic-auth":
        return []
    return [(f"{where}.{name}", f"missing: MLflow's basic-auth app needs {why}; set it on the same command line "
             "(on KubeRay: in the mlflow container's env, from a Secret)")
            for name, why in AUTH_APP_VARS.items() if name not in env]


def dashboard_problems(where: str, flags: Mapping[str, str]) -> list[Problem]:
    """`ray start --dashboard-host`: Ray's default (127.0.0.1) or a private address, never a public one."""
    host = flags.get("dashboard-host")
    if host is None or not is_public(host):
        return []
    return [(f"{where}.--dashboard-host", f"{host} puts Ray's dashboard and Jobs API on {_where_bound(host)}: "
             "whoever reaches it with the cluster token runs code as the cluster, and the token travels in clear "
             "over http. Remove --dashboard-host (Ray's default is 127.0.0.1) and reach it from a laptop with "
             "`ray dashboard CLUSTER.yaml` (SSH port forwarding; then --address http://127.0.0.1:8265), or put a "
             f"TLS reverse proxy on the head in front of 127.0.0.1:8265 ({AUTH_DOC})")]


def credential_problems(where: str, env: Mapping[str, Any]) -> list[Problem]:
    """A node whose jobs write to an MLflow that asks for a password carries MLflow's client variables."""
    if any(all(v in env for v in group) for group in CREDENTIAL_VARS):
        return []
    return [(where, "the head's MLflow asks for a password, and this `ray start` gives its jobs none: put "
             "MLFLOW_TRACKING_USERNAME=tidal-jobs MLFLOW_TRACKING_PASSWORD=\"$(cat ~/.tidal/mlflow-jobs-password)\" "
             "(or MLFLOW_TRACKING_TOKEN) in front of `ray start`, the password file copied by file_mounts "
             f"({AUTH_DOC})")]


def inline_secret_problems(where: str, env: Mapping[str, Any]) -> list[Problem]:
    """Shell assignments (`NAME=value`) of a secret variable to a literal value."""
    return [(f"{where}.{name}", f"holds a secret written inline, which every reader of this config (and of the "
             f"node's command lines) sees: read it from a file the cluster holds, e.g. {name}=\"$(cat "
             f"~/.tidal/{name.lower()})\" with the file copied by file_mounts, or on KubeRay valueFrom.secretKeyRef")
            for name, value in env.items() if is_secret_name(name) and _literal(value)]


def kuberay_env_secret_problems(where: str, env: list[Any]) -> list[Problem]:
    """A container's env entries that give a secret variable a literal `value:` instead of a Secret."""
    return [(f"{where}.{e['name']}", "holds a secret as a literal value, which every reader of the manifest and "
             "of the pod spec sees: use valueFrom: {secretKeyRef: {name: SECRET, key: KEY}} "
             "(kubectl create secret generic ...)")
            for e in env if isinstance(e, dict) and isinstance(e.get("name"), str) and is_secret_name(e["name"])
            and _literal(e.get("value"))]


def service_type_problems(where: str, head_group: Mapping[str, Any]) -> list[Problem]:
    """KubeRay's head service stays inside the Kubernetes cluster (ClusterIP, KubeRay's default)."""
    kind = head_group.get("serviceType")
    if kind not in ("LoadBalancer", "NodePort"):
        return []
    return [(f"{where}.serviceType", f"{kind} exposes the head's dashboard (Jobs API) and MLflow outside the "
             "Kubernetes cluster in plain http; remove it (ClusterIP) and reach them with `kubectl port-forward` "
             f"or an Ingress with TLS ({AUTH_DOC})")]


def auth_problems(config: Any) -> list[Problem]:
    """Token auth is Ray 2.60's default; a config that turns it off is refused."""
    problems = []
    for where, value in _walk(config, ""):
        if isinstance(value, str) and _AUTH_DISABLED.search(value):
            problems.append((where, "sets RAY_AUTH_MODE=disabled; keep token auth on (remove it and "
                             "give every node the token: ~/.ray/auth_token or RAY_AUTH_TOKEN)"))
        elif isinstance(value, dict) and value.get("name") == "RAY_AUTH_MODE" and value.get("value") == "disabled":
            problems.append((where, "sets RAY_AUTH_MODE to disabled; keep token auth on (value: token)"))
    return problems


def _walk(value: Any, where: str) -> Iterator[tuple[str, Any]]:
    yield where or "<config>", value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _walk(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _walk(v, f"{where}[{i}]")


def _literal(value: Any) -> bool:
    """A value written out, not read at run time (`$VAR`, `$(cat file)`)."""
    return isinstance(value, str) and bool(value) and not value.startswith("$")


def _where_bound(host: str) -> str:
    return "every interface of the node" if host in WILDCARD else "a public address"


__all__ = ["AUTH_APP_VARS", "CREDENTIAL_VARS", "auth_app_problems", "auth_problems", "credential_problems",
           "dashboard_problems", "inline_secret_problems", "is_public", "is_secret_name", "kuberay_env_secret_problems",
           "mlflow_exposure_problems", "service_type_problems"]
