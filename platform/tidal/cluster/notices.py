"""A cloud's interruption notice, as its instance metadata service documents it, and the one
decision taken on it: drain this Ray node now, with the notice's deadline, or not.

Pure functions (no network, no Ray): `cluster/notice_watch.py` polls the endpoints and acts;
tests/test_notices.py checks each parser against the payloads each cloud documents.

- AWS (IMDSv2): `/latest/meta-data/spot/instance-action` answers 404 until a spot interruption
  is scheduled, then `{"action": "terminate"|"stop"|"hibernate", "time": "<UTC ISO 8601>"}`, two
  minutes ahead. `/latest/meta-data/events/recommendations/rebalance` answers
  `{"noticeTime": "..."}` when the instance is at elevated risk: advice, with no deadline.
- GCE: `computeMetadata/v1/instance/preempted` answers `TRUE` once the instance is being
  preempted; the instance then has 30 s (the ACPI G2 soft-off) before it stops.
- Azure Scheduled Events: `{"DocumentIncarnation": n, "Events": [{"EventId", "EventType":
  "Preempt", "EventStatus": "Scheduled", "Resources": [vm names], "NotBefore": "<RFC 1123>",
  ...}]}`; a Spot VM's Preempt comes at least 30 s ahead. An event may disappear (cancelled).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from email.utils import parsedate_to_datetime
from typing import Any, Literal

Cloud = Literal["aws", "gcp", "azure"]
CLOUDS: tuple[Cloud, ...] = ("aws", "gcp", "azure")

# GCE documents 30 s between the preemption notice and the instance stopping, and gives no time
# in the notice itself: the deadline is counted from when the watcher saw it.
GCE_NOTICE_S = 30.0


class Malformed(ValueError):
    """A 200 from the metadata service whose body is not what the cloud documents (a proxy's page,
    a truncated document): the watcher says so once and reads again at its next poll."""


def _document(body: str, kind: type) -> Any:
    try:
        doc = json.loads(body)
    except ValueError as e:
        raise Malformed(f"not JSON: {body[:80]!r}") from e
    if not isinstance(doc, kind):
        raise Malformed(f"a JSON {type(doc).__name__} where a {kind.__name__} was documented: {body[:80]!r}")
    return doc


@dataclass(frozen=True)
class Notice:
    """What one metadata answer says. `key` names the notice, so that one notice brings one drain
    however often it is read again; a new deadline for the same event is a new notice."""

    source: str  # "aws spot instance-action", "aws rebalance recommendation", "gce preempted", "azure Preempt"
    interrupt: bool  # the node will go (a drain is due); False: advice only (AWS rebalance)
    deadline_s: float | None  # when the node goes (time.time()); None: not said
    key: str
    event_id: str | None = None  # Azure: the event to acknowledge


@dataclass(frozen=True)
class Drain:
    """Drain this node now, telling Ray it goes at `deadline_s`."""

    deadline_s: float
    reason: str  # for Ray's drain request and Tidal's line


def _iso(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def parse_aws_instance_action(status: int, body: str) -> Notice | None:
    """AWS `spot/instance-action`: 404 while nothing is scheduled; 200 with the action and its time."""
    if status != 200:
        return None
    doc = _document(body, dict)
    action, when = doc.get("action"), doc.get("time")
    if not action or not when:
        return None
    try:
        deadline = _iso(str(when))
    except ValueError as e:
        raise Malformed(f"instance-action time {when!r} is not an ISO 8601 time") from e
    return Notice(f"aws spot instance-action ({action})", True, deadline, f"aws:{action}:{when}")


def parse_aws_rebalance(status: int, body: str) -> Notice | None:
    """AWS `events/recommendations/rebalance`: 404 until a recommendation; then its noticeTime.
    Advice that an interruption may come, with no deadline: it drains nothing (a drain stops
    training on the node until its deadline, and a recommendation may never be followed by one)."""
    if status != 200:
        return None
    when = _document(body, dict).get("noticeTime")
    return Notice("aws rebalance recommendation", False, None, f"aws-rebalance:{when}") if when else None


def parse_gce_preempted(status: int, body: str, now: float) -> Notice | None:
    """GCE `instance/preempted`: `TRUE` once preemption began; the deadline is 30 s from `now`,
    the moment it was first read (the caller keeps the first notice: see `decide`)."""
    if status != 200 or body.strip().upper() != "TRUE":
        return None
    return Notice("gce preempted", True, now + GCE_NOTICE_S, "gce:preempted")


def parse_azure_events(status: int, body: str, now: float, vm_name: str | None = None) -> list[Notice]:
    """Azure Scheduled Events: each Preempt event for this VM (all, when its name is unknown).
    A Started event, or one without NotBefore, is due now."""
    if status != 200:
        return []
    notices = []
    events = _document(body, dict).get("Events") or []
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise Malformed(f"Scheduled Events' `Events` is not a list of events: {body[:80]!r}")
    for event in events:
        if event.get("EventType") != "Preempt":
            continue
        resources = event.get("Resources") or []
        if not isinstance(resources, list) or not all(isinstance(r, str) for r in resources):
            raise Malformed(f"Preempt Resources {resources!r} is not a list of VM names")
        if vm_name and resources and vm_name not in resources:
            continue
        not_before = event.get("NotBefore") or ""
        started = event.get("EventStatus") == "Started" or not not_before
        try:  # a number or a list where a date is documented fails in the parser as other types do
            deadline = now if started else parsedate_to_datetime(not_before).timestamp()
        except (TypeError, ValueError, AttributeError) as e:
            raise Malformed(f"Preempt NotBefore {not_before!r} is not an RFC 1123 time") from e
        event_id = str(event.get("EventId"))
        notices.append(Notice("azure Preempt", True, deadline, f"azure:{event_id}:{not_before}", event_id))
    return notices


def decide(notices: list[Notice], acted: set[str], now: float) -> tuple[Drain | None, list[Notice]]:
    """The drain due now and the notices it answers (to be added to `acted`), or (None, []).

    One drain per notice: a notice already acted on drains nothing again. Advice (a rebalance
    recommendation) drains nothing. Several new interruptions at once drain once, with the
    earliest deadline. A deadline already past still drains (with `now`): the node may outlive
    its notice by a little, and Ray then stops scheduling onto it."""
    new = [n for n in notices if n.interrupt and n.key not in acted]
    if not new:
        return None, []
    first = min(new, key=lambda n: n.deadline_s if n.deadline_s is not None else float("inf"))
    deadline = max(first.deadline_s if first.deadline_s is not None else now + GCE_NOTICE_S, now)
    return Drain(deadline, f"{first.source}: the node goes in {deadline - now:.0f} s"), new


def grace_period_s(save_s: float, step_s: float, log_every: int = 1, margin_s: float = 15.0) -> int:
    """A Kubernetes pod's `terminationGracePeriodSeconds` that lets the job save at the step reached
    before the kubelet kills it: workers read a warning at log steps only (a check is a barrier of
    its own), so the log step it is read at can be up to `log_every` steps away (`train.log_every`),
    then a synchronous save, then `margin_s` for Ray's drain to be seen (Ray Train polls drains
    every 5 s) and the node's own stop. Rounded up to 10 s."""
    need = log_every * step_s + save_s + margin_s
    return int(-(-need // 10) * 10)
