"""A console a person can read: Tidal's own lines, and none of the known-harmless library chatter
(tracking/quiet.py), unless TIDAL_DEBUG=1 asks for everything."""

from __future__ import annotations

import logging
import os
import re
import warnings

import pytest

from tests.conftest import ROOT
from tests.helpers import short_run_problems, tidal_cli
from tidal.ray_private import AUTH_TOKEN_SETUP_LOGGER, TRAIN_USER_ERROR_LOGGER
from tidal.tracking.quiet import quiet_libraries, skip_known_ray_errors


def logger_says(name: str, message: str) -> list[str]:
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger = logging.getLogger(name)
    handler = Keep()
    logger.addHandler(handler)
    try:
        logger.warning(message)
    finally:
        logger.removeHandler(handler)
    return seen


def deepspeed_says(message: str) -> list[str]:
    return logger_says("DeepSpeed", message)


def test_known_chatter_is_dropped_and_tidal_debug_keeps_it(monkeypatch):
    monkeypatch.setenv("TIDAL_DEBUG", "1")
    logging.getLogger("DeepSpeed").filters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_libraries()
        warnings.warn("Detected call of `lr_scheduler.step()` before `optimizer.step()`. ...", UserWarning, stacklevel=1)
    assert deepspeed_says("Setting accelerator to CPU. If you have GPU ...") and len(caught) == 1

    monkeypatch.delenv("TIDAL_DEBUG")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_libraries()
        warnings.warn("Detected call of `lr_scheduler.step()` before `optimizer.step()`. ...", UserWarning, stacklevel=1)
        # ZeRO-3, every step on every rank, behind Ray's worker prefix
        warnings.warn("`torch.distributed.reduce_scatter_tensor` is deprecated. Please use "
                      "`torch.distributed.reduce_scatter_single` instead.", FutureWarning, stacklevel=1)
        warnings.warn("a real warning", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["a real warning"]
    # each worker's "Found credentials in environment variables." on S3, where Ray's root logger is at INFO
    monkeypatch.setattr(logging.getLogger(), "level", logging.INFO)
    logging.getLogger("botocore.credentials").manager._clear_cache()
    assert not logging.getLogger("botocore.credentials").isEnabledFor(logging.INFO)
    assert logging.getLogger("botocore.credentials").isEnabledFor(logging.WARNING)
    assert deepspeed_says("Setting accelerator to CPU. If you have GPU ...") == []
    assert deepspeed_says("a real DeepSpeed warning") == ["a real DeepSpeed warning"]
    logging.getLogger("DeepSpeed").filters.clear()


def test_rays_token_auth_notice_is_dropped_and_its_other_lines_kept(monkeypatch):
    """A local instance Tidal starts keeps Ray's token auth (on by default since 2.60); Ray's notice
    that it is on advises setting RAY_AUTH_MODE=disabled, which Tidal's clusters refuse."""
    notice = ("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out. "
              "For more information, see https://docs.ray.io/en/latest/ray-security/token-auth.html")
    off = "Token authentication is disabled for this Ray cluster. Anyone with network access ..."
    monkeypatch.setenv("TIDAL_DEBUG", "1")
    logging.getLogger(AUTH_TOKEN_SETUP_LOGGER).filters.clear()
    skip_known_ray_errors()
    assert logger_says(AUTH_TOKEN_SETUP_LOGGER, notice) == [notice]
    monkeypatch.delenv("TIDAL_DEBUG")
    skip_known_ray_errors()
    assert logger_says(AUTH_TOKEN_SETUP_LOGGER, notice) == []
    assert logger_says(AUTH_TOKEN_SETUP_LOGGER, off) == [off], "a cluster without auth is a real warning"
    logging.getLogger(AUTH_TOKEN_SETUP_LOGGER).filters.clear()


def ray_train_error(*frames_and_error: str) -> str:
    """Ray Train's record in the worker whose training function raised (ray.train.v2._internal.util)."""
    return "Error in training function:\nTraceback (most recent call last):\n" + "\n".join(frames_and_error) + "\n"


PEER_GONE = [  # gloo's words on the rank that survived, in torch 2.13 (Read and Write take strerror's)
    "RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:38029",
    "RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:598] Read error [127.0.0.1]:4021: Connection reset by peer",
]


@pytest.mark.parametrize("error", PEER_GONE)
def test_a_ranks_traceback_for_a_peer_that_went_is_dropped_and_any_other_kept(monkeypatch, error):
    """When a node goes, the rank that survived fails in its collective: Tidal's line names it with this
    error's last line, and its traceback (torch's and DeepSpeed's insides) is noise. A user's error
    keeps its traceback, and TIDAL_DEBUG=1 keeps both."""
    frames = ('  File "/venv/deepspeed/runtime/zero/stage_1_and_2.py", line 1123, in reduce_ipg_grads',
              "    dist.all_reduce(tensor)")
    peer, mine = ray_train_error(*frames, error), ray_train_error('  File "model.py", line 3', "ValueError: bad head")
    logging.getLogger(TRAIN_USER_ERROR_LOGGER).filters.clear()
    monkeypatch.setenv("TIDAL_DEBUG", "1")
    quiet_libraries()
    assert logger_says(TRAIN_USER_ERROR_LOGGER, peer) == [peer]
    monkeypatch.delenv("TIDAL_DEBUG")
    quiet_libraries()
    assert logger_says(TRAIN_USER_ERROR_LOGGER, peer) == []
    assert logger_says(TRAIN_USER_ERROR_LOGGER, mine) == [mine]
    logging.getLogger(TRAIN_USER_ERROR_LOGGER).filters.clear()


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): the same checks run on test_cli_e2e's first run
def test_a_short_run_prints_tidal_lines_and_no_library_chatter(tmp_path, monkeypatch):
    # its own local instance: a cluster another job started on this machine may end mid-run
    monkeypatch.setenv("RAY_ADDRESS", "local")
    # what a user sees: Ray's log deduplication on (its default; conftest turns it off for other tests),
    # which is also where Ray applies RAY_DEDUP_LOGS_SKIP_REGEX
    monkeypatch.delenv("RAY_DEDUP_LOGS", raising=False)
    proc = tidal_cli("run", str(ROOT / "jobs/quickstart.yaml"), "--set", "train.steps=20", "--set", "model.d_model=64",
                     "--set", "model.n_head=2", "--set", "checkpoint.every_steps=10",
                     "--set", f"checkpoint.storage={tmp_path / 'runs'}",
                     "--set", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", cwd=tmp_path, timeout=540)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert not short_run_problems(out), "\n".join(short_run_problems(out))
    lines = out.splitlines()
    assert len([line for line in lines if "[tidal] step " in line]) == 2, "one line per log interval (10 steps)"
    assert len([line for line in lines if "[tidal] checkpoint at step " in line]) == 2
    assert "[tidal] job 'quickstart' finished" in proc.stdout
    assert "starting a local Ray instance (without its dashboard; TIDAL_RAY_DASHBOARD=1 starts it)" in proc.stdout


def test_the_tracker_holds_its_tidal_lines_for_the_driver_and_passes_the_rest_on():
    """Ray prefixes an actor's stdout with `(TrackerActor pid=...)`: Tidal's lines are held for the
    driver to print plainly; anything else (a library's error) keeps Ray's forwarding and its origin."""
    import io

    from tidal.tracking.console import HeldLines

    real = io.StringIO()
    out = HeldLines(real)
    print("[tidal] step 10/20 | loss 3.0", file=out)
    out.write("Traceback: a real error\n[tidal] checkpoint at")
    assert out.take() == ["[tidal] step 10/20 | loss 3.0"], "a line is held only once it is complete"
    out.write(" step 10\n")
    assert out.take() == ["[tidal] checkpoint at step 10"] and out.take() == []
    assert real.getvalue() == "Traceback: a real error\n"


def test_held_lines_are_bounded_when_nobody_asks():
    import io

    from tidal.tracking.console import HeldLines

    out = HeldLines(io.StringIO(), keep=3)
    for i in range(5):
        print(f"[tidal] line {i}", file=out)
    assert out.take() == ["[tidal] line 2", "[tidal] line 3", "[tidal] line 4"]


@pytest.mark.parametrize("current, expected", [
    (None, "PreemptionWatcher.*constructor arguments"),
    ("", "PreemptionWatcher.*constructor arguments"),
    ("PreemptionWatcher.*constructor arguments", "PreemptionWatcher.*constructor arguments"),
    ("my noise", "(?:my noise)|(?:PreemptionWatcher.*constructor arguments)"),
])
def test_ray_skip_regex_keeps_a_users_pattern(current, expected):
    from tidal.tracking.quiet import ray_skip_regex

    assert ray_skip_regex(current) == expected


def test_the_skip_pattern_drops_only_the_known_harmless_error_line():
    from tidal.tracking.quiet import KNOWN_RAY_ERRORS

    harmless = ("[2026-11-25 15:01:02,345 E 1234 1234] core_worker.cc:512: PreemptionWatcher was given "
                "unexpected constructor arguments (ray#53727)")
    assert re.search(KNOWN_RAY_ERRORS, harmless)
    for real in ("[2026-11-25 15:01:02,345 E 1234 1234] core_worker.cc:88: Failed to connect to GCS",
                 "E PreemptionWatcher: node drained, deadline in 30s"):
        assert not re.search(KNOWN_RAY_ERRORS, real), real


@pytest.mark.parametrize("current, expected", [
    (None, "10.0.0.1:6379"), ("", "10.0.0.1:6379"), ("local", "10.0.0.1:6379"), ("auto", "10.0.0.1:6379"),
    ("head:6379", "head:6379"),
])
def test_a_worker_names_its_own_cluster_for_the_state_api(current, expected):
    """`RAY_ADDRESS=local tidal run` with another Ray instance on the machine: the cleaner searched the
    machine, found several and stopped watching ("Found multiple active Ray instances")."""
    from tidal.tracking.quiet import own_cluster

    assert own_cluster(current, "10.0.0.1:6379") == expected


def test_tidal_debug_keeps_rays_error_line_and_a_users_pattern_is_kept(monkeypatch):
    from tidal.tracking.quiet import SKIP_ENV, skip_known_ray_errors

    monkeypatch.setenv("TIDAL_DEBUG", "1")
    monkeypatch.delenv(SKIP_ENV, raising=False)
    skip_known_ray_errors()
    assert SKIP_ENV not in os.environ, "TIDAL_DEBUG=1 shows everything Ray prints"
    monkeypatch.delenv("TIDAL_DEBUG")
    monkeypatch.setenv(SKIP_ENV, "my noise")
    skip_known_ray_errors()
    assert os.environ[SKIP_ENV] == "(?:my noise)|(?:PreemptionWatcher.*constructor arguments)"
