"""Reference loss curves of undisturbed runs, kept as small files (tests/assets/losses/NAME.json)
instead of retrained by every exactness test that compares against them (as torchtitan keeps
tests/assets/losses). Regenerate them after a change that moves the losses on purpose:

    python -m tests.golden            # every reference; or name some: python -m tests.golden reshard-zero2

A file records the fields of the spec its losses depend on (model, data, train, parallelism, the
worker count): a test whose reference spec differs in one of them fails and says which command
rewrites the file; a field added to the spec later (at its default) is not compared. The comparisons that use them allow for
floating-point drift between machines (a relative 1e-4); bit-for-bit checks retrain in the test.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.conftest import tiny_spec
from tidal.spec.job import JobSpec

ASSETS = Path(__file__).resolve().parent / "assets" / "losses"
COMMAND = "python -m tests.golden"
# The fields a loss curve depends on (where a job keeps things, what it is called, how often it saves: none).
LOSS_FIELDS = ("model.", "data.", "train.", "parallelism.", "scaling.min_workers", "scaling.max_workers")


def _reshard(stage: int) -> Callable[[Path], JobSpec]:
    """tests/test_reshard.py's undisturbed run: 2 workers, 18 steps."""
    return lambda tmp: tiny_spec(tmp, name=f"steady{stage}", **{
        "parallelism.zero_stage": stage, "train.steps": 18, "checkpoint.every_steps": 6,
        "scaling.min_workers": 2, "scaling.max_workers": 2})


REFERENCES: dict[str, Callable[[Path], JobSpec]] = {"reshard-zero2": _reshard(2)}


def what_matters(spec: JobSpec) -> dict[str, Any]:
    return json.loads(json.dumps({k: v for k, v in sorted(spec.flat().items()) if k.startswith(LOSS_FIELDS)}))


def reference_losses(name: str, spec: JobSpec) -> dict[int, float]:
    """step -> loss of the stored reference `name`, which must have been trained with `spec`. With
    no file yet, the reference is trained here (as before files existed), and the command that
    stores it is printed."""
    path = ASSETS / f"{name}.json"
    if not path.exists():
        import tidal
        from tidal.testing.runs import metric_history

        print(f"no stored reference losses {path}: training the reference; `{COMMAND} {name}` stores them")
        return metric_history(spec, tidal.run(spec).mlflow_run_id, "loss")
    data, now = json.loads(path.read_text()), what_matters(spec)
    changed = sorted(k for k, v in data["spec"].items() if k in now and now[k] != v)
    if changed:
        raise AssertionError(f"{path.name} was trained with another spec ({', '.join(changed)}): run `{COMMAND} {name}`")
    return {int(step): loss for step, loss in data["losses"].items()}


def regenerate(name: str) -> Path:
    import tidal
    from tidal.testing.runs import metric_history

    with tempfile.TemporaryDirectory(prefix="tidal-golden-") as d:
        spec = REFERENCES[name](Path(d))
        losses = metric_history(spec, tidal.run(spec).mlflow_run_id, "loss")
    path = ASSETS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"command": f"{COMMAND} {name}", "spec": what_matters(spec),
                                "losses": {str(s): losses[s] for s in sorted(losses)}}, indent=1) + "\n")
    return path


def main(names: list[str]) -> None:
    for name in names or list(REFERENCES):
        if name not in REFERENCES:
            raise SystemExit(f"no reference named {name!r}; known: {', '.join(REFERENCES)}")
        print(f"wrote {regenerate(name)}")


if __name__ == "__main__":
    main(sys.argv[1:])
