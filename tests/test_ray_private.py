"""Every private Ray name Tidal reaches (tidal/ray_private.py) still exists in the installed Ray:
an upgrade that moves or renames one fails here, naming it, instead of breaking a job silently."""

from __future__ import annotations

import importlib
import inspect

import pytest

from tidal import ray_private


@pytest.mark.parametrize("module, name", ray_private.PRIVATE_NAMES, ids=lambda v: str(v))
def test_each_private_name_is_still_there(module, name):
    try:
        found = importlib.import_module(module)
    except ImportError as e:
        pytest.fail(f"Ray no longer has {module} ({e}); tidal/ray_private.py was checked against Ray "
                    f"{ray_private.CHECKED_AGAINST}: find its replacement there")
    assert hasattr(found, name), (f"Ray's {module} no longer has {name}; tidal/ray_private.py was checked "
                                  f"against Ray {ray_private.CHECKED_AGAINST}")


def test_the_names_given_as_text_match_rays():
    from ray.train.v2._internal import constants

    assert ray_private.HEALTH_CHECK_INTERVAL == constants.HEALTH_CHECK_INTERVAL_S_ENV_VAR
    assert ray_private.WORKER_GROUP_START_TIMEOUT == constants.WORKER_GROUP_START_TIMEOUT_S_ENV_VAR
    from ray._common.constants import HEAD_NODE_RESOURCE_NAME

    assert ray_private.HEAD_RESOURCE == HEAD_NODE_RESOURCE_NAME
    module, _, cls = ray_private.FAKE_PROVIDER_MODULE.rpartition(".")
    assert hasattr(importlib.import_module(module), cls), ray_private.FAKE_PROVIDER_MODULE
    for logger_module in (ray_private.TRAIN_CONTEXT_MODULE, ray_private.PLACEMENT_GROUP_CLEANER_LOGGER,
                          ray_private.TRAIN_CONTROLLER_LOGGER):
        assert importlib.util.find_spec(logger_module) is not None, logger_module
    exceptions = importlib.import_module("ray.train.v2._internal.exceptions")
    assert hasattr(exceptions, ray_private.START_TIMEOUT_ERROR)


def test_the_calls_match_rays_signatures():
    """The adapter calls these with keywords or argument counts Ray could change."""
    from ray._private.runtime_env.packaging import _dir_travel
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        _AutoscalingCoordinatorActor,
    )

    assert "include_gitignore" in inspect.signature(_dir_travel).parameters
    actor_cls = getattr(_AutoscalingCoordinatorActor, "__ray_actor_class__", _AutoscalingCoordinatorActor)
    assert "recompute" in inspect.signature(actor_cls.get_reserved_resources).parameters


def test_the_walk_and_cap_work_on_a_folder(tmp_path):
    (tmp_path / "keep.txt").write_text("x" * 10)
    (tmp_path / "skip.bin").write_text("y")
    seen = []
    ray_private.walk_working_dir(tmp_path, ["skip.bin"], lambda p: seen.append(p.name))
    assert "keep.txt" in seen and "skip.bin" not in seen
    assert ray_private.working_dir_upload_cap() >= 100 * 1024 * 1024


def test_the_train_requester_id_is_rays():
    """Ray's elastic policy asks the coordinator as `train-<run id>` (Tidal releases a killed
    launch's reservation by that name, tidal/launch/trainer.py): fails when Ray names it otherwise."""
    import inspect

    from ray.train.v2._internal.execution.scaling_policy.scaling_policy import ScalingPolicy

    assert 'f"train-{train_run_context.run_id}"' in inspect.getsource(ScalingPolicy.after_controller_start)

    class Trainer:  # what DataParallelTrainer carries
        class train_run_context:  # noqa: N801
            run_id = "abc"

    assert ray_private.train_requester(Trainer()) == "train-abc"
    assert ray_private.train_requester(object()) is None


def test_rays_replica_group_hook_is_where_tidal_uses_it():
    """Replacing one lost rank in place (issue 75) rests on one Backend attribute that Ray Train's
    controller and worker group read, and on the two methods that replace a replica group: fails,
    naming what moved, when an upgrade renames or stops reading any of them."""
    from ray.train.backend import Backend

    hook = ray_private.REPLICA_GROUP_HOOK
    assert hasattr(Backend, hook), f"ray.train.backend.Backend no longer has {hook!r}"
    for module, cls_name, method in ray_private.REPLICA_GROUP_CALLS:
        cls = getattr(importlib.import_module(module), cls_name)
        assert hasattr(cls, method), (f"Ray's {module}.{cls_name} no longer has {method}: Ray Train replaces a "
                                      f"failed replica group another way now (checked against "
                                      f"{ray_private.CHECKED_AGAINST})")
        source = inspect.getsource(cls)
        assert f"backend_cls.{hook}" in source, (f"Ray's {module}.{cls_name} no longer reads Backend.{hook}: "
                                                 "a Backend setting it would restart the whole group")
    controller = importlib.import_module(ray_private.REPLICA_GROUP_CALLS[0][0])
    assert "self._replace_bad_workers(" in inspect.getsource(controller.TrainController), (
        "Ray Train's controller no longer calls _replace_bad_workers on a failure")


def test_rays_prestart_workers_rpc_and_channel_are_where_tidal_uses_them():
    """Warm spares (tidal/launch/spares.py) call the raylet's PrestartWorkers through the token-aware
    channel: fails, naming what moved, when the RPC, its request's fields or the channel change."""
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import node_manager_pb2, node_manager_pb2_grpc

    fields = node_manager_pb2.PrestartWorkersRequest.DESCRIPTOR.fields_by_name
    missing = [f for f in ray_private.PRESTART_FIELDS if f not in fields]
    assert not missing, f"Ray's PrestartWorkersRequest no longer has {missing} (has {sorted(fields)})"
    assert "serialized_runtime_env" in fields["runtime_env_info"].message_type.fields_by_name
    stub_source = inspect.getsource(node_manager_pb2_grpc.NodeManagerServiceStub)
    assert "/ray.rpc.NodeManagerService/PrestartWorkers" in stub_source, (
        "the raylet's NodeManagerService no longer has PrestartWorkers")
    assert "address" in inspect.signature(init_grpc_channel).parameters, (
        "ray._private.grpc_utils.init_grpc_channel no longer takes an address")
