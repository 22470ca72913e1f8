"""Reference loss curves of undisturbed runs, kept as small files (tests/assets/losses/NAME.json)
instead of retrained by every exactness test that compares against them (as torchtitan keeps
tests/assets/losses). Regenerate them after a change that moves the losses on purpose:

    python -m tests.golden            # every reference; or name some: python -m tests.golden reshard-zero2

A file records the fields of the spec its losses depend on (model, data, train, parallelism, the
worker count): a test whose reference spec differs in one of them fails and says which command
rewrites the file; a field added to the spec later (at its default) is not compared. The comparisons that use them allow for
floating-point drift between machines (a relative 1e-4); bit-for-bit checks retrain in the test.

A reference may keep more than losses (`RECORDED`): the streamed test's, which windows each step trained.

A reference trained on a file the test writes in its own folder (a parquet source) names the file by
its place in that folder and records a digest of its content: the builder below writes the same file
(with the test's own function), and a test whose file's content differs is told to regenerate.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.conftest import ROOT, tiny_spec
from tidal.spec import JobSpec, load_spec
from tidal.testing.chaos import chaos_spec
from tidal.testing.runs import prepared_store

ASSETS = Path(__file__).resolve().parent / "assets" / "losses"
COMMAND = "python -m tests.golden"
# The fields a loss curve depends on (where a job keeps things, what it is called, how often it saves: none).
LOSS_FIELDS = ("model.", "data.", "train.", "parallelism.", "scaling.min_workers", "scaling.max_workers")


def _reshard(stage: int) -> Callable[[Path], JobSpec]:
    """tests/test_reshard.py's undisturbed run: 2 workers, 18 steps."""
    return lambda tmp: tiny_spec(tmp, name=f"steady{stage}", **{
        "parallelism.zero_stage": stage, "train.steps": 18, "checkpoint.every_steps": 6,
        "scaling.min_workers": 2, "scaling.max_workers": 2})


def _tiny(name: str, **overrides: Any) -> Callable[[Path], JobSpec]:
    return lambda tmp: tiny_spec(tmp, name=name, **overrides)


def _attempts(stage: int) -> Callable[[Path], JobSpec]:
    """tests/test_attempts.py's undisturbed run: 2 workers, 8 steps, on a local path."""
    return _tiny(f"steady{stage}", **{"parallelism.zero_stage": stage, "train.steps": 8, "checkpoint.every_steps": 4})


def _pipeline_whole(tmp: Path) -> JobSpec:
    """tests/test_models_data.py's pipeline job as one whole model on one worker."""
    pipe = load_spec(ROOT / "jobs" / "tiny-pipeline.yaml").with_overrides(
        {"checkpoint.storage": str(tmp / "runs"), "tracking.uri": prepared_store(tmp / "mlflow.db"), "train.log_every": 1})
    return pipe.with_overrides({"name": "whole", "parallelism.pipeline_stages": 1, "scaling.min_workers": 1,
                                "scaling.max_workers": 1})


def _parquet_steady(tmp: Path) -> JobSpec:
    """tests/test_models_data.py's undisturbed parquet job, on the parquet file that test writes."""
    from tests.helpers import write_sources  # the test's own data (fixed texts, seeded)

    src = write_sources(tmp)["parquet"]
    return tiny_spec(tmp, name="pq-steady", **{"data.source": src, "model.vocab_size": 256, "train.steps": 16,
                                               "checkpoint.every_steps": 4})


def _admission_alone(tmp: Path) -> JobSpec:
    """tests/test_admission_sharing.py's low job alone on the cluster (elastic 1-2, at 2 workers):
    the losses its shrunk and grown run must keep."""
    return tiny_spec(tmp, name="low-alone", **{
        "scaling.min_workers": 1, "scaling.max_workers": 2, "scaling.cpus_per_worker": 1, "train.steps": 320,
        "train.micro_batch": 2, "train.global_batch": 24, "checkpoint.every_steps": 25,
        "train.step_fn": "tests.slow_step:step", "failure.max_restarts": 0})


def _user_code_steady(tmp: Path) -> JobSpec:
    """tests/test_user_code_e2e.py's undisturbed run: the mlp-classifier example (ZeRO-2, 2 workers)
    through the test's step function, which records what reached the engine."""
    return load_spec(ROOT / "jobs" / "mlp-classifier.yaml").with_overrides({
        "name": "steady", "checkpoint.storage": str(tmp / "runs"), "tracking.uri": prepared_store(tmp / "mlflow.db"),
        "train.log_every": 1, "train.step_fn": "tests.user_step_probe:step", "worker_env.TIDAL_TEST_PROBE": str(tmp / "probe")})


def _stream_steady(tmp: Path) -> JobSpec:
    """tests/test_stream_resume.py's undisturbed streamed run, recording each step's windows."""
    from tests.stream_probe import streamed, write_docs

    return tiny_spec(tmp, name="steady", **streamed(write_docs(tmp)), worker_env={"TIDAL_TEST_WINDOWS": str(tmp / "steady")})


def _stream_windows(tmp: Path) -> dict[str, list[str]]:
    from tests.stream_probe import STEPS, step_batches

    return {str(step): windows for step, windows in step_batches(tmp / "steady", 2, 1, STEPS).items()}


