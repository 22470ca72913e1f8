"""`tidal cluster watch-notices`: a node-local watcher that reads this instance's cloud metadata
service for an interruption notice and drains this Ray node with the notice's deadline, so that
the job's emergency checkpoint runs before the node goes (Ray's autoscaler drains a node on none of
the clouds' notices: without this the node just disappears, a node loss).

Started with each node by the shipped cluster configs, after `ray start`. Where no metadata
service answers (on-prem, a laptop), it says so once and exits: it costs nothing there.

Written by hand: Ray, boto3 and the Google/Azure SDKs read instance metadata, but none watches for
these notices (the AWS Node Termination Handler and GKE's node shutdown handler do it for
Kubernetes nodes, not Ray's); urllib from the standard library is all it needs.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from tidal.cluster.notices import (
    CLOUDS,
    Cloud,
    Malformed,
    Notice,
    decide,
    parse_aws_instance_action,
    parse_aws_rebalance,
    parse_azure_events,
    parse_gce_preempted,
)

IMDS = "http://169.254.169.254"  # the same link-local address on AWS, GCE and Azure
ENDPOINT_ENV = "TIDAL_METADATA_ENDPOINT"  # another address, for tests (a server on 127.0.0.1)
AZURE_API = "api-version=2020-07-01"
AWS_TOKEN_TTL_S = 21600


class Unreachable(Exception):
    """No answer from the metadata service (not even an HTTP error)."""


class Metadata:
    """HTTP to the metadata service: (status, body, headers); an HTTP error status is an answer."""

    def __init__(self, base: str = IMDS, timeout_s: float = 2.0) -> None:
        self.base, self.timeout_s = base.rstrip("/"), timeout_s

    def request(self, method: str, path: str, headers: dict[str, str] | None = None, body: bytes | None = None,
                timeout_s: float | None = None) -> tuple[int, str, dict[str, str]]:
        req = urllib.request.Request(self.base + path, data=body, method=method, headers=headers or {})
        # The metadata service is link-local: a proxy from the environment must not carry it.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(req, timeout=timeout_s or self.timeout_s) as r:
                return r.status, r.read().decode(errors="replace"), dict(r.headers)  # a proxy's page: Malformed
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace"), dict(e.headers or {})
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:  # IncompleteRead: a body cut short
            raise Unreachable(f"{method} {self.base}{path}: {getattr(e, 'reason', e)}") from e


class AwsReader:
    """IMDSv2: a session token (PUT /latest/api/token), renewed when refused (401)."""

    cloud: Cloud = "aws"

    def __init__(self, meta: Metadata) -> None:
        self.meta, self.token = meta, ""

    def _token(self) -> str:
        status, body, _ = self.meta.request("PUT", "/latest/api/token",
                                            {"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)})
        if status != 200:
            raise Unreachable(f"IMDSv2 token: HTTP {status}")
        return body.strip()

    def _get(self, path: str) -> tuple[int, str]:
        for _ in range(2):
            self.token = self.token or self._token()
            status, body, _ = self.meta.request("GET", path, {"X-aws-ec2-metadata-token": self.token})
            if status != 401:
                return status, body
            self.token = ""  # expired: one new token, once
        return status, body

    def read(self, now: float) -> list[Notice]:
        found = [parse_aws_instance_action(*self._get("/latest/meta-data/spot/instance-action")),
                 parse_aws_rebalance(*self._get("/latest/meta-data/events/recommendations/rebalance"))]
        return [n for n in found if n is not None]


class GceReader:
    """`instance/preempted?wait_for_change=true`: the answer comes when the value changes (or after
    `timeout_sec`), so the read itself is the wait between polls."""

    cloud: Cloud = "gcp"

    def __init__(self, meta: Metadata, poll_s: float) -> None:
        self.meta, self.poll_s, self.etag = meta, poll_s, ""
        self.first_seen: float | None = None

    def read(self, now: float) -> list[Notice]:
        wait = max(1, int(self.poll_s))
        path = "/computeMetadata/v1/instance/preempted"  # the first read: the value now, without waiting
        if self.etag:
            path += f"?wait_for_change=true&timeout_sec={wait}&last_etag={self.etag}"
        status, body, headers = self.meta.request("GET", path, {"Metadata-Flavor": "Google"}, timeout_s=wait + 5)
        self.etag = headers.get("ETag", headers.get("etag", self.etag))
        notice = parse_gce_preempted(status, body, time.time())
        if notice is None:
            return []
        self.first_seen = self.first_seen or notice.deadline_s  # the 30 s run from the first sight
        return [Notice(notice.source, True, self.first_seen, notice.key)]


class AzureReader:
    """Scheduled Events; this VM's name read once, to keep only its own events."""

    cloud: Cloud = "azure"

    def __init__(self, meta: Metadata) -> None:
        self.meta = meta
        self.vm_name: str | None = None
        status, body, _ = meta.request("GET", "/metadata/instance/compute/name?api-version=2021-02-01&format=text",
                                       {"Metadata": "true"})
        if status == 200:
            self.vm_name = body.strip() or None

    def read(self, now: float) -> list[Notice]:
        status, body, _ = self.meta.request("GET", f"/metadata/scheduledevents?{AZURE_API}", {"Metadata": "true"})
        return parse_azure_events(status, body, now, self.vm_name)

    def ack(self, event_id: str) -> None:
        """Approve the event; Unreachable when the service did not take it (the watcher asks again)."""
        body = json.dumps({"StartRequests": [{"EventId": event_id}]}).encode()
        status, text, _ = self.meta.request("POST", f"/metadata/scheduledevents?{AZURE_API}",
                                            {"Metadata": "true", "Content-Type": "application/json"}, body)
        if not 200 <= status < 300:
            raise Unreachable(f"acknowledging event {event_id}: HTTP {status} {text[:80]}")


