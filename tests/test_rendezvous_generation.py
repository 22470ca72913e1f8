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
