"""The memory tier end to end (checkpoint.memory), through Ray Train and real DeepSpeed engines: a
worker killed between persistent checkpoints resumes from the newest complete in-memory snapshot,
replays fewer steps than the persistent interval, copies no checkpoint from storage, and trains
the undisturbed run's losses; a kill while a snapshot is being handed over, then another, never
resumes from that partial snapshot."""

from __future__ import annotations

import re
import threading

import pytest

import tidal
from tests.conftest import metric_history, tiny_spec
from tests.helpers import kill, kill_a_worker_at, our_processes
from tests.memory_jobs import assert_undisturbed_losses, memory_spec, resumes
from tidal.testing.processes import wait_for
from tidal.testing.runs import StepHolds
from tidal.worker.checkpoint import keeper
from tidal.worker.checkpoint.memory import DELAY_ENV, LOAD_PAUSE_ENV

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]


def test_a_killed_worker_resumes_from_memory_and_reads_no_checkpoint(tmp_path, capfd):
    spec = memory_spec(tmp_path, "mem-kill")
    killed: list[int] = []
    spec, killer = kill_a_worker_at(spec, 13, killed)
    result = tidal.run(spec)
    killer.join(timeout=5)
    out = capfd.readouterr().out

    assert killed and result.error is None, result.error
    (where, step, redo), = resumes(out)
    assert where.startswith("the in-memory snapshot held on node"), out[-3000:]
    assert 12 <= step < 20 and step % 3 == 0, "a snapshot newer than any persistent checkpoint (none before 20)"
    lost = metric_history(spec, result.mlflow_run_id, "max_steps_lost")[40]
    # 0 when the kill lands just after a complete snapshot; one interval more when its snapshot was in flight
    assert lost == redo and 0 <= lost < 2 * 3, f"replayed {lost} step(s): at most a snapshot interval and the one in flight"
    assert not list((tmp_path / "cache").rglob("*.pt")), "a checkpoint file was copied from storage"
    g = result.goodput  # the restore from memory is the account's restore, its replay the replayed steps
    assert g["goodput_restarts"] >= 1 and g["goodput_restore_s"] > 0 and g["goodput_replayed_steps"] == lost
    assert_undisturbed_losses(tmp_path, spec, result)
    assert keeper.named(spec.name) == {}, "the job's keepers outlived it"


