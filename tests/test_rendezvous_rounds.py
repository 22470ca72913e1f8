"""The rendezvous's decision (worker/health/rounds.py) as a table: which generation each join enters,
and what every rank that joined one then does (form, wait, join again)."""

from __future__ import annotations

import pytest

from tidal.worker.health.rounds import Rounds, join, status


def _run(joins: list[tuple[int, int, str]]) -> tuple[Rounds, list[int]]:
    r, gens = Rounds(), []
    for rank, world, token in joins:
        r, gen = join(r, rank, world, token)
        gens.append(gen)
    return r, gens


@pytest.mark.parametrize(("joins", "gens", "formed", "asks"), [
    # the first start: both ranks meet in generation 1
    ([(0, 2, "a"), (1, 2, "b")], [1, 1], (1,), {1: "formed", 2: "waiting"}),
    # the same rank asking twice (a retry) stays in its generation
    ([(0, 2, "a"), (0, 2, "a"), (1, 2, "b")], [1, 1, 1], (1,), {1: "formed"}),
    # rank 1 lost: the survivor and the replacement meet in generation 2, whoever comes first
    ([(0, 2, "a"), (1, 2, "b"), (0, 2, "a"), (1, 2, "c")], [1, 1, 2, 2], (1, 2), {2: "formed", 3: "waiting"}),
    ([(0, 2, "a"), (1, 2, "b"), (1, 2, "c"), (0, 2, "a")], [1, 1, 2, 2], (1, 2), {2: "formed"}),
    # rank 0 lost: the same, the replacement being rank 0
    ([(0, 2, "a"), (1, 2, "b"), (1, 2, "b"), (0, 2, "c")], [1, 1, 2, 2], (1, 2), {2: "formed"}),
    # the replacement dies before the group forms and another takes its place: the waiting generation
    # is abandoned (its ranks join again) and the next forms with the newest process
    ([(0, 2, "a"), (1, 2, "b"), (1, 2, "c"), (1, 2, "d"), (0, 2, "a")], [1, 1, 2, 3, 3], (1, 3),
     {2: "abandoned", 3: "formed"}),
    # a restart at another size abandons a generation still forming at the old one
    ([(0, 2, "a"), (0, 1, "x")], [1, 2], (2,), {1: "abandoned", 2: "formed"}),
    # nobody else came: still waiting (the rank's own deadline ends it)
    ([(0, 3, "a"), (2, 3, "c")], [1, 1], (), {1: "waiting"}),
])
def test_every_join_enters_one_generation_and_every_generation_forms_once(joins, gens, formed, asks):
    r, got = _run(joins)
    assert got == gens
    assert r.formed == formed
    assert {g: status(r, g) for g in asks} == asks


def test_the_newest_formed_generation_names_its_processes_and_the_ranks_it_replaced():
    r, _ = _run([(0, 2, "11:a"), (1, 2, "12:b")])
    assert r.replaced == (), "the first generation replaces nobody"
    r, _ = join(r, 1, 2, "13:c")
    r, _ = join(r, 0, 2, "11:a", step=37)
    assert r.last == {0: "11:a", 1: "13:c"}
    assert (r.replaced, r.lost_after) == ((1,), 37)
    r, _ = join(r, 1, 2, "13:c", step=50)
    r, _ = join(r, 0, 2, "14:d")
    assert (r.replaced, r.lost_after) == ((0,), 50)
    r, _ = join(r, 0, 1, "15:e")
    assert r.replaced == (), "a group of another size is a restart, not a replacement"


def test_a_generation_with_every_rank_in_a_new_process_replaced_nobody_in_place():
    """Ray Train restarted every process (a hang, or a survivor lost while it re-formed and then replaced
    too): no rank kept its process, so rank 0 must not say that ranks were replaced in place."""
    r, _ = _run([(0, 2, "11:a"), (1, 2, "12:b"), (1, 2, "13:c"), (0, 2, "14:d")])
    assert r.last == {0: "14:d", 1: "13:c"}
    assert r.replaced == ()


@pytest.mark.parametrize(("rank", "world"), [(2, 2), (-1, 2), (0, 0)])
def test_a_rank_outside_the_group_is_refused(rank, world):
    with pytest.raises(ValueError, match=f"rank {rank} cannot join a group of {world}"):
        join(Rounds(), rank, world, "t")
