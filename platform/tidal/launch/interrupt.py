"""Ctrl-C while a job trains: Ray Train aborts the run; Tidal reports an interruption.

Why by hand: Ray Train's `fit()` installs a SIGINT handler on the main thread that aborts its
controller (the workers end, checkpoints already written stay) and then ends the driver's wait
with `SystemExit`, which Ray's `ray.get` re-raises as `SystemExit(1)`; it also leaves that handler
installed after `fit()` returns, where a later Ctrl-C asks a controller that is gone. So a `tidal
run` stopped with Ctrl-C exited 1 with no word on how to go on, and a notebook that ran a job
kept a handler that ends the kernel's wait with `SystemExit`. Around `fit()`, a `SystemExit` is
turned into `KeyboardInterrupt` (the CLI then prints how to resume and exits 130, as documented;
the SDK raises it as Python does for Ctrl-C), unless SIGTERM ended the wait, which stays the
`SystemExit` Ray's own SIGTERM handler raises; and the SIGINT handler from before is restored."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


@contextmanager
def ctrl_c_interrupts() -> Iterator[None]:
    """Around Ray Train's `fit()`: Ctrl-C surfaces as `KeyboardInterrupt` once Ray Train has aborted
    the run. Does nothing off the main thread, where Ray Train installs no handler (Ray Tune's trials)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigint_before = signal.getsignal(signal.SIGINT)
    sigterm_before = signal.getsignal(signal.SIGTERM)
    terminated = threading.Event()

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        terminated.set()
        if callable(sigterm_before):
            sigterm_before(signum, frame)  # Ray's, from ray.init: sys.exit(signum)
        else:
            raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    except SystemExit as e:
        if terminated.is_set():
            raise
        raise KeyboardInterrupt(f"Ray Train aborted the run on Ctrl-C ({e})") from e
    finally:
        signal.signal(signal.SIGINT, sigint_before)
        signal.signal(signal.SIGTERM, sigterm_before)
