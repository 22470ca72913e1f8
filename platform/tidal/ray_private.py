"""Every reach into Ray's private API, in one place (Tidal's other modules use Ray's public API only:
tests/test_layers.py fails on a private import anywhere else).

Each entry names the Ray version it was checked against and why no public API serves. An upgrade
of Ray that moves or renames one fails `tests/test_ray_private.py`, which imports every name below
and says which one changed. Ray itself is imported inside the functions: importing this module
costs nothing (`tidal --help` never imports Ray).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

CHECKED_AGAINST = "2.60"

# (module, attribute) for every private name used below; tests/test_ray_private.py imports each.
PRIVATE_NAMES: tuple[tuple[str, str], ...] = (
    ("ray._private.state", "available_resources_per_node"),
    ("ray._private.ray_constants", "DEBUG_AUTOSCALING_STATUS"),
    ("ray._private.ray_constants", "DASHBOARD_CLIENT_MAX_SIZE"),
    ("ray.experimental.internal_kv", "_internal_kv_get"),
    ("ray.autoscaler._private.util", "prepare_config"),
    ("ray.autoscaler._private.util", "validate_config"),
    ("ray.autoscaler._private.fake_multi_node.node_provider", "FakeMultiNodeProvider"),
    ("ray._private.runtime_env.packaging", "GCS_STORAGE_MAX_SIZE"),
    ("ray._private.runtime_env.packaging", "_dir_travel"),
    ("ray._private.runtime_env.packaging", "_get_excludes"),
    ("ray._private.ray_logging", "stdout_deduplicator"),
    ("ray._private.ray_logging", "stderr_deduplicator"),
    ("ray._private.worker", "print_worker_logs"),
    ("ray.train.v2._internal.constants", "HEALTH_CHECK_INTERVAL_S_ENV_VAR"),
    ("ray.train.v2._internal.constants", "WORKER_GROUP_START_TIMEOUT_S_ENV_VAR"),
    ("ray.train.v2._internal.execution.context", "TrainContext"),
    ("ray.train.v2._internal.execution.controller.placement_group_cleaner", "PlacementGroupCleaner"),
    ("ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator", "_AutoscalingCoordinatorActor"),
    ("ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client",
     "AUTOSCALING_REQUESTS_EXPIRE_TIME_S"),
    ("ray.train.v2._internal.execution.context", "TrainRunContext"),
    ("ray._raylet", "AuthenticationTokenLoader"),
    ("ray._raylet", "Config"),
    ("ray._raylet", "GcsClient"),
    ("ray._common.constants", "HEAD_NODE_RESOURCE_NAME"),
    # warm spares (tidal/launch/spares.py): the raylet's PrestartWorkers RPC, its stubs and channel
    ("ray._private.grpc_utils", "init_grpc_channel"),
    ("ray.core.generated.node_manager_pb2", "PrestartWorkersRequest"),
    ("ray.core.generated.node_manager_pb2_grpc", "NodeManagerServiceStub"),
    ("ray.core.generated.runtime_environment_pb2", "RuntimeEnvInfo"),
    ("ray.core.generated.common_pb2", "Language"),
    # Ray Train's replica-group replacement (issue 75): the hook a Backend sets and the code that reads it
    ("ray.train.backend", "Backend"),
    ("ray.train.v2._internal.execution.controller.controller", "TrainController"),
    ("ray.train.v2._internal.execution.worker_group.worker_group", "WorkerGroup"),
)
# Ray Train's replica-group hook (2.60): a Backend class attribute that, when true, has the controller
# replace only a failed worker (TrainController._replace_bad_workers ->
# WorkerGroup._replace_replica_group_impl, same placement-group bundle, survivors left running)
# instead of restarting the whole group. tests/test_ray_private.py checks Ray still reads it there.
REPLICA_GROUP_HOOK = "has_replica_groups"
REPLICA_GROUP_CALLS = (("ray.train.v2._internal.execution.controller.controller", "TrainController",
                        "_replace_bad_workers"),
                       ("ray.train.v2._internal.execution.worker_group.worker_group", "WorkerGroup",
                        "_replace_replica_group_impl"))
# The fields Tidal fills in the raylet's PrestartWorkersRequest (src/ray/protobuf/node_manager.proto).
PRESTART_FIELDS = ("language", "job_id", "runtime_env_info", "keep_alive_duration_secs", "num_workers")
# The resource every head node has and no other node (ray._common.constants.HEAD_NODE_RESOURCE_NAME;
# spelled out so that importing this module imports no Ray). Ray Train's own state actor asks for
# 0.001 of it to live on the head, whichever head the cluster has now: no public API says "the head".
HEAD_RESOURCE = "node:__internal_head__"

# Ray Train V2's settings read from the environment (ray.train.v2._internal.constants, 2.60):
# documented as environment variables but exported by no public module, so named here as text.
HEALTH_CHECK_INTERVAL = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
WORKER_GROUP_START_TIMEOUT = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
# The fake multi-node provider's class path, for cluster configs that simulate nodes: Ray 2.60
# ships it only under ray.autoscaler._private (no public provider of simulated nodes).
FAKE_PROVIDER_MODULE = "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider"
# Modules whose loggers Tidal lowers (tracking/quiet.py): Ray names them by file or module path.
TRAIN_CONTEXT_MODULE = "ray.train.v2._internal.execution.context"
PLACEMENT_GROUP_CLEANER_LOGGER = "ray.train.v2._internal.execution.controller.placement_group_cleaner"
RAY_LOGGING_MODULE = "ray._private.ray_logging"
AUTH_TOKEN_SETUP_LOGGER = "ray._private.authentication.authentication_token_setup"
TRAIN_BACKEND_SETUP_LOGGER = "ray.train.v2._internal.callbacks.backend_setup"
TRAIN_CONTROLLER_LOGGER = "ray.train.v2._internal.execution.controller.controller"
# Logs "Error in training function:" with the traceback, in the worker whose function raised.
TRAIN_USER_ERROR_LOGGER = "ray.train.v2._internal.util"
# The exception Ray Train's controller raises when a worker group did not start within
# WORKER_GROUP_START_TIMEOUT, matched by name so that only this adapter knows Ray's private module.
START_TIMEOUT_ERROR = "WorkerGroupStartupTimeoutError"
TRAIN_AUTOSCALING_CLIENT_LOGGER = "ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client"
# Ray's autoscaling coordinator: a detached actor shared by Ray Data and Train V2's elastic policy
# (ray/data/_internal/cluster_autoscaler/default_autoscaling_coordinator.py); its name and namespace.
AUTOSCALING_COORDINATOR = "AutoscalingCoordinator"


def available_resources_per_node() -> dict[str, dict[str, float]]:
    """Free resources of each live node, by node id. Ray 2.60: the public `ray.available_resources()`
    sums the cluster and `ray.util.state.list_nodes` gives totals only; `ray status` uses this one."""
    from ray._private.state import available_resources_per_node as per_node

    return per_node()


def autoscaler_report() -> dict[str, Any]:
    """The v1 autoscaler's last status report (what `ray status` prints from); {} without one.
    Ray 2.60: `ray.autoscaler.v2.sdk.get_cluster_status` serves only autoscaler v2, off by default
    outside KubeRay; v1 publishes its report only in this internal KV key."""
    from ray._private import ray_constants
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS)
    try:
        return json.loads(raw) if raw else {}
    except ValueError:
        return {}


def check_with_ray_schema(config: dict[str, Any], prepared: Callable[[dict[str, Any], Callable[..., Any]], Any]) -> None:
    """Ray's own offline check of a cluster launcher config (defaults, then its JSON schema).
    Ray 2.60: `ray up` runs it, but no public function exposes it without starting a cluster.
    `prepared(config, prepare_config)` lets the caller fence prepare_config's side effects."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepared(config, prepare_config))


