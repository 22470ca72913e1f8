"""Ray Train's replica-group hook, driven through tidal/ray_private.py on real Ray: a killed worker
is replaced alone, in the same job, while the other worker's process trains on (the ground issue 75's
in-place replacement stands on). Fails, naming the hook, if an upgrade makes it restart the group."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import psutil
import pytest

from tidal.ray_private import REPLICA_GROUP_HOOK, replica_group_config
from tidal.testing.processes import kill, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]


def _seen(folder: Path, rank: int) -> dict | None:
    path = folder / f"rank{rank}"
    return json.loads(path.read_text()) if path.exists() else None


def test_a_killed_worker_is_replaced_while_the_other_keeps_its_process(tmp_path):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    # defined here: Ray pickles a test module's functions by reference, and workers cannot import it
    def _loop(config: dict) -> None:
        """Each worker counts, writing (pid, count) to its rank's file, until the test's stop file exists."""
        import json
        import os
        import time
        from pathlib import Path

        import ray.train

        rank = ray.train.get_context().get_world_rank()
        folder = Path(config["folder"])
        n = 0
        while not (folder / "stop").exists():
            n += 1
            (folder / f"rank{rank}.tmp").write_text(json.dumps({"pid": os.getpid(), "n": n}))
            os.replace(folder / f"rank{rank}.tmp", folder / f"rank{rank}")
            time.sleep(0.1)

    trainer = TorchTrainer(_loop, train_loop_config={"folder": str(tmp_path)},
                           scaling_config=ScalingConfig(num_workers=2),
                           run_config=RunConfig(name="replica-groups", storage_path=str(tmp_path / "runs"),
                                                failure_config=FailureConfig(max_failures=2)),
                           torch_config=replica_group_config("gloo"))
    errors: list[BaseException] = []

    def fit() -> None:
        try:
            trainer.fit()
        except BaseException as e:  # noqa: BLE001 - said by the test
            errors.append(e)

    runner = threading.Thread(target=fit, daemon=True)
    runner.start()
    before = wait_for("both workers counting", lambda: (_seen(tmp_path, 0), _seen(tmp_path, 1))
                      if _seen(tmp_path, 0) and _seen(tmp_path, 1) else None, 240)
    kill(psutil.Process(before[1]["pid"]))
    after = wait_for("rank 1 replaced", lambda: (s if (s := _seen(tmp_path, 1)) and s["pid"] != before[1]["pid"]
                                                 else None), 240)
    survivor = _seen(tmp_path, 0)
    (tmp_path / "stop").touch()
    runner.join(timeout=120)
    assert not errors, errors
    assert after["pid"] != before[1]["pid"]
    assert survivor["pid"] == before[0]["pid"], (
        f"rank 0's process changed: Ray Train restarted the whole group, not reading Backend.{REPLICA_GROUP_HOOK}")
    assert survivor["n"] > before[0]["n"], "rank 0 kept counting through the replacement"
