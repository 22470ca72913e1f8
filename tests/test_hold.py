"""The tests' hold (tidal.worker.hold): rank 0 holds before the step after the named one until the
test releases it, once per job, and no other rank or step holds."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from tidal.worker import hold


def test_rank_0_holds_once_after_the_named_step_until_released(tmp_path, monkeypatch):
    base = str(tmp_path / "held")
    marker = Path(hold.marked(base, 13))
    monkeypatch.setenv(hold.HOLD_ENV, f"13,20@{base}")
    for rank, step in [(0, 13), (1, 14), (0, 15)]:
        hold.before_step(rank, step)
    assert not marker.exists(), "only rank 0, and only before step 14"

    held = threading.Thread(target=hold.before_step, args=(0, 14))
    held.start()
    time.sleep(0.3)
    assert marker.exists() and held.is_alive(), "rank 0 holds until the test lets it go"
    Path(hold.released(base, 13)).touch()
    held.join(timeout=2)
    assert not held.is_alive()

    t0 = time.monotonic()
    hold.before_step(0, 14)  # a restarted group replays step 14: no second hold
    assert time.monotonic() - t0 < 0.1
    assert not Path(hold.marked(base, 20)).exists(), "the next named step holds on its own"
