"""A `tidal run` killed mid-job left its elastic run's request in Ray's autoscaling coordinator,
which kept the workers' CPUs reserved for the dead run until the request expired (180 s in Ray
2.60): the same command run again found nothing reserved for it and waited, 205 s from the new
driver's start to its first step on a 2-CPU cluster (the chaos benchmark's driver fault: 217 s).
A launch now records its requester in the job file and the next launch releases it first."""

from __future__ import annotations

import pytest

from tidal.launch.trainer import release_reservation

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]


def coordinator():
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )

    return get_or_create_autoscaling_coordinator()


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): one fault of Ray Train's reservation
def test_a_dead_launchs_reservation_is_released_for_the_next():
    import ray

    c = coordinator()
    # What a killed launch leaves: both CPUs reserved to its requester, for 180 s more.
    ray.get(c.request_resources.remote(requester_id="train-dead", resources=[{"CPU": 1}] * 2, expire_after_s=180))
    assert ray.get(c.get_reserved_resources.remote("train-dead", recompute=True)), "the dead launch holds the CPUs"
    ray.get(c.request_resources.remote(requester_id="train-next", resources=[{"CPU": 1}] * 2, expire_after_s=180))
    assert not ray.get(c.get_reserved_resources.remote("train-next", recompute=True)), "so the next launch waits"

    assert release_reservation("train-dead")

    assert not ray.get(c.get_reserved_resources.remote("train-dead", recompute=True))
    reserved = ray.get(c.get_reserved_resources.remote("train-next", recompute=True))
    assert sum(r.get("CPU", 0) for r in reserved.values()) == 2, reserved
    ray.get(c.cancel_request.remote(requester_id="train-next"))


def test_nothing_to_release_is_no_error():
    assert not release_reservation(None)
    coordinator()  # as an elastic job's first launch makes it (this test must not rely on the one above)
    assert release_reservation("train-never-seen")  # the coordinator answers; nothing was held
