"""The memory tier shares a cluster safely: two jobs with one name on two storages never read each
other's snapshots nor end each other's keepers; a driver whose lease was taken ends nothing of the
newer driver's; a keeper no driver of its job has touched for its expiry ends itself; and a
keeper's shard table holds under its concurrent calls. Real Ray, one raylet per simulated node
(ray.cluster_utils.Cluster), real leases on local storage."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import ray
import torch

from tests.conftest import tiny_spec
from tests.memory_jobs import packed
from tidal.launch import trainer
from tidal.lease import Lease
from tidal.testing.clusters import raylet_cluster
from tidal.testing.processes import wait_for
from tidal.worker.checkpoint import keeper, memory
from tidal.worker.checkpoint.keeper import Keeper


@pytest.mark.slow  # a few seconds of racing threads, no Ray
def test_a_keepers_shard_table_holds_under_concurrent_puts_listings_and_gets():
    """A keeper serves up to four calls at once (its actor's max_concurrency): a snapshot's puts of
    two ranks, a restore's listing and gets. Unlocked, a listing raced a put's prune and failed with
    "dictionary changed size during iteration"."""
    import sys

    k = Keeper("job", "n0", limit_bytes=1 << 30)
    errors: list[BaseException] = []
    stop = threading.Event()

    def each(fn) -> None:
        try:
            while not stop.is_set():
                fn()
        except BaseException as e:  # noqa: BLE001 - collected: the test names it
            errors.append(e)

    steps = iter(range(10**9))

    def puts(rank: int) -> None:
        step = next(steps)
        k.put("a", step, rank, {"world_size": 2}, *files, prune_below=step - 2)

    files = packed({f"f{i}": {"w": torch.ones(4)} for i in range(50)})
    callers = [lambda: puts(0), lambda: puts(1), k.listing, k.stats, lambda: k.where("a", 1, 0)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=each, args=(fn,), daemon=True) for fn in callers]
        for t in threads:
            t.start()
        time.sleep(2)
        stop.set()
        for t in threads:
            t.join(timeout=10)
    finally:
        sys.setswitchinterval(switch)
    assert not errors, f"a keeper's concurrent calls failed: {errors[0]!r}"
    held = k.listing()
    assert k.stats()["bytes"] == 4 * files[0]["total"], "two segments per rank, reused: none grown or leaked"
    assert 1 <= len(held) <= 4 and all(k.where(e["attempt"], e["step"], e["rank"]) is not None for e in held)


@pytest.fixture(scope="module")
def cluster() -> Iterator[object]:
    with raylet_cluster(workers=2) as c:
        yield c


def nodes() -> list[str]:
    return sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU"))


def hand(spec, generation: int, step: int, world: int = 2) -> None:
    """What each rank of a group of `world` hands its node's keeper for a snapshot of `step`."""
    job = keeper.Owner.of(spec, generation)
    for rank, node in enumerate(nodes()[:world]):
        facts = {"world_size": world, "zero_stage": 2, "fingerprint": spec.fingerprint_hash(), "node": node,
                 "state": {"step": step, "world_size": world, "zero_stage": 2} if rank == 0 else None}
        files = {f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt": {"o": torch.ones(3)}}
        if rank == 0:
            files["mp_rank_00_model_states.pt"] = {"m": torch.ones(3)}
        assert ray.get(keeper.handle(job, node, None).put.remote("att", step, rank, facts, *packed(files))) is None


def alive(job: keeper.Owner) -> int:
    return len(keeper.keepers(job))


@pytest.mark.slow
def test_two_jobs_with_one_name_on_two_storages_never_share_snapshots_or_keepers(cluster, tmp_path):
    a = tiny_spec(tmp_path / "a", name="shared-name", **{"checkpoint.memory.every_steps": 3}).resolved()
    b = tiny_spec(tmp_path / "b", name="shared-name", **{"checkpoint.memory.every_steps": 3}).resolved()
    assert a.checkpoint.storage != b.checkpoint.storage and a.fingerprint_hash() == b.fingerprint_hash()
    hand(a, 1, step=6)
    hand(b, 1, step=730)

    held, plan = memory.newest_complete(a, generation=1)
    assert plan is not None and plan.step == 6, "job A would load job B's snapshot"
    held, plan = memory.newest_complete(b, generation=1)
    assert plan is not None and plan.step == 730

    a_lease = Lease(a.checkpoint.storage, a.name)
    a_lease.acquire()
    try:  # job A's driver ends its keepers: job B's stay, with B's snapshot
        trainer._free_memory_tier(a, a_lease)
    finally:
        a_lease.release()
    assert alive(keeper.Owner.of(a, 1)) == 0 and alive(keeper.Owner.of(b, 1)) == 2
    assert memory.newest_complete(b, generation=1)[1].step == 730
    keeper.remove(keeper.Owner.of(b, 1))


@pytest.mark.slow
def test_a_driver_whose_lease_was_taken_ends_nothing_of_the_newer_ones(cluster, tmp_path):
    spec = tiny_spec(tmp_path, name="taken-over", **{"checkpoint.memory.every_steps": 3}).resolved()
    old = Lease(spec.checkpoint.storage, spec.name, ttl=0.5)
    old.acquire()  # never renewed: a driver stopped (or cut off from storage) past its lease
    time.sleep(1.0)
    new = Lease(spec.checkpoint.storage, spec.name)
    new.acquire()
    assert new.generation > old.generation
    try:
        hand(spec, new.generation, step=9)
        trainer._free_memory_tier(spec, old)  # the old driver's `finally`
        assert alive(keeper.Owner.of(spec, new.generation)) == 2, "the old driver ended the newer one's keepers"
        assert memory.newest_complete(spec, generation=new.generation)[1].step == 9
        trainer._free_memory_tier(spec, new)  # the holder ends them
        assert alive(keeper.Owner.of(spec, new.generation)) == 0
    finally:
        new.release()


@pytest.mark.slow
def test_keepers_no_driver_of_their_job_touches_end_themselves_after_their_expiry(cluster, tmp_path):
    spec = tiny_spec(tmp_path, name="expiring", **{"checkpoint.memory.every_steps": 3}).resolved()
    job = keeper.Owner.of(spec, 1)
    for node in nodes():
        ray.get(keeper.handle(job, node, None, expiry_s=5.0).stats.remote())
    with keeper.heartbeat(job, every_s=0.5):  # a live driver: they stay well past their expiry
        time.sleep(12)  # ten touches per expiry: a margin for a loaded machine
        assert alive(job) == 2, "a keeper ended while its driver was touching it"
    # the driver is gone: nothing touches them any more
    wait_for("the keepers of a driver no longer seen to end", lambda: alive(job) == 0, 60)