def working_dir_upload_cap() -> int:
    """Bytes Ray accepts for a job's working_dir: the dashboard's request cap and the GCS object cap.
    Ray 2.60 documents a 100 MiB limit but exports neither constant publicly."""
    from ray._private import ray_constants
    from ray._private.runtime_env.packaging import GCS_STORAGE_MAX_SIZE

    return min(ray_constants.DASHBOARD_CLIENT_MAX_SIZE, GCS_STORAGE_MAX_SIZE)


def walk_working_dir(root: Path, excludes: list[str], visit: Callable[[Path], None]) -> None:
    """Call `visit` on every path Ray would upload from `root` (.gitignore, .rayignore, `excludes`).
    Ray 2.60: the same walk Ray's packaging does; no public API lists what a working_dir uploads,
    and a walk of our own would disagree with Ray's exclusion rules."""
    from ray._private.runtime_env.packaging import _dir_travel, _get_excludes

    _dir_travel(root, [_get_excludes(root, excludes)], visit, include_gitignore=True)


def worker_error(e: BaseException) -> BaseException:
    """The exception a worker's training function raised, from what Ray Train's controller holds for
    that rank. Ray 2.60 wraps it, with its traceback as text, in `UserExceptionWithTraceback`, whose
    `_base_exc` has no public accessor; anything else is returned as it is."""
    return getattr(e, "_base_exc", e)


