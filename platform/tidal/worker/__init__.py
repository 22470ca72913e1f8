"""Code that runs inside each Ray Train worker (imports torch and deepspeed).

`train_loop` is what Ray Train runs: it names the loop without importing it, so the driver that
hands it to Ray Train never imports DeepSpeed.
"""

import sys
from typing import Any

from tidal.tracking.quiet import quiet_libraries

quiet_libraries()  # before any module here imports deepspeed, which warns at import


def train_loop(config: dict[str, Any]) -> None:
    """The per-worker training loop (worker/loop.py)."""
    _import_deepspeed()
    from tidal.worker.loop import train_loop as loop

    loop(config)


def _import_deepspeed() -> None:
    """DeepSpeed imports MLflow, when installed, for its autotuner's trial logging, which Tidal
    never runs (workers never write to MLflow: tracking/tracker.py). That import is about 1 s of
    CPU in every worker start. MLflow is hidden while DeepSpeed loads and visible again after
    (user code may import it)."""
    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        return
    sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` raises ImportError: DeepSpeed's "not installed"
    try:
        import deepspeed  # noqa: F401
    finally:
        del sys.modules["mlflow"]