# tests/test_replace_in_place_combined.py's undisturbed run at three workers (two of them lost at once there)
THREE = {"train.steps": 24, "train.global_batch": 48, "checkpoint.every_steps": 10, "scaling.min_workers": 3,
         "scaling.max_workers": 3, "scaling.cpus_per_worker": 0.5}

REFERENCES: dict[str, Callable[[Path], JobSpec]] = {
    "reshard-zero2": _reshard(2),
    "async-checkpoint-undisturbed": _tiny("undisturbed", **{
        "train.steps": 40, "train.global_batch": 64, "checkpoint.every_steps": 10}),
    "attempts-steady2": _attempts(2),
    "attempts-steady3": _attempts(3),
    "eval-plain": _tiny("plain", **{"train.steps": 60, "train.global_batch": 64, "checkpoint.every_steps": 10}),
    "models-data-whole": _pipeline_whole,
    "models-data-pq-steady": _parquet_steady,
    "restore-e2e-steady3": _tiny("steady", **{"train.steps": 12, "checkpoint.every_steps": 6,
                                              "parallelism.zero_stage": 3}),
    "s3-checkpoints-steady3": _reshard(3),  # the same undisturbed run as test_reshard's, at ZeRO-3
    "microbatch-fixed-4": _tiny("fixed-4", **{
        "model.builder": "tests.oom_model:build", "train.micro_batch": 4, "train.steps": 8, "train.log_every": 1,
        "checkpoint.every_steps": 4}),
    "admission-sharing-low-alone": _admission_alone,
    "chaos-undisturbed": lambda tmp: chaos_spec(tmp, "undisturbed", 120, 10),  # tests/test_chaos.py's
    "stream-undisturbed": _stream_steady,
    "user-code-steady": _user_code_steady,
    "in-place-three": _tiny("three", **THREE),
}
# What a reference keeps beside its losses, read from the folder it trained in: key -> how.
RECORDED: dict[str, dict[str, Callable[[Path], Any]]] = {"stream-undisturbed": {"windows": _stream_windows}}


def content_digest(path: Path) -> str:
    """A data file's content: a parquet file's rows, not its bytes (which name the pyarrow that wrote them)."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return hashlib.sha256(json.dumps(pq.read_table(path).to_pylist()).encode()).hexdigest()
    return hashlib.sha256(path.read_bytes()).hexdigest()


def what_matters(spec: JobSpec, tmp: Path | None = None) -> dict[str, Any]:
    """The loss fields of `spec`; a file under `tmp` (the folder it was made in) as `$TMP/...`
    with its content's digest beside it, so that another folder with the same file matches."""
    fields = json.loads(json.dumps({k: v for k, v in sorted(spec.flat().items()) if k.startswith(LOSS_FIELDS)}))
    if tmp is None:
        return fields
    out: dict[str, Any] = {}
    for key, value in fields.items():
        if isinstance(value, str) and value.startswith(f"{tmp}/"):
            out[f"{key}.sha256"] = content_digest(Path(value)) if Path(value).is_file() else None
            value = "$TMP/" + value[len(str(tmp)) + 1:]
        out[key] = value
    return dict(sorted(out.items()))


def reference_losses(name: str, spec: JobSpec, tmp: Path | None = None) -> dict[int, float]:
    """step -> loss of the stored reference `name`, which must have been trained with `spec`
    (`tmp`: the test's folder, where `spec` finds files the test wrote). With no file yet, the
    reference is trained here (as before files existed), and the command that stores it is printed."""
    path = ASSETS / f"{name}.json"
    if not path.exists():
        import tidal
        from tidal.testing.runs import metric_history

        print(f"no stored reference losses {path}: training the reference; `{COMMAND} {name}` stores them")
        return metric_history(spec, tidal.run(spec).mlflow_run_id, "loss")
    data, now = json.loads(path.read_text()), what_matters(spec, tmp)
    changed = sorted(k for k, v in data["spec"].items() if k in now and now[k] != v)
    if changed:
        raise AssertionError(f"{path.name} was trained with another spec ({', '.join(changed)}): run `{COMMAND} {name}`")
    return {int(step): loss for step, loss in data["losses"].items()}


def reference_record(name: str, key: str) -> Any:
    """What the stored reference `name` recorded as `key` (RECORDED), beside the losses that
    `reference_losses` checked against the test's spec."""
    path = ASSETS / f"{name}.json"
    if not path.exists():
        raise AssertionError(f"no stored reference {path.name}: run `{COMMAND} {name}`")
    return json.loads(path.read_text())[key]


def regenerate(name: str) -> Path:
    import tidal
    from tidal.testing.runs import metric_history

    with tempfile.TemporaryDirectory(prefix="tidal-golden-") as d:
        spec = REFERENCES[name](Path(d))
        losses = metric_history(spec, tidal.run(spec).mlflow_run_id, "loss")
        fields = what_matters(spec, Path(d))
        recorded = {key: read(Path(d)) for key, read in RECORDED.get(name, {}).items()}
    path = ASSETS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"command": f"{COMMAND} {name}", "spec": fields,
                                "losses": {str(s): losses[s] for s in sorted(losses)}, **recorded}, indent=1) + "\n")
    return path


def main(names: list[str]) -> None:
    for name in names or list(REFERENCES):
        if name not in REFERENCES:
            raise SystemExit(f"no reference named {name!r}; known: {', '.join(REFERENCES)}")
        print(f"wrote {regenerate(name)}")


if __name__ == "__main__":
    main(sys.argv[1:])