def log_deduplicators() -> list[Any]:
    """Ray's driver-side log deduplicators (stdout, stderr) if Ray is imported, else []. Ray 2.60
    reads RAY_DEDUP_LOGS_SKIP_REGEX once at import; a process that imported Ray already can only
    change the pattern on these objects."""
    import sys

    ray_logging = sys.modules.get(RAY_LOGGING_MODULE)
    if ray_logging is None:
        return []
    found = (getattr(ray_logging, n, None) for n in ("stdout_deduplicator", "stderr_deduplicator"))
    return [d for d in found if d is not None and hasattr(d, "skip_re")]


def wrap_worker_log_printer(wrap: Callable[[Callable[..., None]], Callable[..., None]]) -> bool:
    """Put `wrap(printer)` in place of the function a driver prints every line Ray forwards from a
    worker, an actor or a raylet with (`print_worker_logs(data, print_file, ignore_prefix)`), once per
    process; False if Ray is not imported or has no such function. Ray 2.60 (ray._private.worker):
    no public API filters or reformats those lines one by one (RAY_DEDUP_LOGS_SKIP_REGEX drops lines
    only while deduplication is on; RAY_DISABLE_WORKER_LOG_PREFIX drops every line's origin, a real
    error's included)."""
    import sys

    worker = sys.modules.get("ray._private.worker")
    current = getattr(worker, "print_worker_logs", None)
    if current is None:
        return False
    if not getattr(current, "_tidal_wrapped", False):
        wrapped = wrap(current)
        wrapped._tidal_wrapped = True  # type: ignore[attr-defined]
        worker.print_worker_logs = wrapped  # type: ignore[union-attr]
    return True


def recompute_reserved_resources(requester: str, timeout_s: float) -> None:
    """Have Ray's autoscaling coordinator re-read the cluster's nodes now. Ray 2.60: the coordinator
    looks only every 20 s and has no public API; raises whatever Ray raises (no coordinator yet...)."""
    import ray

    coordinator = ray.get_actor(AUTOSCALING_COORDINATOR, namespace=AUTOSCALING_COORDINATOR)
    ray.get(coordinator.get_reserved_resources.remote(requester, recompute=True), timeout=timeout_s)


def train_requester(trainer: Any) -> str | None:
    """The id under which a Ray Train V2 run asks the autoscaling coordinator for its workers.
    Ray 2.60: `f"train-{run_id}"` (train/v2/_internal/execution/scaling_policy/scaling_policy.py
    `after_controller_start`), the run id drawn in the driver when the trainer is built
    (`DataParallelTrainer.train_run_context`); no public API names either."""
    run_id = getattr(getattr(trainer, "train_run_context", None), "run_id", None)
    return f"train-{run_id}" if run_id else None


