"""A streamed job resized 2 -> 1 -> 2 workers, with Ray Data cutting the source into other blocks
at every launch, trains every window once, in the same global batches and to the same losses as a
run left alone, its ZeRO-2 state resized by byte range (no conversion: the suite's ZeRO-1/2 resize of
a whole job, tests/test_reshard.py's claim); and a streamed job with the default CPUs per worker runs
on a 2-CPU machine."""

from __future__ import annotations

import shutil

import pytest

import tidal
from tests.conftest import ROOT, metric_history, tiny_spec
from tests.golden import reference_losses, reference_record
from tests.stream_probe import DOCS, STEPS, step_batches, streamed, write_docs
from tidal.spec import load_spec
from tidal.testing.runs import prepared_store

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]


def workers(n: int) -> dict[str, int]:
    return {"scaling.min_workers": n, "scaling.max_workers": n}


def block_size(max_bytes: int) -> None:
    """How Ray Data cuts the source's blocks in this driver (what a Ray upgrade or another read
    heuristic could change between two launches of one job)."""
    import ray.data

    ray.data.DataContext.get_current().target_max_block_size = max_bytes


def test_a_streamed_job_resized_2_1_2_trains_the_windows_of_an_undisturbed_run(tmp_path):
    """Against the undisturbed run's stored windows and losses (`python -m tests.golden stream-undisturbed`)."""
    common = streamed(write_docs(tmp_path))
    steady = tiny_spec(tmp_path, name="steady", **common, worker_env={"TIDAL_TEST_WINDOWS": str(tmp_path / "steady")})
    expected = reference_losses("stream-undisturbed", steady, tmp_path)
    want = {int(step): windows for step, windows in reference_record("stream-undisturbed", "windows").items()}
    original = __import__("ray.data").data.DataContext.get_current().target_max_block_size
    try:
        # One job, three launches, each with Ray Data's blocks cut anew (the shard index is rebuilt
        # for the second: it must come out the same).
        got_batches: dict[int, list[str]] = {}
        for n, (first, last), max_bytes in ((2, (1, 8), 256), (1, (9, 16), 1 << 10), (2, (17, STEPS), 64 << 20)):
            block_size(max_bytes)
            if n == 1:
                shutil.rmtree(tmp_path / "runs" / "resized" / "tidal-stream", ignore_errors=True)
            record = tmp_path / f"resized-{first}"
            spec = tiny_spec(tmp_path, name="resized", **common, **workers(n), **{"train.stop_at": last},
                             worker_env={"TIDAL_TEST_WINDOWS": str(record)})
            result = tidal.run(spec)
            got_batches |= step_batches(record, n, first, last)
    finally:
        block_size(original)

    world = metric_history(spec, result.mlflow_run_id, "world_size")
    assert [world[s] for s in (8, 9, 16, 17, STEPS)] == [2, 1, 1, 2, 2]
    for step in range(1, STEPS + 1):
        assert got_batches[step] == want[step], f"step {step} trained other windows than the undisturbed run"
    trained = [w for s in range(1, STEPS) for w in got_batches[s]]  # steps 1-19: the first epoch
    assert len(trained) == len(set(trained)) == 19 * 16, "a window was trained twice in one epoch"
    got = metric_history(spec, result.mlflow_run_id, "loss")
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):  # the model and optimizer state through both resizes too
        assert got[step] == pytest.approx(expected[step], rel=1e-4), step
    # ZeRO-1/2 resize by byte range (tidal.worker.checkpoint.repartition): no universal conversion is made
    assert spec.parallelism.zero_stage == 2
    assert not list((tmp_path / "runs" / "resized").glob("checkpoint_*/global_step*_universal*"))


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): one CPU per worker
def test_the_quickstart_streamed_with_one_cpu_per_worker_runs_on_two_cpus(tmp_path, capfd, monkeypatch):
    """Its two workers take both CPUs of this machine; Ray Data reads before they start, and its
    progress bars and log lines stay out of output that is not a terminal."""
    monkeypatch.delenv("TIDAL_DEBUG", raising=False)
    source = tmp_path / "docs.txt"
    source.write_text("".join(d + "\n" for d in DOCS * 4))
    spec = load_spec(ROOT / "jobs" / "quickstart.yaml").with_overrides({
        "data.source": str(source), "data.streaming": True, "train.steps": 4, "train.log_every": 1,
        "checkpoint.storage": str(tmp_path / "runs"), "tracking.uri": prepared_store(tmp_path / "mlflow.db")})
    assert spec.scaling.cpus_per_worker == 1 and spec.scaling.max_workers == 2
    loss = metric_history(spec, tidal.run(spec).mlflow_run_id, "loss")
    assert sorted(loss) == [1, 2, 3, 4]
    out = capfd.readouterr()
    assert "tokenizing" in out.out
    for noise in ("Progress bars", "Starting execution of Dataset", "%|"):
        assert noise not in out.out + out.err, noise
