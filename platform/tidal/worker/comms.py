"""Time spent inside collectives, read from DeepSpeed's own communication logger.

Every collective ZeRO and the pipeline engine run goes through `deepspeed.comm`, whose
`timed_op` wrapper times each op once the comms logger is enabled (the `comms_logger` config
section, or `deepspeed.comm.configure`). Enabled, it synchronizes the device after every op,
which would cost overlap on a GPU, so Tidal enables it for one sampled step per log interval
(the step PhaseClock already synchronizes) and off again at the step's end.

The totals are read from the logger's timers rather than its per-op records: in DeepSpeed 0.19
each record holds `elapsed(reset=False)`, the running total of every op of that name so far,
not the op's own latency. The timers' running totals, reset at each sample, are exact.
"""

from __future__ import annotations

from typing import Any


class CommClock:
    """Seconds inside DeepSpeed collectives between `start()` and `stop()` on this rank."""

    def __init__(self) -> None:
        import deepspeed.comm as ds_comm  # here: only a training worker needs deepspeed

        self._ds: Any = ds_comm
        self.running = False

    def start(self) -> None:
        self._reset()
        self._ds.configure(enabled=True, prof_all=True, verbose=False)
        self.running = True

    def stop(self) -> float:
        if not self.running:
            return 0.0
        self._ds.configure(enabled=False)
        self.running = False
        return self._reset() / 1000.0

    def _reset(self) -> float:
        """Milliseconds on the timers since the last reset; clears them and the logger's records."""
        total = sum(t.elapsed(reset=True) for t in self._ds.timers.get_timers().values())
        self._ds.reset_log()  # its per-op lists would otherwise grow for the whole run
        return total