def cancel_reservation(requester: str, timeout_s: float) -> None:
    """Have Ray's autoscaling coordinator drop `requester`'s request and what it reserved for it
    (a requester it does not know: nothing happens). Ray 2.60: a run whose controller died with
    its driver keeps its reservation until the request expires (`AUTOSCALING_REQUESTS_EXPIRE_TIME_S`,
    180 s), and the coordinator has no public API; raises whatever Ray raises."""
    import ray

    coordinator = ray.get_actor(AUTOSCALING_COORDINATOR, namespace=AUTOSCALING_COORDINATOR)
    ray.get(coordinator.cancel_request.remote(requester_id=requester), timeout=timeout_s)


def reload_auth_token() -> None:
    """Have this process read the Ray auth token again (RAY_AUTH_TOKEN, ~/.ray/auth_token). Ray 2.60
    caches the first token a process reads, so a process that talks to a second token-auth cluster
    (a test harness starting heads one after another) is refused by it; no public API resets it."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def pin_package(uri: str, seconds: int) -> None:
    """Keep a `gcs://` package in the GCS for `seconds` whatever references it, the way Ray pins
    a fresh upload until its job holds it (ray._private.runtime_env: the temporary reference).
    A parked job's package (admission/parking.py) outlives the driver that held it this way."""
    from ray.experimental.internal_kv import _pin_runtime_env_uri

    _pin_runtime_env_uri(uri, expiration_s=int(seconds))


def package_exists(uri: str) -> bool:
    """Whether the GCS still holds a `gcs://` package (Ray 2.60: no public call says)."""
    from ray._private.runtime_env.packaging import package_exists as exists

    return bool(exists(uri))


def drain_node(gcs_address: str, node_id: str, reason: str, deadline_ms: int) -> tuple[bool, str]:
    """Ask the GCS to drain `node_id` (hex) for preemption, the node going at `deadline_ms` (epoch
    ms): (accepted, Ray's reason for refusing). What Ray's autoscaler v2 does before it takes a
    node away, and what Ray Train's preemption watcher reads (`ray.train.get_preemption_info()`).
    Ray 2.60: the GCS's DrainNode RPC is reached only through `ray._raylet.GcsClient` (its own
    `ray drain-node` is a hidden developer command that needs a connected driver to find the node)."""
    from ray._raylet import GcsClient
    from ray.core.generated import autoscaler_pb2

    accepted, why = GcsClient(address=gcs_address).drain_node(
        node_id, autoscaler_pb2.DrainNodeReason.DRAIN_NODE_REASON_PREEMPTION, reason, int(deadline_ms))
    return bool(accepted), str(why or "")


def alive_nodes(gcs_address: str) -> dict[str, str]:
    """{node id (hex): its address} of the cluster's alive nodes, read from the GCS without
    connecting a driver (a node's watcher must not start a Ray worker process of its own).
    Ray 2.60: `ray.nodes()` needs `ray.init`; `GcsClient.get_all_node_info` is private."""
    from ray._raylet import GcsClient
    from ray.core.generated import gcs_pb2

    infos = GcsClient(address=gcs_address).get_all_node_info(timeout=10)
    return {info.node_id.hex(): info.node_manager_address for info in infos.values()
            if info.state == gcs_pb2.GcsNodeInfo.GcsNodeState.ALIVE}


