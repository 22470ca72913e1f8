"""The worker group's one health decision (worker/health/decide.py), as a table: for every fault or
signal, what happens to the group and its size after."""

from __future__ import annotations

import pytest

from tidal.worker.health.decide import (
    NONE,
    Admission,
    Decision,
    Hang,
    HungNode,
    HungNodeInGroup,
    LostWorker,
    NodeBack,
    SlowNode,
    decide,
)


@pytest.mark.parametrize(("signal", "decision"), [
    # admission's word, for a group launched at 4
    (Admission(NONE, 4), Decision("wait", 4)),  # no word (not under admission, or unreachable): train on
    (Admission(4.0, 4), Decision("wait", 4)),  # the size it has
    (Admission(2.0, 4), Decision("shrink", 2)),  # a more urgent job takes two workers
    (Admission(0.0, 4), Decision("shrink", 0)),  # suspended
    (Admission(6.0, 4), Decision("restart", 6)),  # capacity freed: grow
    # a persistent straggler's node
    (SlowNode(world=4, on_node=1, min_workers=2, exclude=True), Decision("avoid_node", 3, "exclude")),
    (SlowNode(world=4, on_node=2, min_workers=2, exclude=True), Decision("avoid_node", 2, "exclude")),  # all its ranks
    (SlowNode(world=2, on_node=1, min_workers=2, exclude=True), Decision("wait", 2)),  # never below min_workers
    (SlowNode(world=4, on_node=1, min_workers=1, exclude=False), Decision("wait", 4)),  # failure.straggler_exclude off
    # a hang's culprit node: the hang restarts the group; the second hang of a node avoids it
    (HungNode(hangs=1, world=3, on_node=1, min_workers=1, exclude=True), Decision("restart", 3)),
    (HungNode(hangs=2, world=3, on_node=1, min_workers=1, exclude=True), Decision("avoid_node", 2, "exclude")),
    (HungNode(hangs=3, world=3, on_node=1, min_workers=1, exclude=True), Decision("restart", 3)),  # said once
    (HungNode(hangs=2, world=2, on_node=1, min_workers=2, exclude=True), Decision("restart", 2)),  # below min
    (HungNode(hangs=2, world=3, on_node=1, min_workers=1, exclude=False), Decision("restart", 3)),
    (HungNodeInGroup(world=3, size=2), Decision("avoid_node", 2)),  # the restarted group still runs there
    # the avoidance is over
    (NodeBack(world=2, max_workers=3), Decision("restart", 3, "return")),  # grow back onto it
    (NodeBack(world=3, max_workers=3), Decision("wait", 3, "done")),  # nothing to grow into: forget it
    # a lost worker, a hang: Ray Train restarts the group at its size
    (LostWorker(world=4), Decision("restart", 4)),
    # failure.replace_in_place: the lost rank alone is replaced, the others re-form the group with it
    (LostWorker(world=4, in_place=True), Decision("replace", 4)),
    (LostWorker(world=1, in_place=True), Decision("restart", 1)),  # no survivor to keep
    (LostWorker(world=2, in_place=True, reforming=True), Decision("restart", 2)),  # lost again before a step
    (Hang(world=4), Decision("restart", 4)),
    # failure.replace_in_place: a hang whose culprits were all silent and are ended is a lost worker's
    (Hang(world=4, in_place=True, ended=True), Decision("replace", 4)),
    (Hang(world=4, in_place=False, ended=True), Decision("restart", 4)),  # the switch off: as before
    (Hang(world=4, in_place=True, ended=False), Decision("restart", 4)),  # a rank alive but stuck, or not ended
    (Hang(world=4, in_place=True, ended=True, node_due=True), Decision("restart", 4)),  # its node may be avoided
    (Hang(world=1, in_place=True, ended=True), Decision("restart", 1)),  # no survivor to keep
])
def test_every_fault_and_signal_has_one_answer_and_a_size(signal, decision):
    assert decide(signal) == decision


def test_anything_else_is_refused_by_name():
    with pytest.raises(TypeError, match="not a health signal"):
        decide("node down")  # type: ignore[arg-type]
