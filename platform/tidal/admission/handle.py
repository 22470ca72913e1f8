"""How drivers, workers and the CLI reach the cluster's admission actor (admission/actor.py), and
how it is started where none runs: detached, restarted by Ray forever, on the head."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from tidal.admission.actor import Admitter
from tidal.admission.naming import ACTOR, NAMESPACE, QUEUE_VAR, queue_document
from tidal.admission.quotas import QUOTAS_VAR
from tidal.ray_private import HEAD_RESOURCE

# The actor's threads: heartbeats, registrations and ends in the default group; calls that wait
# on the cluster's Jobs API (a park pins its package) in a group of their own, so that a slow
# dashboard and a burst of parks can never hold every thread while running jobs' heartbeats wait
# (past the actor's lease, every running job would be dropped and its slots given away).
JOBS_API_GROUP = "jobs-api"
JOBS_API_METHODS = frozenset({"park"})
THREADS: dict[str, Any] = {"max_concurrency": 8, "concurrency_groups": {JOBS_API_GROUP: 4}}


def method(handle: Any, name: str) -> Any:
    """`handle`'s method `name`, in the thread group it belongs to (THREADS)."""
    call = getattr(handle, name)
    return call.options(concurrency_group=JOBS_API_GROUP) if name in JOBS_API_METHODS else call


def admitter(create: bool = False, environ: Mapping[str, str] | None = None) -> Any:
    """The cluster's admission actor (started on the head if `create` and none runs); None when
    it cannot be reached (admission down: running jobs carry on)."""
    import ray

    env = os.environ if environ is None else environ
    try:
        return ray.get_actor(ACTOR, namespace=NAMESPACE)
    except ValueError:
        if not create:
            return None
    actor = ray.remote(**THREADS)(Admitter).options(  # concurrency groups are the class's, not an option
        name=ACTOR, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0,
        max_restarts=-1, max_task_retries=-1,
        # On the head, whichever head the cluster has now: after a head loss Ray restarts the actor
        # on the new head, never on a worker node, whose disk holds no queue document (a soft
        # affinity to the lost head's node id let it start on any node and read an empty queue).
        resources={HEAD_RESOURCE: 0.001},
        runtime_env={"env_vars": {k: env[k] for k in (QUOTAS_VAR, QUEUE_VAR, "TIDAL_STORAGE",
                                                      "AWS_ENDPOINT_URL") if env.get(k)}},
    )
    return actor.remote(env[QUOTAS_VAR], queue_document(env))


__all__ = ["JOBS_API_GROUP", "THREADS", "admitter", "method"]