def detect(meta: Metadata) -> Cloud | None:
    """Which cloud's metadata service answers here, each asked as it documents (None: no cloud)."""
    probes: dict[Cloud, tuple[str, str, dict[str, str]]] = {
        "aws": ("PUT", "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "60"}),
        "gcp": ("GET", "/computeMetadata/v1/instance/id", {"Metadata-Flavor": "Google"}),
        "azure": ("GET", "/metadata/instance?api-version=2021-02-01", {"Metadata": "true"}),
    }
    for cloud in CLOUDS:
        method, path, headers = probes[cloud]
        try:
            status, _, answer = meta.request(method, path, headers, timeout_s=1.0)
        except Unreachable:
            return None  # nothing listens: no cloud at all, no need to ask the others
        if status == 200 and (cloud != "gcp" or answer.get("Metadata-Flavor") == "Google"):
            return cloud
    return None


def reader_for(cloud: Cloud, meta: Metadata, poll_s: float) -> Any:
    return {"aws": lambda: AwsReader(meta), "gcp": lambda: GceReader(meta, poll_s),
            "azure": lambda: AzureReader(meta)}[cloud]()


def watch(reader: Any, drain: Callable[[float, str], tuple[bool, str]], say: Callable[[str], None],
          poll_s: float, stop: threading.Event) -> None:
    """Poll until `stop`: each new interruption drains the node once, with its deadline; advice
    (a rebalance recommendation) is said once and drains nothing; an Azure event is acknowledged
    at its deadline (the job has saved by then: approving it earlier would shorten the warning).
    No answer, a malformed one or a failed acknowledgement ends nothing: the watcher runs unattended
    (under nohup, never restarted), so it says so once and tries again at the next poll."""
    acted: set[str] = set()
    advised: set[str] = set()
    acks: dict[str, float] = {}
    failing = ack_failing = False
    while not stop.is_set():
        now = time.time()
        try:
            notices = reader.read(now)
        except (Unreachable, Malformed) as e:
            if not failing:
                what = "cannot read" if isinstance(e, Unreachable) else "got a malformed answer from"
                say(f"{what} the metadata service ({e}); retrying every {poll_s:g} s")
            failing = True
            stop.wait(poll_s)
            continue
        failing = False
        for n in notices:
            if not n.interrupt and n.key not in advised:
                advised.add(n.key)
                say(f"{n.source}: advice without a deadline, no drain; an interruption that follows drains the node")
        due, answered = decide(notices, acted, now)
        if due is not None:
            try:
                accepted, why = drain(due.deadline_s, due.reason)
            except Exception as e:  # noqa: BLE001 - the GCS unreachable a moment: ask again at the next poll
                accepted, why = False, f"{type(e).__name__}: {e}"
            if accepted:
                acted.update(n.key for n in answered)
                acks.update({n.event_id: due.deadline_s for n in answered if n.event_id})
                say(f"{due.reason}: drained this Ray node; its jobs save an emergency checkpoint at the step reached")
            else:
                say(f"{due.reason}: Ray refused the drain ({why}); asking again at the next poll")
        for event_id, at in list(acks.items()):
            if now >= at and hasattr(reader, "ack"):
                try:
                    reader.ack(event_id)
                except Unreachable as e:  # the eviction starts at NotBefore anyway; asked again next poll
                    if not ack_failing:
                        say(f"could not acknowledge {event_id} ({e}); retrying every {poll_s:g} s")
                    ack_failing = True
                    continue
                ack_failing = False
                del acks[event_id]
        # GCE's read waits for a change itself (about poll_s); a read that answered at once does not.
        stop.wait(max(0.0, poll_s - (time.time() - now)))


def run_watcher(address: str | None, node_id: str | None, cloud: str, endpoint: str | None, poll_s: float,
                say: Callable[[str], None], stop: threading.Event | None = None) -> int:
    """The command: find the cloud (or none: say so once, exit 0), this node, then watch."""
    from tidal.cluster.self_drain import drainer, gcs_address, this_node_id

    meta = Metadata(endpoint or os.environ.get(ENDPOINT_ENV) or IMDS)
    found = detect(meta) if cloud == "auto" else cloud
    if found is None:
        say(f"no cloud metadata service answers at {meta.base}: the notice watcher is off on this node")
        return 0
    address = gcs_address(address)
    node = this_node_id(address, node_id)
    say(f"watching {found}'s interruption notices at {meta.base} every {poll_s:g} s for Ray node {node}")
    watch(reader_for(found, meta, poll_s), drainer(address, node), say, poll_s, stop or threading.Event())  # type: ignore[arg-type]
    return 0
