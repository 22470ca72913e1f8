"""The job's own process group across Ray's replica groups (failure.replace_in_place), re-formed per generation through a rendezvous that outlives any rank.

With the switch on Ray Train forms no process group across workers (each worker is a replica
group of one: tidal.ray_private.replica_group_config), so that it can replace a lost worker alone.
The driver starts one `Rendezvous` actor per launch (on the head node, beside Ray Train's
controller): it hosts a torch TCPStore in its own process and hands out generations
(worker/health/rounds.py decides them). Every rank forms generation g with
`init_process_group(store=PrefixStore("gen<g>/", <the actor's store>))`: the store is no rank's,
so losing any rank, rank 0 included, leaves it up for the others to form the next generation
with the replacement. The heartbeat's counters live there too (worker/health/heartbeat.py), under
the generation's prefix.

`peer_lost` says which errors mean a peer went away (a collective's transport closed, Ray's report
barrier reset for a replaced worker): only those take the in-place path; a user's own error, or
anything else, raises as before and Ray Train restarts the whole group.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta
from typing import Any

from tidal.tracking.quiet import PEER_LOST
from tidal.worker.health import rounds
from tidal.worker.health.heartbeat import GENERATION_ENV

NAMESPACE = "tidal-rendezvous"
PREFIX = "tidal-rendezvous-"
POLL_S = 0.05
# How long a rank waits for the others in a generation: Ray Train's replacement worker starting (its
# process, imports, train context) under load; past it the group restarts as without the switch.
FORM_S = 180.0
PROCESS_GROUP_TIMEOUT = timedelta(minutes=30)  # Ray Train's TorchConfig default; hangs are the watchdog's
# Ray's report barrier, reset for the survivors when Ray Train replaces a worker (sync_actor.py, 2.60)
BARRIER_RESET = "SynchronizationBarrierResetError"


class RendezvousError(RuntimeError):
    """The group could not be formed again in place: Ray Train's full restart takes over."""


def actor_name(job: str, generation: int) -> str:
    """The rendezvous of the driver of `job` holding lease `generation`."""
    return f"{PREFIX}{job}-{generation}"


def peer_lost(e: BaseException) -> bool:
    """Whether `e` means another rank's process or node went away (and nothing else went wrong): a
    collective's transport closed (gloo's or NCCL's own words, from torch.distributed), or Ray's
    report barrier reset for a worker it replaces. A user's error that merely says "Connection reset
    by peer" (its own download, say) is not one: it raises as before."""
    if type(e).__name__ == BARRIER_RESET:
        return True
    text = str(e)
    transport = "gloo" in text or "NCCL" in text or "c10d" in text or type(e).__module__.startswith("torch")
    return (isinstance(e, RuntimeError) and not isinstance(e, RendezvousError) and transport
            and bool(PEER_LOST.search(text)))


class Rendezvous:
    """The rendezvous actor: the store's server and the generations (run with `ray.remote`)."""

    def __init__(self) -> None:
        import ray
        import torch.distributed as dist

        self.host = ray.util.get_node_ip_address()
        self.store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False)
        self.rounds = rounds.Rounds()

    def address(self) -> tuple[str, int]:
        return self.host, int(self.store.port)

    def join(self, rank: int, world: int, token: str, step: int = 0) -> int:
        self.rounds, gen = rounds.join(self.rounds, rank, world, token, step)
        return gen

    def status(self, gen: int) -> str:
        return rounds.status(self.rounds, gen)

    def members(self) -> dict[int, int]:
        """The newest formed generation's processes: rank -> pid (tests, and what a log names)."""
        return {rank: int(token.split(":")[0]) for rank, token in self.rounds.last.items()}

    def news(self) -> tuple[int, tuple[int, ...], int]:
        """(the newest formed generation, the ranks it has in new processes, the step trained before it)."""
        r = self.rounds
        return (r.formed[-1] if r.formed else 0), r.replaced, r.lost_after


