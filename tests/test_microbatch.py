"""`train.micro_batch: auto`: the decisions alone, then real jobs with an injected memory limit."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from mlflow.tracking import MlflowClient

import tidal
from tests.conftest import free_port, metric_history, tiny_spec
from tests.golden import reference_losses
from tidal.errors import SpecError
from tidal.spec.batch import halved, largest_fitting, micro_batch_bound, micro_batch_candidates
from tidal.spec.deepspeed import ds_config
from tidal.spec.job import JobSpec
from tidal.tracking.findings import MICRO_BATCH_HALVED_TAG, MICRO_BATCH_TAG
from tidal.worker.microbatch import resolve


def test_candidates_keep_the_global_batch_at_every_world_size():
    assert micro_batch_candidates(16, 2, 2) == [1, 2, 4, 8]
    assert micro_batch_candidates(24, 2, 3) == [1, 2, 4], "24 / (m x 2) and 24 / (m x 3) both whole"
    assert micro_batch_candidates(7, 2, 2) == []


def test_the_search_finds_the_largest_that_fits_in_few_tries():
    sizes = list(range(1, 65))
    for limit in (1, 5, 33, 63, 64):
        tried: list[int] = []

        def fits(m: int, limit: int = limit, tried: list[int] = tried) -> bool:
            tried.append(m)
            return m <= limit

        assert largest_fitting(sizes, fits) == limit
        assert len(tried) <= 7, tried  # the largest first, then a binary search of the other 63
    assert largest_fitting([1, 2, 4], lambda m: False) is None
    assert largest_fitting([1, 2, 4, 8], lambda m: True) == 8


def test_an_out_of_memory_error_halves_to_an_allowed_size():
    assert halved([1, 2, 4, 8], 8) == 4
    assert halved([1, 2, 3, 6], 6) == 3
    assert halved([1, 2, 4, 8], 1) is None


def test_auto_is_a_spec_value_and_the_drivers_deepspeed_config_shows_its_bound():
    spec = JobSpec(name="a", train={"micro_batch": "auto", "global_batch": 24},
                   scaling={"min_workers": 2, "max_workers": 3})
    assert micro_batch_bound(spec) == 4
    assert ds_config(spec, 3, on_gpu=False)["train_micro_batch_size_per_gpu"] == 4
    with pytest.raises(SpecError, match="train.micro_batch"):
        JobSpec(name="a", train={"micro_batch": "auto"}, parallelism={"pipeline_stages": 2, "zero_stage": 1},
                scaling={"min_workers": 2, "max_workers": 2})


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A real one-process gloo group: the search's agreement is a collective."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.usefixtures("one_rank")
def test_the_search_tries_real_steps_records_its_choice_and_a_resume_keeps_it(tmp_path):
    spec = tiny_spec(tmp_path, **{"train.micro_batch": "auto", "train.global_batch": 64})
    tried, said = [], []

    def try_step(s: JobSpec) -> None:
        tried.append(s.train.micro_batch)
        if s.train.micro_batch > 5:
            raise torch.OutOfMemoryError("injected")

    chosen, searched = resolve(spec, 0, 2, try_step, said.append)
    assert (chosen.train.micro_batch, searched) == (4, True) and tried == [32, 4, 8], tried
    assert "train.micro_batch auto: 4 (the largest of [1, 2, 4, 8, 16, 32] that fits" in said[0]
    assert "8 accumulation step(s) at 2 worker(s)" in said[0], said[0]
    again, searched = resolve(spec, 0, 2, try_step, said.append)
    assert (again.train.micro_batch, searched, len(tried)) == (4, False, 3), "the record, no new search"
    assert said[-1] == "train.micro_batch auto: 4, as this job chose before"
    fixed = spec.with_overrides({"train.micro_batch": 8})
    assert resolve(fixed, 0, 2, try_step, said.append) == (fixed, False)


def _auto_spec(tmp_path, name: str, **over):
    return tiny_spec(tmp_path, name=name, **{
        "model.builder": "tests.oom_model:build", "train.micro_batch": "auto", "train.steps": 8,
        "train.log_every": 1, "checkpoint.every_steps": 4, **over})


def _losses(spec, run_id: str) -> dict[int, float]:
    return metric_history(spec, run_id, "loss")


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): the search's steps are unit-tested; the OOM test below runs auto end to end
@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_auto_picks_the_largest_micro_batch_under_the_memory_limit_and_keeps_it(tmp_path, capfd):
    spec = _auto_spec(tmp_path, "auto-mb", **{"train.steps": 4, "worker_env": {"TIDAL_TEST_MEM_LIMIT": "3"}})
    first = tidal.run(spec)
    out = capfd.readouterr().out
    line = next(ln for ln in out.splitlines() if "train.micro_batch auto:" in ln)
    assert line.startswith("[tidal] train.micro_batch auto: 2 (the largest of [1, 2, 4, 8] that fits"), line
    assert "4 out of memory" in line and "8 out of memory" in line and "2 fits" in line, line
    assert set(metric_history(spec, first.mlflow_run_id, "micro_batch").values()) == {2.0}
    assert MlflowClient(spec.tracking.uri).get_run(first.mlflow_run_id).data.tags[MICRO_BATCH_TAG] == "auto: 2"

    # The job again, longer: it resumes at the size it chose, without searching.
    again = tidal.run(spec.with_overrides({"train.steps": 6}))
    out = capfd.readouterr().out
    assert "train.micro_batch auto: 2, as this job chose before" in out, out[-3000:]
    assert "that fits" not in out
    assert sorted(metric_history(spec, again.mlflow_run_id, "micro_batch")) == list(range(1, 7))


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_an_out_of_memory_error_mid_run_halves_the_micro_batch_and_the_losses_stay(tmp_path, capfd):
    # 8 fits until the 5th forward of the job's model (step 5 at one micro-batch of 8 per step).
    env = {"TIDAL_TEST_MEM_LIMIT": "8", "TIDAL_TEST_MEM_LIMIT_LATER": "4", "TIDAL_TEST_MEM_LATER_FROM": "4"}
    auto = _auto_spec(tmp_path, "auto-oom", **{"worker_env": env})
    result = tidal.run(auto)
    out = capfd.readouterr().out
    assert "train.micro_batch auto: 8 (" in out, out[-3000:]
    line = next(ln for ln in out.splitlines() if "out of memory at step" in ln)
    assert "out of memory at step 5 with train.micro_batch 8: training the step again at 4 with 2 accumulation" in line
    mb = metric_history(auto, result.mlflow_run_id, "micro_batch")
    assert mb == {1: 8, 2: 8, 3: 8, 4: 8, 5: 4, 6: 4, 7: 4, 8: 4}, mb
    assert MlflowClient(auto.tracking.uri).get_run(result.mlflow_run_id).data.tags[MICRO_BATCH_HALVED_TAG] == (
        "to 4 after an out-of-memory error at step 5")

    fixed = tiny_spec(tmp_path, name="fixed-4", **{
        "model.builder": "tests.oom_model:build", "train.micro_batch": 4, "train.steps": 8, "train.log_every": 1,
        "checkpoint.every_steps": 4})
    reference = reference_losses("microbatch-fixed-4", fixed)  # stored (tests/golden.py regenerates it)
    got = _losses(auto, result.mlflow_run_id)
    assert sorted(got) == list(range(1, 9)), "every step logged once"
    # The same global batches: equal up to the order the micro-batches' gradients were summed in
    # (and to a stored curve's drift between machines: tests/golden.py).
    assert got == pytest.approx(reference, rel=1e-4, abs=1e-6)