def prestart_workers(raylet: str, job_id: str, runtime_env: str, count: int, keep_alive_s: int,
                     timeout_s: float = 10.0) -> None:
    """Have the raylet at `raylet` (host:port of its node manager) start `count` idle Python workers
    for job `job_id` (hex) with the runtime env `runtime_env` (the exact serialized string an actor's
    runtime env becomes: `ray.get_runtime_context().get_runtime_env_string()` inside one), kept
    alive `keep_alive_s` whatever the raylet's idle-worker limit. An actor of that job with that
    exact runtime env then takes one instead of starting a process. Ray 2.60: the raylet's
    `NodeManagerService.PrestartWorkers` RPC has no Python API (the core worker calls it only for
    tasks); the channel must come from `init_grpc_channel`, which adds the cluster's token (a bare
    channel is refused: UNAUTHENTICATED). Raises grpc.RpcError when the raylet refuses or is gone."""
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc
    from ray.core.generated.runtime_environment_pb2 import RuntimeEnvInfo

    channel = init_grpc_channel(raylet)
    try:
        node_manager_pb2_grpc.NodeManagerServiceStub(channel).PrestartWorkers(
            node_manager_pb2.PrestartWorkersRequest(
                language=common_pb2.Language.PYTHON, job_id=bytes.fromhex(job_id),
                runtime_env_info=RuntimeEnvInfo(serialized_runtime_env=runtime_env),
                keep_alive_duration_secs=int(keep_alive_s), num_workers=int(count)),
            timeout=timeout_s)
    finally:
        channel.close()


def replica_group_config(backend: str) -> Any:
    """A Ray Train TorchConfig whose Backend sets Ray's replica-group hook (REPLICA_GROUP_HOOK): when
    one worker fails and the group keeps its size, Ray Train 2.60 replaces that worker alone, in its
    placement-group bundle, and leaves the others' actors, processes and training threads running
    (TrainController._replace_bad_workers). Ray then forms no torch process group across workers
    (each replica group is a world of one): the job forms its own. Ray 2.60: the hook has no public
    API; torchft's config (ray.train.v2.torch.torchft_config) is its only user in the wheel."""
    from ray.train.backend import Backend
    from ray.train.torch import TorchConfig

    class _ReplicaGroups(Backend):
        has_replica_groups = True

    class _ReplicaGroupConfig(TorchConfig):
        @property
        def backend_cls(self) -> type[Backend]:
            return _ReplicaGroups

    return _ReplicaGroupConfig(backend=backend)


# Ray Train 2.60's replacement of one replica group asks every other group still marked active to clear
# its result queue (WorkerGroup._replace_replica_group_impl): a second group lost at the same time is
# still marked active, its dead actor's ActorDiedError ends the run as a controller error that Ray does
# not retry, and the job failed when two ranks were lost at once. Shut down first, a failing group is
# skipped there (and its own replacement's shutdown is a no-op: ReplicaGroup.shutdown is idempotent).
# Patched on WorkerGroup, a plain class: the controller is an actor, whose class Ray copies its methods
# into when it starts it, so a patch of TrainController's methods would not reach the running one.
REPLACE_TOGETHER = (("ray.train.v2._internal.execution.worker_group.worker_group", "WorkerGroup", "replace_replica_group"),
                    ("ray.train.v2._internal.execution.worker_group.worker_group", "WorkerGroup", "get_latest_poll_status"),
                    ("ray.train.v2._internal.execution.worker_group.worker_group", "WorkerGroup", "get_replica_groups"),
                    ("ray.train.v2._internal.execution.worker_group.execution_group", "ReplicaGroup", "shutdown"))


def replace_lost_groups_together() -> None:
    """Have Ray Train's worker group shut down every failing replica group before it replaces one (see
    REPLACE_TOGETHER), so that several workers lost at once are each replaced alone. Call in the
    controller's process (tidal.launch.callbacks.FailureNotifier, once unpickled there); idempotent."""
    from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup

    replace = WorkerGroup.replace_replica_group
    if getattr(replace, "tidal_together", False):
        return

    def replace_replica_group(self: Any, replica_group_index: int) -> None:
        status, groups = self.get_latest_poll_status(), self.get_replica_groups() or []
        # once per poll: the controller replaces its failing groups one after another, and a group
        # replaced already is a new one that the same poll still names
        if status is not None and getattr(self, "_tidal_shut_for", None) is not status:
            self._tidal_shut_for = status
            for index in sorted(status.failing_replica_group_indices):
                if index != replica_group_index and index < len(groups):
                    groups[index].shutdown()
        replace(self, replica_group_index)

    replace_replica_group.tidal_together = True  # type: ignore[attr-defined]
    WorkerGroup.replace_replica_group = replace_replica_group
