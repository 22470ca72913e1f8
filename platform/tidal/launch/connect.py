"""Which Ray a driver uses: the cluster in RAY_ADDRESS, the one `ray start` started on this machine,
or a local instance of its own; and whether the way to a cluster's dashboard carries its token in
clear (`plain_token_warning`).

Ray's own `ray.init()` without an address connects to the cluster whose address `ray start` (or a
test `Cluster`) wrote to `<temp dir>/ray/ray_current_cluster`; when that cluster has since died
(killed, crashed, the machine rebooted) it retries the address for 20 s to minutes, then fails.
Tidal keeps the first habit (run on a head node, use its cluster) and not the second: an address
nobody answers at is a leftover, so Tidal says so and starts a local instance instead.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

DASHBOARD_ENV = "TIDAL_RAY_DASHBOARD"
# Every worker process of the job runs it: Tidal's console hook, and a warm spare's preload (worker/spares.py)
SETUP_HOOK = "tidal.worker.spares.setup_worker"
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # a submitted job's config, set by Ray's job supervisor
LOCAL_START = "[tidal] no RAY_ADDRESS: starting a local Ray instance"
log = logging.getLogger("tidal")
_LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
_warned: set[str] = set()


@dataclass(frozen=True)
class RayTarget:
    address: str | None  # for ray.init; None: start a local instance
    line: str  # what Tidal prints about it
    warning: str | None = None  # a recorded cluster that no longer answers


def address_file(env: Mapping[str, str]) -> Path:
    """Where `ray start` records its cluster's address. Written by hand because Ray reads it only
    inside ray.init (ray._common.utils.get_default_ray_temp_dir); this follows the same rules."""
    if env.get("RAY_TMPDIR"):
        base = env["RAY_TMPDIR"]
    elif sys.platform.startswith("linux") and env.get("TMPDIR"):
        base = env["TMPDIR"]
    else:
        base = "/tmp"
    return Path(base) / "ray" / "ray_current_cluster"


def answers(address: str, timeout_s: float = 1.0) -> bool:
    """Whether anything accepts a TCP connection at host:port (a dead GCS's port refuses at once)."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
        return True
    except (OSError, ValueError):
        return False


def ray_target(env: Mapping[str, str], recorded: str | None, alive: Callable[[str], bool]) -> RayTarget:
    """Decide where to connect: RAY_ADDRESS first (`local` forces a local instance), then a cluster
    `ray start` recorded on this machine if it still answers, else a local instance."""
    address = env.get("RAY_ADDRESS", "")
    if address and address != "local":
        return RayTarget(address, f"[tidal] connecting to the Ray cluster at {address}")
    if address == "local":
        return RayTarget(None, "[tidal] RAY_ADDRESS=local: starting a local Ray instance")
    if not recorded:
        return RayTarget(None, LOCAL_START)
    if alive(recorded):
        # "auto" reaches the same recorded address and, unlike the address itself, lets ray.init pick up
        # the token `ray start` left on this machine (Ray enables token auth only for a cluster it found)
        return RayTarget("auto", f"[tidal] connecting to the Ray cluster `ray start` started on this machine at "
                                   f"{recorded} (RAY_ADDRESS=local starts a separate local instance)")
    return RayTarget(None, LOCAL_START,
                     f"the Ray cluster recorded in {address_file(env)} ({recorded}) no longer answers (stopped without "
                     "`ray stop`?): ignoring it and starting a local Ray instance")


def connect_ray(dashboard: bool = False) -> None:
    """Connect this process to Ray as `ray_target` decides, unless it already is.

    The local instance has no dashboard unless `dashboard` or TIDAL_RAY_DASHBOARD=1 asks for it:
    it serves Ray Train's PlacementGroupCleaner, which asks the State API about the controller every
    second, and on a 2-core machine that costs training about 3% (docs/benchmarks.md, "Ray's dashboard
    on a local instance"). Without it the cleaner cannot ask; its warning about that is lowered
    (tidal.tracking.quiet.quiet_placement_group_cleaner). A cluster keeps whatever it was started with."""
    from tidal.tracking.quiet import skip_known_ray_errors, tidy_driver_console

    skip_known_ray_errors()  # the CLI did it before `import ray`; an API caller may not have
    import ray

    tidy_driver_console()  # what this driver prints of the lines Ray forwards to it

    if ray.is_initialized():
        return
    path = address_file(os.environ)
    recorded = path.read_text().strip() if path.is_file() else None
    target = ray_target(os.environ, recorded, answers)
    if target.address is not None:
        print(target.line, flush=True)
        ray.init(address=target.address, logging_level=logging.WARNING, log_to_driver=True,
                 **cluster_ray_options(os.environ))
        return
    options = local_ray_options(dashboard, os.environ)
    if target.warning:
        log.warning(target.warning)
    print(target.line + ("" if options["include_dashboard"] else f" (without its dashboard; {DASHBOARD_ENV}=1 starts it)"), flush=True)
    # "local": never the recorded address, which ray.init would otherwise try again
    ray.init(address="local", logging_level=logging.WARNING, log_to_driver=True, **options)


def local_ray_options(dashboard: bool, env: Mapping[str, str]) -> dict[str, Any]:
    """ray.init's options for a local instance: the dashboard only if asked for (by the caller or
    TIDAL_RAY_DASHBOARD); without it, a hook in every worker process lowers the cleaner's warning (and
    has a warm spare import torch: tidal/worker/spares.py)."""
    if dashboard or env.get(DASHBOARD_ENV, "") not in ("", "0"):
        return {"include_dashboard": True}
    return {"include_dashboard": False, "runtime_env": {"worker_process_setup_hook": SETUP_HOOK}}


def cluster_ray_options(env: Mapping[str, str]) -> dict[str, Any]:
    """ray.init's options on a cluster: the same hook, since a cluster without a dashboard makes the
    cleaner warn every second too (with one, the hook changes nothing: the cleaner has no reason to
    warn). Not when the submitted job's runtime_env has a setup hook of its own: Ray refuses to merge
    two (ValueError in ray.init), and the user's hook wins. Not under TIDAL_DEBUG=1."""
    if env.get("TIDAL_DEBUG", "") not in ("", "0"):
        return {}
    submitted = json.loads(env.get(RAY_JOB_ENV) or "{}").get("runtime_env") or {}
    if "worker_process_setup_hook" in submitted:
        return {}
    return {"runtime_env": {"worker_process_setup_hook": SETUP_HOOK}}


def plain_token_warning(address: str, has_token: bool) -> str | None:
    """What to say when the cluster token would travel in clear: plain http (or no scheme, which
    Ray's client reads as http) to anything but this machine; None otherwise. A tunnel's local end
    (`ray dashboard CLUSTER.yaml` forwards 8265 over SSH) is loopback, so it passes."""
    url = urlparse(address if "://" in address else f"http://{address}")
    if not has_token or url.scheme != "http" or url.hostname in _LOOPBACK_HOSTS:
        return None
    return (f"warning: the Ray token goes to {address} over plain http, readable by anyone on the way, and "
            "whoever holds it runs code as the cluster. Forward the dashboard over SSH (`ray dashboard "
            "CLUSTER.yaml`, then --address http://127.0.0.1:8265; KubeRay: `kubectl port-forward "
            "svc/<cluster>-head-svc 8265`), or put a TLS proxy on the head and use --address https://... "
            "(docs/security.md)")


def warn_plain_token(address: str, has_token: bool) -> None:
    """Print `plain_token_warning` on stderr, once per address and process."""
    message = plain_token_warning(address, has_token)
    if message and address not in _warned:
        _warned.add(address)
        print(message, file=sys.stderr, flush=True)
