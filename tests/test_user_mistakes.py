"""A user's mistake fails once, clearly: each function the spec names is checked against the arguments
the spec gives it before anything starts (`tidal validate` and `tidal run`), and an error the user's
code raises before the first step ends the job without a restart, with the user's own frames. Quick,
no Ray: the end-to-end failure is in tests/test_user_mistakes_e2e.py."""

from __future__ import annotations

import logging
import pickle
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from tests.conftest import tiny_spec
from tests.helpers import tidal_main
from tidal.errors import SpecError, UserCodeError
from tidal.launch.recovery import mistake_message, not_retried
from tidal.spec.user_refs import call_problems, check_calls
from tidal.tracking.quiet import UserMistake
from tidal.worker import user_code

EXAMPLE = Path(__file__).resolve().parents[1] / "jobs" / "mlp-classifier.yaml"


def user_module(where: Path, source: str) -> str:
    """A module of the user's in `where` (a job's working directory), under a name of its own."""
    name = f"mine_{uuid.uuid4().hex[:8]}"
    (where / f"{name}.py").write_text(textwrap.dedent(source))
    return name


def refused(tmp_path: Path, **overrides: object) -> dict[str, str]:
    problems, notes = call_problems(tiny_spec(tmp_path, **overrides), tmp_path)
    assert not notes, notes
    return dict(problems)


# --- the check before anything starts --------------------------------------------------------------
def test_the_issues_dataset_without_arguments_is_refused_naming_field_function_and_fix(tmp_path):
    """jobs/mlp-classifier.yaml with data.dataset pointing at a builder that takes no arguments."""
    mod = user_module(tmp_path, "def dataset():\n    return list(range(10))\n")
    got = refused(tmp_path, **{"data.dataset": f"{mod}:dataset", "data.dataset_args": {"n": 4096, "seed": 0}})
    assert got["data.dataset"] == (
        f"'{mod}:dataset' is dataset(), which Tidal cannot call as dataset(n=..., seed=...) (the keys of "
        "data.dataset_args): got an unexpected keyword argument 'n'; remove n, seed from data.dataset_args, "
        "or add parameters n, seed to dataset()")


@pytest.mark.parametrize(("field", "source", "args", "fix"), [
    ("model.builder", "def build():\n    pass\n", {}, "give build() parameters for them, e.g. def build(model_spec, **kwargs)"),
    ("model.builder", "def build(spec, hidden):\n    pass\n", {}, "give hidden in model.builder_args, or give hidden a "
     "default in build()"),
    ("model.builder", "def build(spec):\n    pass\n", {"spec": 1}, "model.builder_args sets spec, which build() takes "
     "as its model_spec: rename one of them"),
    ("train.step_fn", "def build(model):\n    pass\n", {}, "train.step_fn is called with 2 positional argument(s) "
     "(model, batch) first: give build() parameters for them, e.g. def build(model, batch)"),
])
def test_each_reference_is_checked_as_tidal_calls_it(tmp_path, field, source, args, fix):
    mod = user_module(tmp_path, source)
    overrides: dict[str, object] = {field: f"{mod}:build"}
    if args:
        overrides["model.builder_args"] = args
    assert refused(tmp_path, **overrides)[field].endswith(fix)


def test_what_fits_passes_and_a_module_that_cannot_load_here_is_a_note(tmp_path):
    mod = user_module(tmp_path, """\
        def build(spec, **kwargs):
            pass

        def step(model, batch, scale=1.0):
            pass

        class Data:
            def __init__(self, n):
                self.n = n
        """)
    fits = {"model.builder": f"{mod}:build", "model.builder_args": {"anything": 1}, "train.step_fn": f"{mod}:step"}
    assert call_problems(tiny_spec(tmp_path, **fits), tmp_path) == ([], [])
    assert call_problems(tiny_spec(tmp_path, **{"data.dataset": f"{mod}:Data", "data.dataset_args": {"n": 3}}),
                         tmp_path) == ([], [])
    assert "give n in data.dataset_args, or give n a default in Data(); and remove m from data.dataset_args, or add a parameter m to Data()" in refused(tmp_path, **{"data.dataset": f"{mod}:Data",
                                                                  "data.dataset_args": {"m": 3}})["data.dataset"]
    assert refused(tmp_path, **{"model.builder": f"{mod}:nope"})["model.builder"].startswith(
        f"cannot load '{mod}:nope': {mod} has no function 'nope' (it has: Data, build, step)")
    needs = user_module(tmp_path, "import only_on_the_workers\n\ndef build(spec):\n    pass\n")
    problems, notes = call_problems(tiny_spec(tmp_path, **{"model.builder": f"{needs}:build"}), tmp_path)
    assert problems == [] and notes == [
        f"model.builder '{needs}:build' was not checked here: importing {needs} failed (ModuleNotFoundError: No "
        "module named 'only_on_the_workers'); the workers import it (the module must be importable on every "
        "worker: put it in the directory you start `tidal run` from (or the --working-dir of `tidal submit`), or "
        "install it on every node)"]
    assert str(tmp_path) not in sys.path, "the working directory is on the path only while checking"
    with pytest.raises(SpecError):
        check_calls(tiny_spec(tmp_path, **{"model.builder": f"{mod}:nope"}), tmp_path)


