"""Each cloud's interruption notice, parsed from the payload its documentation shows, and the one
decision on it (tidal/cluster/notices.py): drain now with the notice's deadline, once per notice;
advice drains nothing. Pure functions: no network, no Ray."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from tidal.cluster.notices import (
    GCE_NOTICE_S,
    Notice,
    decide,
    grace_period_s,
    parse_aws_instance_action,
    parse_aws_rebalance,
    parse_azure_events,
    parse_gce_preempted,
)

T0 = datetime(2017, 9, 18, 8, 22, 0, tzinfo=UTC).timestamp()

# AWS's documented examples (EC2 User Guide, "Spot Instance interruption notices" and "rebalance
# recommendations"): the time is UTC, ISO 8601, whole seconds, with a Z.
AWS_ACTIONS = [
    (404, "", None),
    (200, '{"action": "terminate", "time": "2017-09-18T08:22:00Z"}', ("aws spot instance-action (terminate)", T0)),
    (200, '{"action": "stop", "time": "2017-09-18T08:22:00Z"}', ("aws spot instance-action (stop)", T0)),
    (200, '{"action": "hibernate", "time": "2017-09-18T08:22:00Z"}', ("aws spot instance-action (hibernate)", T0)),
]


@pytest.mark.parametrize("status, body, want", AWS_ACTIONS)
def test_aws_instance_action(status, body, want):
    n = parse_aws_instance_action(status, body)
    if want is None:
        assert n is None
    else:
        assert (n.source, n.deadline_s, n.interrupt) == (*want, True)


def test_aws_rebalance_is_advice_without_deadline():
    assert parse_aws_rebalance(404, "") is None
    n = parse_aws_rebalance(200, '{"noticeTime": "2020-10-27T08:22:00Z"}')
    assert n is not None and not n.interrupt and n.deadline_s is None


@pytest.mark.parametrize("status, body, notice", [(200, "TRUE", True), (200, "FALSE", False), (200, "TRUE\n", True),
                                                  (503, "", False)])
def test_gce_preempted_gives_thirty_seconds_from_the_first_sight(status, body, notice):
    n = parse_gce_preempted(status, body, now=1000.0)
    assert (n is not None) == notice
    if n:
        assert n.deadline_s == 1000.0 + GCE_NOTICE_S


# Azure's documented document (Scheduled Events, api-version 2020-07-01), with a Freeze for another
# VM and a Preempt for this one.
AZURE_DOC = {
    "DocumentIncarnation": 3,
    "Events": [
        {"EventId": "F1", "EventStatus": "Scheduled", "EventType": "Freeze", "ResourceType": "VirtualMachine",
         "Resources": ["vm-a"], "NotBefore": "Mon, 18 Sep 2017 08:22:00 GMT", "Description": "",
         "EventSource": "Platform", "DurationInSeconds": 9},
        {"EventId": "P1", "EventStatus": "Scheduled", "EventType": "Preempt", "ResourceType": "VirtualMachine",
         "Resources": ["vm-a"], "NotBefore": "Mon, 18 Sep 2017 08:22:00 GMT", "Description": "",
         "EventSource": "Platform", "DurationInSeconds": -1},
        {"EventId": "P2", "EventStatus": "Started", "EventType": "Preempt", "ResourceType": "VirtualMachine",
         "Resources": ["vm-b"], "NotBefore": "", "Description": "", "EventSource": "Platform",
         "DurationInSeconds": -1},
    ],
}


@pytest.mark.parametrize("vm, want", [
    ("vm-a", [("P1", T0)]),
    ("vm-b", [("P2", 500.0)]),  # started: due now
    (None, [("P1", T0), ("P2", 500.0)]),  # name unknown: every Preempt
    ("vm-c", []),
])
def test_azure_preempt_events_for_this_vm(vm, want):
    got = parse_azure_events(200, json.dumps(AZURE_DOC), now=500.0, vm_name=vm)
    assert [(n.event_id, n.deadline_s) for n in got] == want


def test_azure_no_events():
    assert parse_azure_events(200, '{"DocumentIncarnation": 1, "Events": []}', now=0.0) == []


def _n(key: str, deadline: float | None, interrupt: bool = True) -> Notice:
    return Notice(key, interrupt, deadline, key)


@pytest.mark.parametrize("notices, acted, want_deadline, want_keys", [
    ([], set(), None, []),
    ([_n("advice", None, interrupt=False)], set(), None, []),  # a rebalance recommendation drains nothing
    ([_n("a", 200.0)], set(), 200.0, ["a"]),
    ([_n("a", 200.0)], {"a"}, None, []),  # read again at the next poll: no second drain
    ([_n("a", 200.0), _n("b", 150.0)], set(), 150.0, ["a", "b"]),  # two at once: one drain, the earlier deadline
    ([_n("a", 50.0)], set(), 100.0, ["a"]),  # already past: drain now all the same
    ([_n("a", 200.0), _n("a2", 260.0)], {"a"}, 260.0, ["a2"]),  # a new deadline for the same event: a new warning
])
def test_decide_one_drain_per_notice(notices, acted, want_deadline, want_keys):
    drain, answered = decide(notices, acted, now=100.0)
    assert (drain.deadline_s if drain else None) == want_deadline
    assert [n.key for n in answered] == want_keys


@pytest.mark.parametrize("save_s, step_s, want", [(5.0, 1.0, 30), (60.0, 2.0, 80), (0.1, 0.1, 20)])
def test_grace_period_covers_a_step_a_save_and_the_margin(save_s, step_s, want):
    assert grace_period_s(save_s, step_s) == want
    assert grace_period_s(save_s, step_s) >= save_s + step_s + 15


@pytest.mark.parametrize("config, cloud", [("aws-burst.yaml", "aws"), ("gcp-burst.yaml", "gcp"), ("azure-burst.yaml", "azure")])
def test_cloud_configs_start_the_watcher_after_ray_on_every_worker(config, cloud):
    import yaml

    from tests.conftest import ROOT

    commands = yaml.safe_load((ROOT / "cluster_configs" / config).read_text())["worker_start_ray_commands"]
    starts = [i for i, c in enumerate(commands) if "ray start" in c]
    watches = [i for i, c in enumerate(commands) if "tidal cluster watch-notices" in c]
    assert starts and watches and watches[0] > starts[-1], commands
    watcher = commands[watches[0]]
    assert f"--cloud {cloud}" in watcher and "RAY_AUTH_MODE=token" in watcher and watcher.rstrip().endswith("&")


class Scripted:
    """A reader whose answers a test writes: each call takes the next (a list of notices, or an
    exception to raise); the last one repeats. Acknowledgements fail while `ack_fails` > 0."""

    def __init__(self, answers, ack_fails: int = 0) -> None:
        self.answers, self.reads, self.acks, self.ack_fails = list(answers), 0, [], ack_fails

    def read(self, now):
        self.reads += 1
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    def ack(self, event_id):
        if self.ack_fails > 0:
            self.ack_fails -= 1
            from tidal.cluster.notice_watch import Unreachable

            raise Unreachable("POST scheduledevents: connection reset")
        self.acks.append(event_id)


def run_watch(reader, until, timeout_s: float = 10.0):
    import threading
    import time

    from tidal.cluster.notice_watch import watch

    drains, said, stop = [], [], threading.Event()
    t = threading.Thread(target=watch, args=(reader, lambda d, r: (drains.append(d) or True, ""), said.append, 0.01,
                                             stop), daemon=True)
    t.start()
    deadline = time.time() + timeout_s
    while not until(drains) and time.time() < deadline and t.is_alive():
        time.sleep(0.01)
    alive = t.is_alive()
    stop.set()
    t.join(5)
    return drains, said, alive


def test_one_malformed_answer_from_the_metadata_service_does_not_end_the_watcher():
    import time

    from tidal.cluster.notices import parse_aws_instance_action

    notice = Notice("aws spot instance-action (terminate)", True, time.time() + 120, "aws:t")
    bad = [lambda: parse_aws_instance_action(200, "<html>proxy error</html>"),
           lambda: parse_azure_events(200, '["not", "a", "document"]', 0.0)]
    for malformed in bad:
        try:
            malformed()
            raise AssertionError("a malformed 200 parsed")
        except Exception as e:  # noqa: BLE001 - whatever it raises is what the watcher meets
            error = e
        reader = Scripted([error, error, [notice]])
        drains, said, alive = run_watch(reader, lambda d: d)
        assert alive and len(drains) == 1, "it kept watching and drained at the notice after"
        assert sum("metadata service" in s for s in said) == 1, "said once"


@pytest.mark.parametrize("body", [
    '{"Events": [{"EventType": "Preempt", "NotBefore": 1700000000}]}',  # a number where a date was documented
    '{"Events": [{"EventType": "Preempt", "Resources": 7, "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT"}]}',
    '{"Events": [{"EventType": "Preempt", "Resources": [["vm"]], "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT"}]}',
])
def test_an_azure_event_with_fields_of_another_type_is_malformed_not_the_watchers_end(body):
    """The watcher goes on past Malformed only: any other error from a parser ends it for good."""
    from tidal.cluster.notices import Malformed

    with pytest.raises(Malformed):
        parse_azure_events(200, body, 0.0, vm_name="vm")


def test_a_failed_azure_acknowledgement_is_retried_and_the_watcher_keeps_watching():
    import time

    first = Notice("azure Preempt", True, time.time(), "azure:A", "A")
    later = Notice("azure Preempt", True, time.time(), "azure:B", "B")
    reader = Scripted([[first]] * 3 + [[first, later]], ack_fails=2)
    drains, said, alive = run_watch(reader, lambda d: len(d) == 2 and reader.acks == ["A", "B"])
    assert alive and len(drains) == 2 and reader.acks == ["A", "B"]
    assert sum("acknowledge" in s for s in said) == 1, "said once"


@pytest.mark.parametrize("save_s, step_s, log_every, want", [(20.0, 2.0, 10, 60), (5.0, 1.0, 1, 30), (5.0, 1.0, 50, 70)])
def test_grace_period_covers_the_steps_to_the_next_log_step_where_warnings_are_read(save_s, step_s, log_every, want):
    """Workers read a warning at log steps only (worker/plan.py: Due.may_check_preemption): one that
    lands just after a log step waits up to `train.log_every` steps before the save starts."""
    assert grace_period_s(save_s, step_s, log_every) == want
    assert grace_period_s(save_s, step_s, log_every) >= save_s + log_every * step_s + 15
