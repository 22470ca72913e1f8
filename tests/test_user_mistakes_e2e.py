"""A user's mistake fails once, clearly, on real Ray and DeepSpeed: a dataset builder that raises in the
user's own code before the first step ends the job at its first attempt (no restart), and the driver's
error shows the user's frames once, with advice that fits (tests/test_user_mistakes.py: the quick parts)."""

from __future__ import annotations

import pytest

import tidal
from tests.conftest import ONE_WORKER, tiny_spec
from tidal.errors import TidalError

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]


def test_a_builder_that_raises_before_the_first_step_fails_once_with_the_users_frames(tmp_path, capfd):
    probe = tmp_path / "calls"
    spec = tiny_spec(tmp_path, "mistake", **ONE_WORKER, **{
        "data.dataset": "tests.user_mistake:dataset", "data.dataset_args": {"n": 8},
        "worker_env.TIDAL_TEST_PROBE": str(probe), "failure.max_restarts": 2})
    with pytest.raises(TidalError) as e:
        tidal.run(spec)
    message = str(e.value)
    assert message.startswith("job 'mistake' failed before its first step, in your code: data.dataset: "
                              "'tests.user_mistake:dataset' raised ValueError: no samples file for n=8"), message
    frames = [line.strip() for line in message.splitlines() if line.lstrip().startswith("File ")]
    assert [f.split('"')[1].rsplit("/", 1)[-1] for f in frames] == ["user_mistake.py", "user_mistake.py"], message
    assert 'raise ValueError(f"no samples file for n={n}")' in message
    assert message.endswith("Not restarted: a restart runs the same code on the same inputs. Fix data.dataset (or "
                            "the code it names), then run the same command again.")
    assert probe.read_text().splitlines() == ["called"], "one attempt: the same code was not run again"
    console = "".join(capfd.readouterr())
    assert "restart 1" not in console and "worker rank 0 failed" not in console, console
    assert "Error in training function" not in console and "Error in control loop iteration" not in console, console


def test_a_mistake_after_the_first_step_met_again_after_a_restart_ends_the_job(tmp_path, capfd):
    """A bad sample: the first failure is retried from the checkpoint (a restart may cure a failure
    after training began), the same mistake in the attempt after it ends the job: not all 3 restarts."""
    probe = tmp_path / "calls"
    spec = tiny_spec(tmp_path, "bad-sample", **ONE_WORKER, **{
        "train.step_fn": "tests.user_mistake:step", "train.steps": 10, "checkpoint.every_steps": 2,
        "worker_env.TIDAL_TEST_PROBE": str(probe), "worker_env.TIDAL_TEST_BAD_AFTER": "3",
        "failure.max_restarts": 3})
    with pytest.raises(TidalError) as e:
        tidal.run(spec)
    message = str(e.value)
    assert message.startswith("job 'bad-sample' failed the same way in two attempts in a row (the second resumed "
                              "from a checkpoint), in your code: train.step_fn: 'tests.user_mistake:step' raised "
                              "IndexError: sample 7 has no labels"), message
    assert message.endswith("it resumes from its latest checkpoint."), message
    assert probe.read_text().splitlines() == ["bad sample"] * 2, "two attempts, not 1 + max_restarts"
    console = "".join(capfd.readouterr())
    assert "restart 1" in console and "restart 2" not in console, console
    assert "Error in control loop iteration" not in console, console
