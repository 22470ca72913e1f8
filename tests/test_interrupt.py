"""Ctrl-C around Ray Train's fit() (tidal.launch.interrupt), with real signals to this process: the
SystemExit Ray Train's handler ends the wait with becomes KeyboardInterrupt, a SIGTERM's stays
SystemExit, and the SIGINT handler from before is back afterwards. End to end (a `tidal run`
process stopped with Ctrl-C exits 130 and says how to resume): tests/test_driver_resume.py."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from tidal.launch.interrupt import ctrl_c_interrupts


def ray_trains_handler(signum, frame):
    """What Ray Train's fit() installs: abort the controller, then end the driver's wait."""
    sys.exit(0)


def test_ctrl_c_inside_fit_is_a_keyboard_interrupt_and_the_handler_before_is_restored():
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt), ctrl_c_interrupts():
        signal.signal(signal.SIGINT, ray_trains_handler)
        os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before, "Ray Train's handler must not outlive fit()"


def test_sigterm_inside_fit_stays_a_system_exit():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit), ctrl_c_interrupts():
        signal.signal(signal.SIGINT, ray_trains_handler)
        os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is before