def test_validate_and_run_refuse_before_anything_starts(tmp_path, monkeypatch):
    """The issue's spec: `tidal validate` says what to change (exit 2); `tidal run` refuses the same
    before Ray starts or the job's folder is written."""
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "__init__.py").write_text("")
    (tmp_path / "jobs" / "mlp_classifier.py").write_text(
        (EXAMPLE.parent / "mlp_classifier.py").read_text().replace(
            "def dataset(n: int = 4096, dim: int = 16, classes: int = 4, seed: int = 0) -> Dataset:",
            "def dataset() -> Dataset:\n    n, dim, classes, seed = 4096, 16, 4, 0"))
    spec = tmp_path / "jobs" / "mlp-classifier.yaml"
    spec.write_text(EXAMPLE.read_text() + f"\ncheckpoint: {{storage: {tmp_path / 'runs'}}}\n".replace(
        "checkpoint: {every_steps: 20}", ""))
    monkeypatch.chdir(tmp_path)
    saved = {name: sys.modules.pop(name, None) for name in ("jobs", "jobs.mlp_classifier")}  # this repository's
    try:
        code, out, err = tidal_main("validate", str(spec))
        run = tidal_main("run", str(spec), env={"RAY_ADDRESS": "local"})
    finally:
        for name, module in saved.items():
            sys.modules.pop(name, None)
            if module is not None:
                sys.modules[name] = module
    assert code == 2 and out == "", err
    assert ("data.dataset: 'jobs.mlp_classifier:dataset' is dataset(), which Tidal cannot call as dataset(n=..., "
            "dim=..., classes=..., seed=...)") in err and "remove n, dim, classes, seed from data.dataset_args" in err
    assert run[0] == 2 and "remove n, dim, classes, seed from data.dataset_args" in run[2], run
    assert "Ray" not in run[1] + run[2] and not (tmp_path / "runs").exists()


# --- the user's errors on the workers -------------------------------------------------------------
@pytest.fixture
def fresh_worker():
    """A worker process that has not trained a step yet."""
    user_code.FIRST_LOSS.clear()
    yield
    user_code.FIRST_LOSS.clear()


def test_an_error_in_the_users_code_carries_the_users_frames(tmp_path, monkeypatch, fresh_worker):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    mod = user_module(tmp_path, """\
        def dataset(n):
            return load(n)

        def load(n):
            raise ValueError(f"no file for {n}")
        """)
    spec = tiny_spec(tmp_path, **{"data.dataset": f"{mod}:dataset", "data.dataset_args": {"n": 3}})
    with pytest.raises(UserCodeError) as e:
        user_code.UserDataset(spec)
    err = e.value
    assert err.field == "data.dataset" and err.first_step
    assert err.message == f"'{mod}:dataset' raised ValueError: no file for 3 when called with data.dataset_args {{'n': 3}}"
    # only the user's frames, as Python prints them, each path relative to the working directory
    lines = [line for line in err.frames.splitlines() if not line.strip().startswith("^")]  # Python's carets
    assert lines == ["Traceback (most recent call last), in your code:",
                     f'  File "{mod}.py", line 2, in dataset', "    return load(n)",
                     f'  File "{mod}.py", line 5, in load', '    raise ValueError(f"no file for {n}")',
                     "ValueError: no file for 3"]
    again = pickle.loads(pickle.dumps(err))  # from a worker to the controller, and on to the driver
    assert (again.field, again.message, again.frames, again.first_step) == (err.field, err.message, err.frames, True)
    assert str(again) == f"data.dataset: {err.message}"


def test_a_call_that_does_not_fit_is_the_users_and_tidals_own_errors_are_not(tmp_path, monkeypatch, fresh_worker):
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = user_module(tmp_path, "def dataset():\n    return [1]\n\ndef broken(n):\n    raise RuntimeError('disk')\n")
    with pytest.raises(UserCodeError, match=r"raised TypeError: dataset\(\) got an unexpected keyword argument 'n'"):
        user_code.UserDataset(tiny_spec(tmp_path, **{"data.dataset": f"{mod}:dataset", "data.dataset_args": {"n": 1}}))
    with pytest.raises(RuntimeError, match="disk"):  # a restart may cure a RuntimeError: not the user's mistake
        user_code.UserDataset(tiny_spec(tmp_path, **{"data.dataset": f"{mod}:broken", "data.dataset_args": {"n": 1}}))
    from pydantic import ValidationError

    from tidal.spec.job import JobSpec

    # a library's error (here pydantic's, a ValueError), with no frame of the user's: as it is
    with pytest.raises(ValidationError), user_code.calling("data.dataset", f"{mod}:dataset"):
        JobSpec.model_validate({"no_such_field": 1})


