"""Several ranks lost at once with failure.replace_in_place (issue 75): Tidal has Ray Train's controller shut
down every failing replica group before it replaces any (tidal.ray_private.replace_lost_groups_together),
since Ray 2.60 asked the second dead group to clear its queue and failed the run. The real-Ray test is
tests/test_replace_in_place_combined.py; this one fails, naming what moved, when Ray's code changes."""

from __future__ import annotations

import importlib
import inspect

from tidal import ray_private


def test_the_calls_the_patch_stands_on_are_where_ray_has_them():
    for module, cls_name, method in ray_private.REPLACE_TOGETHER:
        cls = getattr(importlib.import_module(module), cls_name)
        assert hasattr(cls, method), f"Ray's {module}.{cls_name} no longer has {method} (checked against {ray_private.CHECKED_AGAINST})"
    from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup

    impl = inspect.getsource(WorkerGroup._replace_replica_group_impl)
    assert "rg.is_active()" in impl and "self._replica_groups" in impl, (
        "Ray Train's replica-group replacement no longer skips inactive groups: re-check replace_lost_groups_together")


def test_the_worker_group_shuts_every_other_failing_group_down_before_it_replaces_one(monkeypatch):
    from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup

    seen: list[str] = []

    class Group:
        def __init__(self, i: int) -> None:
            self.i = i

        def shutdown(self) -> None:
            seen.append(f"shutdown {self.i}")

    class Status:
        failing_replica_group_indices = {2, 1}

    class Workers:
        status = Status()

        def get_latest_poll_status(self) -> Status:
            return self.status

        def get_replica_groups(self) -> list[Group]:
            return [Group(0), Group(1), Group(2)]

    monkeypatch.setattr(WorkerGroup, "replace_replica_group", lambda self, i: seen.append(f"replace {i}"))
    ray_private.replace_lost_groups_together()
    ray_private.replace_lost_groups_together()  # idempotent: one wrapper
    workers = Workers()
    WorkerGroup.replace_replica_group(workers, 1)
    assert seen == ["shutdown 2", "replace 1"], "the other lost group is shut down first, the replaced one by Ray"
    WorkerGroup.replace_replica_group(workers, 2)  # the same poll: group 1's replacement is left running
    assert seen == ["shutdown 2", "replace 1", "replace 2"]
