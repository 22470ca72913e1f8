"""Ray Train settings that decide how fast a job recovers, where Tidal's defaults differ from Ray's.

Ray Train V2 reads them from environment variables and hands the driver's values to its
controller and workers (`get_env_vars_to_propagate`), so setting them in the driver around
`fit()` is enough, on a local instance and on a cluster. A value the user set always wins.

- `RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S` (Ray: 60 s) bounds only the wait for the worker
  group's placement group. After a node is lost, the elastic policy can size the new group
  from a resource view that still counts the dead node (Ray's autoscaling coordinator looks at
  the nodes every 20 s; `ClusterView` in tidal/launch/callbacks.py has it look again at a
  failure, which usually avoids this); that placement group never becomes ready and the job sat
  out the whole 60 s. The timeout is a controller error that Ray retries without limit
  (`controller_failure_limit=-1`) and never charges to `failure.max_restarts`, and each retry
  sizes the group from the view then, so for an elastic job a short timeout costs nothing and
  bounds what a stale view can cost. A fixed-size job keeps Ray's value: it must wait for its
  nodes (an autoscaler may be starting them), not spin retrying.
- `RAY_TRAIN_HEALTH_CHECK_INTERVAL_S` (Ray: 2 s): how often the controller polls the workers,
  so how late it sees a dead worker, and **how many checkpoints per second a job can save**.
  Each poll takes one report from each worker's queue, which holds one; with asynchronous
  uploads, the worker's single upload thread then waits to hand over the next report, and the
  save after that waits for the thread (`StorageWriter.upload_fn` measures the wait). So
  checkpoints faster than one per interval hold training back: on 2 cores, a checkpoint every
  2 steps of a 280 ms step ran at 495 ms/step with a poll every 1 s and 319 ms/step every 0.5 s
  (no checkpoints: 276 ms; polling faster gained nothing more). A poll is two actor calls: twice
  a second costs the controller about 1% of a core. Tidal polls every 0.25 s: a dead worker is seen
  within a quarter second instead of half (issue 75: a lost rank's cost is counted in seconds, and
  Ray's 0.25 s worked in its probes), for about 2% of a core in the controller.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from tidal.errors import UserCodeError
from tidal.ray_private import HEALTH_CHECK_INTERVAL, WORKER_GROUP_START_TIMEOUT
from tidal.spec.job import JobSpec
from tidal.tracking.quiet import PEER_LOST

START_TIMEOUT = WORKER_GROUP_START_TIMEOUT
POLL_INTERVAL = HEALTH_CHECK_INTERVAL
ELASTIC_START_TIMEOUT_S = "5"
POLL_INTERVAL_S = "0.25"


def recovery_env(spec: JobSpec, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables Tidal sets for `spec`: its defaults, less any the environment already has."""
    wanted = {POLL_INTERVAL: POLL_INTERVAL_S}
    if spec.elastic:
        wanted[START_TIMEOUT] = ELASTIC_START_TIMEOUT_S
    return {k: v for k, v in wanted.items() if k not in environ}


@contextmanager
def recovery_settings(spec: JobSpec) -> Iterator[None]:
    """Set Tidal's recovery defaults for one `fit()`, then restore the environment (the SDK may
    run another job with other needs in the same process)."""
    added = recovery_env(spec, os.environ)
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def not_retried(failures: Mapping[int, BaseException], previous: str | None = None) -> UserCodeError | None:
    """The user's mistake that ends the job without a restart, from the errors of the ranks that
    failed (by rank): a UserCodeError raised before the rank's first step (tidal/worker/user_code.py),
    or one after it that is the same mistake (`signature`) as the attempt before this one ended with
    (`previous`): a restart ran the same code from the checkpoint and met it again, so another one
    would too (a bad sample at step 5,000 failed every one of the job's restarts). It must be so on
    every rank that failed but those whose collective lost that rank (gloo's and NCCL's "peer"
    errors). None: Ray Train's failure policy decides, as for any other failure.

    "Every rank that failed", not every rank: the controller sees the ranks that failed by its poll,
    and the others follow within moments with the same error, or wait in a collective until the
    group is stopped. A rank that failed any other way (a lost node, a device error) leaves the
    decision to Ray: a restart may cure that."""
    def final(e: BaseException) -> bool:
        return isinstance(e, UserCodeError) and (e.first_step or (previous is not None and _key(e) == previous))

    mistakes = [e for _, e in sorted(failures.items()) if final(e)]
    others = [e for e in failures.values() if not final(e)]
    if not mistakes or any(not PEER_LOST.search(str(e)) for e in others):
        return None
    return mistakes[0]


def signature(failures: Mapping[int, BaseException]) -> str | None:
    """The user's mistake an attempt ended with (its lowest rank's), for the next `not_retried`."""
    return next((_key(e) for _, e in sorted(failures.items()) if isinstance(e, UserCodeError)), None)


def _key(e: UserCodeError) -> str:
    return f"{e.field}: {e.message}"


def mistake_message(name: str, e: UserCodeError) -> str:
    """What the driver says when `not_retried` ended job `name`: the user's error and frames once,
    and what to do (a restart from a checkpoint would run the same code on the same inputs)."""
    frames = f"\n{e.frames.rstrip()}" if e.frames else ""
    when = ("failed before its first step" if e.first_step
            else "failed the same way in two attempts in a row (the second resumed from a checkpoint)")
    return (f"job {name!r} {when}, in your code: {e.field}: {e.message}{frames}\n"
            f"Not restarted: a restart runs the same code on the same inputs. Fix {e.field} (or the code it "
            "names), then run the same command again" + ("." if e.first_step else ": it resumes from its latest "
                                                         "checkpoint."))
