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