def start(job: str, generation: int) -> Any:
    """The driver's rendezvous actor for this launch (killed by `stop`)."""
    import ray

    from tidal.ray_private import HEAD_RESOURCE

    return ray.remote(Rendezvous).options(
        name=actor_name(job, generation), namespace=NAMESPACE, num_cpus=0, resources={HEAD_RESOURCE: 0.001},
        max_restarts=0).remote()


def stop(actor: Any) -> None:
    import ray

    ray.kill(actor, no_restart=True)


class Member:
    """This rank's side: joins a generation, builds its process group, dissolves it after a peer's loss."""

    def __init__(self, name: str, rank: int, world: int, backend: str, deadline_s: float) -> None:
        import ray

        self.actor = ray.get_actor(name, namespace=NAMESPACE)
        self.rank, self.world, self.backend, self.deadline_s = rank, world, backend, deadline_s
        self.token = f"{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.host, self.port = ray.get(self.actor.address.remote(), timeout=deadline_s)
        self.generation = 0

    def form(self, step: int = 0) -> int:
        """Join the generation being formed (having trained to `step`), wait for every rank, and build
        this rank's process group in it; raises RendezvousError past the deadline (the others never came)."""
        import ray
        import ray.train
        import torch.distributed as dist

        until = time.monotonic() + self.deadline_s
        while True:
            gen = ray.get(self.actor.join.remote(self.rank, self.world, self.token, step), timeout=self.deadline_s)
            while (state := ray.get(self.actor.status.remote(gen), timeout=self.deadline_s)) == "waiting":
                if time.monotonic() > until:
                    raise RendezvousError(f"rank {self.rank}: generation {gen} of the group did not form within "
                                          f"{self.deadline_s:g}s (a rank never joined)")
                time.sleep(POLL_S)
            if state == "formed":
                break
        left = max(1.0, until - time.monotonic())
        client = dist.TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=left),
                               wait_for_workers=False)
        # What Ray Train's torch backend sets before its process group (ray/train/torch/config.py
        # _set_torch_distributed_env_vars); DeepSpeed asserts LOCAL_RANK. Ray counts local ranks per
        # (node, replica group): 0 for every worker here, which tidal.worker.device reads for CUDA.
        ctx = ray.train.get_context()
        os.environ.update(MASTER_ADDR=self.host, MASTER_PORT=str(self.port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world), LOCAL_RANK=str(ctx.get_local_rank()),
                          LOCAL_WORLD_SIZE=str(ctx.get_local_world_size()), NODE_RANK=str(ctx.get_node_rank()),
                          **{GENERATION_ENV: str(gen)})
        dist.init_process_group(self.backend, store=dist.PrefixStore(f"gen{gen}/", client), rank=self.rank,
                                world_size=self.world, timeout=PROCESS_GROUP_TIMEOUT)
        self.generation = gen
        return gen

    def replaced_line(self) -> str | None:
        """What rank 0 says of the generation this rank formed, when it replaced a lost rank in place."""
        import ray

        gen, replaced, lost_after = ray.get(self.actor.news.remote(), timeout=self.deadline_s)
        if gen != self.generation or not replaced:
            return None
        ranks = ("rank " if len(replaced) == 1 else "ranks ") + ", ".join(map(str, replaced))
        return (f"{ranks} lost after step {lost_after}: replaced in place (generation {gen}); the other rank(s) "
                "kept their processes")

    def dissolve(self) -> None:
        """End this rank's process group, and DeepSpeed's references to it (its cached groups), so
        that the next engine is built on the next generation's."""
        import torch.distributed as dist

        ds_comm = _deepspeed_comm()
        if ds_comm is not None and ds_comm.cdb is not None and dist.is_initialized():
            ds_comm.destroy_process_group()  # releases deepspeed.utils.groups' cached groups too
        elif dist.is_initialized():
            dist.destroy_process_group()


def _deepspeed_comm() -> Any:
    import sys

    return sys.modules.get("deepspeed.comm.comm")
