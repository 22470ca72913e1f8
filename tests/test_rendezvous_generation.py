"""failure.replace_in_place: one rendezvous store serves every generation of a group, so what a group keeps
by its store's address (its hang folder, its heartbeat counters) is kept per generation as well; without
the switch (Ray's own process group, a new address per group) the names are as before."""

from __future__ import annotations

from tidal.worker.health.hang import group_key
from tidal.worker.health.heartbeat import GENERATION_ENV


def test_each_generation_has_a_hang_folder_of_its_own(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "4000")
    monkeypatch.delenv(GENERATION_ENV, raising=False)
    assert group_key() == "port4000-10.0.0.1"  # Ray's process group: as before
    monkeypatch.setenv(GENERATION_ENV, "2")
    second = group_key()
    monkeypatch.setenv(GENERATION_ENV, "3")
    assert second == "port4000-10.0.0.1-gen2" and group_key() == "port4000-10.0.0.1-gen3"


def test_a_closed_watchdog_judges_nothing_while_its_rank_waits_to_re_form(monkeypatch):
    """A survivor waiting in the rendezvous for the replacement trains no step: the watchdog of the
    group it left is closed (its thread ends, its heartbeat stops) and declares no hang, however long."""
    import time

    from tidal.worker.health import watchdog as wd

    class Pulse:
        closed = ended = False

        def end(self) -> None:
            self.ended = True

        def close(self) -> None:
            self.closed = True

        def silent(self) -> list[int]:
            return [1]  # the lost peer beats no more

        def declared(self) -> bool:
            return False

        def announce(self) -> None:
            pass

    exits: list[str | None] = []
    monkeypatch.setattr(wd, "POLL_S", 0.02)
    monkeypatch.setattr(wd.StepWatchdog, "_exit", lambda self, said: exits.append(said))
    pulse = Pulse()
    dog = wd.StepWatchdog(0.05, 0, events=None, pulse=pulse).opened()  # type: ignore[arg-type]
    dog.beat(1)
    dog.close()
    time.sleep(0.3)  # six deadlines
    assert exits == [] and pulse.closed