def test_a_tier_that_chooses_its_interval_keeps_snapshots_and_a_kill_replays_at_most_one(tmp_path, capfd):
    """`checkpoint.memory: {}` (every_steps auto): the group snapshots at its first steps to measure
    the cost, then at the Young/Daly interval (at most the checkpoint interval, 20 here); a worker
    killed after step 13 resumes from memory, replays at most one interval, and reads no checkpoint."""
    spec = memory_spec(tmp_path, "mem-auto").with_overrides({"checkpoint.memory": {}})
    assert spec.checkpoint.memory.every_steps == "auto"
    killed: list[int] = []
    spec, killer = kill_a_worker_at(spec, 13, killed)
    result = tidal.run(spec)
    killer.join(timeout=5)
    out = capfd.readouterr().out

    assert killed and result.error is None, result.error
    chosen = [int(n) for n in re.findall(r"memory snapshots every (\d+) step\(s\), chosen", out)]
    assert chosen and all(1 <= n <= 20 for n in chosen), out[-3000:]
    (where, step, redo), = resumes(out)
    assert where.startswith("the in-memory snapshot held on node"), out[-3000:]
    assert 1 <= step <= 13 and redo <= max(chosen), f"replayed {redo} step(s) with snapshots every {chosen}"
    assert not list((tmp_path / "cache").rglob("*.pt")), "a checkpoint file was copied from storage"
    assert_undisturbed_losses(tmp_path, spec, result)


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): the completeness rule is unit-tested (test_memory_tier)
def test_a_kill_during_a_snapshot_then_another_never_resumes_from_the_partial_one(tmp_path, capfd):
    """Rank 1's hand-over of step 12 waits 6 s: rank 0's shard of 12 is held, rank 1's not, when a
    worker is killed; the next attempt must resume from 9, and so must the one after the second kill
    (which lands in the same place: step 12 is retried with the same pause)."""
    spec = memory_spec(tmp_path, "mem-partial", **{DELAY_ENV: "6@1:12"})
    killed: list[int] = []

    def partial_12(seen: set[str]) -> str | None:
        """An attempt whose rank 0 handed step 12 over and whose rank 1 has not: mid-snapshot."""
        import ray

        shards = [e for k in keeper.named(spec.name).values() for e in ray.get(k.listing.remote()) if e["step"] == 12]
        ranks: dict[str, set[int]] = {}
        for e in shards:
            ranks.setdefault(e["attempt"], set()).add(e["rank"])
        return next((a for a, r in ranks.items() if a not in seen and r == {0}), None)

    def twice() -> None:
        seen: set[str] = set()
        for _ in range(2):
            attempt = wait_for("a snapshot of step 12 half handed over", lambda: partial_12(seen), 300, every=0.1)
            seen.add(attempt)
            workers = our_processes("RayTrainWorker")
            killed.append(workers[-1].pid)
            kill(workers[-1])

    killer = threading.Thread(target=twice, daemon=True)
    killer.start()
    result = tidal.run(spec)
    killer.join(timeout=5)
    out = capfd.readouterr().out

    assert len(killed) == 2 and result.error is None, result.error
    got = resumes(out)
    assert [s for _, s, _ in got] == [9, 9], got
    assert all(w.startswith("the in-memory snapshot") for w, _, _ in got), got
    assert not list((tmp_path / "cache").rglob("*.pt")), "a checkpoint file was copied from storage"
    assert_undisturbed_losses(tmp_path, spec, result)


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): the resume decision's table is unit-tested (test_memory_tier)
def test_the_keepers_killed_then_a_worker_falls_back_to_storage(tmp_path, capfd):
    """The memory tier's processes die (every keeper of the job, after the checkpoint of step 20):
    the next snapshots are not kept (said once), and a worker killed afterwards resumes from storage's
    checkpoint 20, nothing lost and nothing trained twice in MLflow."""
    import ray

    holds = StepHolds(22, 32)
    spec = holds.spec(memory_spec(tmp_path, "mem-keepers"))
    killed: list[int] = []

    def chaos() -> None:
        holds.wait(22)
        for actor in keeper.named(spec.name).values():
            ray.kill(actor, no_restart=True)
        holds.release(22)
        # past the snapshot of 30: the first snapshot after the kill (24) is not kept, and the next one
        # (27) finds that and says so
        holds.wait(32)
        workers = our_processes("RayTrainWorker")
        killed.append(workers[-1].pid)
        kill(workers[-1])
        holds.release(32)

    t = threading.Thread(target=chaos, daemon=True)
    t.start()
    result = tidal.run(spec)
    t.join(timeout=5)
    out = capfd.readouterr().out

    assert killed and result.error is None, result.error
    (where, step, _), = resumes(out)
    assert where == "checkpoint_000000020" and step == 20, out[-3000:]
    assert "a memory snapshot was not kept (this node's keeper failed" in out
    assert_undisturbed_losses(tmp_path, spec, result)


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): the killed-worker test checks the losses a restore from memory gives
def test_a_snapshot_holds_exactly_what_the_checkpoint_of_its_step_holds(tmp_path):
    """Snapshot and persistent checkpoint at the same step (6): every file a keeper holds for it,
    rebuilt from its block and record, equals the file of that name in storage, tensor for tensor, all but the attempt id
    (each tier names its own). A restore from memory thus loads the checkpoint's very state."""
    import numpy as np
    import ray
    import torch

    from tests.slow_step import slow_env
    from tidal.storage import RunDir, check_complete, checkpoint_dir_name
    from tidal.testing.processes import wait_for
    from tidal.worker.checkpoint import flat_state
    from tidal.worker.checkpoint.safe_load import safe_load

    spec = tiny_spec(tmp_path, name="mem-same", **{"train.steps": 24, "checkpoint.every_steps": 6,
                                                    "checkpoint.memory.every_steps": 6,
                                                    "train.step_fn": "tests.slow_step:step"},
                     worker_env=slow_env(0.05))
    run = RunDir(spec.checkpoint.storage, spec.name)
    held: dict[int, dict[str, object]] = {}

    def grab() -> None:
        ckpt = f"{run.path}/{checkpoint_dir_name(6)}"
        wait_for("checkpoint 6", lambda: run.fs.get_file_info(ckpt).type.name == "Directory"
                 and check_complete(run.fs, ckpt)[0] is None, 240, every=0.1)

        def shards() -> bool:
            for k in keeper.named(spec.name).values():
                for e in ray.get(k.listing.remote()):
                    if e["step"] == 6 and e["rank"] not in held:
                        record, [ref] = ray.get(k.get.remote(e["attempt"], 6, e["rank"], list(e["sizes"])))
                        block = torch.from_numpy(np.array(ray.get(ref)))
                        held[e["rank"]] = {n: flat_state.read(record, n, block, base=record["base"]) for n in e["sizes"]}
            return len(held) == 2

        wait_for("both ranks' snapshots of step 6", shards, 120, every=0.05)

    t = threading.Thread(target=grab, daemon=True)
    t.start()
    result = tidal.run(spec)
    t.join(timeout=5)
    assert result.error is None and len(held) == 2, (result.error, sorted(held))

    def same(a, b, path="") -> None:
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
        elif isinstance(a, dict):
            assert set(a) == set(b), path
            for k in a:
                if not (path.endswith("/tidal") and k == "attempt"):
                    same(a[k], b[k], f"{path}/{k}")
        elif isinstance(a, (list, tuple)):
            assert len(a) == len(b), path
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                same(x, y, f"{path}/{i}")
        elif hasattr(a, "__dict__") and not isinstance(a, type):  # DeepSpeed's loss scaler: no __eq__
            assert type(a) is type(b), path
            same(vars(a), vars(b), f"{path}:{type(a).__name__}")
        else:
            assert a == b or (a != a and b != b), (path, a, b)  # NaN == NaN here

    folder = tmp_path / "runs" / spec.name / checkpoint_dir_name(6) / "global_step6"
    compared = 0
    for files in held.values():
        for name, state in files.items():
            same(state, safe_load(str(folder / name)), name)
            compared += 1
    assert compared == 3, "the model states and both ranks' optimizer partitions"


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): a combination of the faults the slow tests run alone
def test_a_worker_killed_inside_a_restore_from_memory_restores_again(tmp_path, capfd):
    """A worker killed at step 13 resumes from memory; a worker killed while that restore is under way
    (one rank pauses in it) leaves the snapshot where it was: the next attempt restores it again."""
    marker = tmp_path / "restoring"
    holds = StepHolds(13)
    spec = holds.spec(memory_spec(tmp_path, "mem-restore-kill", **{LOAD_PAUSE_ENV: f"{marker}@8"}))
    killed: list[int] = []

    def twice() -> None:
        holds.wait(13)
        first = our_processes("RayTrainWorker")
        killed.append(first[-1].pid)
        kill(first[-1])
        holds.release(13)
        wait_for("a rank inside the restore from memory", marker.exists, 240, every=0.05)
        workers = [p for p in our_processes("RayTrainWorker") if p.pid not in {w.pid for w in first}]
        killed.append(workers[-1].pid)
        kill(workers[-1])

    t = threading.Thread(target=twice, daemon=True)
    t.start()
    result = tidal.run(spec)
    t.join(timeout=5)
    out = capfd.readouterr().out

    assert len(killed) == 2 and result.error is None, result.error
    got = resumes(out)
    assert got and all(w.startswith("the in-memory snapshot") for w, _, _ in got), out[-3000:]
    assert len({s for _, s, _ in got}) == 1, f"the interrupted restore's snapshot is restored again: {got}"
    assert metric_history(spec, result.mlflow_run_id, "restarts")[40] >= 2, "both kills restarted the group"
    assert not list((tmp_path / "cache").rglob("*.pt")), "a checkpoint file was copied from storage"
    assert_undisturbed_losses(tmp_path, spec, result)