def test_after_the_first_step_a_mistake_is_retried_as_before(tmp_path, monkeypatch, fresh_worker):
    import torch

    monkeypatch.syspath_prepend(str(tmp_path))
    mod = user_module(tmp_path, """\
        def step(model, batch):
            if batch == "bad":
                raise IndexError("sample 7")
            return model(batch)
        """)
    step = user_code.step_function(tiny_spec(tmp_path, **{"train.step_fn": f"{mod}:step"}))
    with pytest.raises(UserCodeError) as before:
        step(None, "bad")
    assert before.value.first_step
    step(lambda _: torch.ones((), requires_grad=True), "good")  # the first step's loss
    with pytest.raises(UserCodeError) as after:
        step(None, "bad")
    assert not after.value.first_step and "raised IndexError: sample 7" in after.value.message


# --- not retried: the decision, the driver's message, the chatter ----------------------------------
MISTAKE = UserCodeError("data.dataset", "'m:dataset' raised ValueError: no", "Traceback...\nValueError: no\n")
LATER = UserCodeError("data.dataset", "'m:dataset' raised ValueError: no", first_step=False)
PEER = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5")


@pytest.mark.parametrize(("failures", "ends"), [
    ({0: MISTAKE, 1: MISTAKE}, True),
    ({1: MISTAKE}, True),  # rank 0 still running at the poll: it is stopped with the group
    ({0: PEER, 1: MISTAKE}, True),  # rank 0's collective lost rank 1
    ({0: MISTAKE, 1: RuntimeError("CUDA error: an illegal memory access")}, False),  # a restart may cure that
    ({0: LATER, 1: LATER}, False),  # after the first step: retried as before
    ({0: PEER}, False),
    ({0: ValueError("a bug of Tidal's")}, False),
])
def test_a_mistake_before_the_first_step_ends_the_job_and_nothing_else_does(failures, ends):
    assert (not_retried(failures) is MISTAKE) == ends


def test_a_mistake_after_the_first_step_is_retried_once_and_ends_the_job_when_it_comes_back():
    from tidal.launch.recovery import signature

    first = {0: LATER, 1: PEER}
    assert not_retried(first, previous=None) is None, "retried: a restart may not meet it (a transient input)"
    assert not_retried(first, previous=signature(first)) is LATER, "the restart met the same mistake"
    other = UserCodeError("train.step_fn", "'m:step' raised IndexError: sample 7", first_step=False)
    assert not_retried({0: other}, previous=signature(first)) is None, "another mistake: retried as the first was"
    assert not_retried({0: LATER, 1: RuntimeError("CUDA error")}, previous=signature(first)) is None
    assert signature({0: PEER}) is None
    assert mistake_message("mlp", LATER).startswith(
        "job 'mlp' failed the same way in two attempts in a row (the second resumed from a checkpoint), in your "
        "code: data.dataset: 'm:dataset' raised ValueError: no\nNot restarted")
    assert mistake_message("mlp", LATER).endswith("then run the same command again: it resumes from its latest checkpoint.")


def test_the_driver_says_what_failed_in_the_users_code_once_and_what_to_do():
    assert mistake_message("mlp", MISTAKE) == (
        "job 'mlp' failed before its first step, in your code: data.dataset: 'm:dataset' raised ValueError: no\n"
        "Traceback...\nValueError: no\n"
        "Not restarted: a restart runs the same code on the same inputs. Fix data.dataset (or the code it names), "
        "then run the same command again.")


def test_rays_tracebacks_of_a_mistake_are_dropped_for_the_drivers_report(monkeypatch):
    """Ray Train's "Error in training function:" (logged in the worker while it handles the error) and its
    controller's "Error in control loop iteration" (with the error): the driver reports the mistake once."""
    monkeypatch.delenv("TIDAL_DEBUG", raising=False)
    keep = UserMistake()

    def record(exc_info: object = None) -> logging.LogRecord:
        return logging.LogRecord("ray", logging.ERROR, "f.py", 1, "Error in training function:\nTraceback ...",
                                 None, exc_info)  # type: ignore[arg-type]

    try:
        raise MISTAKE
    except UserCodeError:
        assert not keep.filter(record())
    try:
        raise LATER
    except UserCodeError:
        assert keep.filter(record()), "retried: Ray's report stays"
    try:
        raise ValueError("other")
    except ValueError:
        assert keep.filter(record())
    assert not keep.filter(record((UserCodeError, MISTAKE, None)))
    assert keep.filter(record())
