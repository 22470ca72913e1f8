"""A cloud instance metadata service on 127.0.0.1 that answers as AWS, GCE or Azure document it, for
the interruption-notice watcher (tidal/cluster/notice_watch.py): no cloud is reachable here.

    with metadata_server("aws") as md:          # md.url: point the watcher at it (--endpoint)
        md.aws_interrupt(in_s=20)               # spot/instance-action: terminate in 20 s
        ...; md.requests                        # what the watcher asked, in order

Each server answers as one cloud only (the others' paths are 404, as on that cloud), so that the
watcher's detection is tested too. AWS: IMDSv2 only (a GET without a valid token is 401).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit


class MetadataState:
    """What the service says now; the test changes it while the watcher polls."""

    def __init__(self, cloud: str) -> None:
        self.cloud = cloud
        self.lock = threading.Condition()
        self.tokens: set[str] = set()
        self.instance_action: dict[str, str] | None = None
        self.rebalance: dict[str, str] | None = None
        self.preempted = False
        self.events: list[dict[str, Any]] = []
        self.incarnation = 1
        self.vm_name = "tidal-worker-1"
        self.requests: list[tuple[str, str]] = []
        self.acks: list[str] = []
        self.url = ""

    # --- what a test announces, as each cloud writes it ---
    def aws_interrupt(self, in_s: float, action: str = "terminate") -> None:
        when = datetime.fromtimestamp(time.time() + in_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        with self.lock:
            self.instance_action = {"action": action, "time": when}

    def aws_rebalance(self) -> None:
        with self.lock:
            self.rebalance = {"noticeTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}

    def gce_preempt(self) -> None:
        with self.lock:
            self.preempted = True
            self.lock.notify_all()  # answers a waiting wait_for_change at once

    def azure_preempt(self, in_s: float, event_id: str = "A123BC45-1234-5678-AB90-ABCDEF123456",
                      resources: list[str] | None = None) -> str:
        with self.lock:
            self.events.append({
                "EventId": event_id, "EventStatus": "Scheduled", "EventType": "Preempt",
                "ResourceType": "VirtualMachine", "Resources": resources or [self.vm_name],
                "NotBefore": formatdate(time.time() + in_s, usegmt=True), "Description": "",
                "EventSource": "Platform", "DurationInSeconds": -1,
            })
            self.incarnation += 1
        return event_id

    def azure_withdraw(self, event_id: str) -> None:
        with self.lock:
            self.events = [e for e in self.events if e["EventId"] != event_id]
            self.incarnation += 1


class _Handler(BaseHTTPRequestHandler):
    state: MetadataState

    def log_message(self, *args: Any) -> None:  # quiet: the test reads `requests`
        pass

    def _answer(self, status: int, body: str = "", headers: dict[str, str] | None = None) -> None:
        data = body.encode()
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_PUT(self) -> None:  # noqa: N802 - http.server's name
        s, url = self.state, urlsplit(self.path)
        s.requests.append(("PUT", self.path))
        if s.cloud == "aws" and url.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            token = secrets.token_hex(8)
            s.tokens.add(token)
            return self._answer(200, token)
        return self._answer(404 if s.cloud != "aws" else 400)

    def do_POST(self) -> None:  # noqa: N802
        s, url = self.state, urlsplit(self.path)
        s.requests.append(("POST", self.path))
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if s.cloud == "azure" and url.path == "/metadata/scheduledevents" and self.headers.get("Metadata") == "true":
            for start in json.loads(body).get("StartRequests", []):
                s.acks.append(start["EventId"])
                s.azure_withdraw(start["EventId"])  # an approved event starts: it leaves the document
            return self._answer(200)
        return self._answer(404)

    def do_GET(self) -> None:  # noqa: N802
        s, url = self.state, urlsplit(self.path)
        s.requests.append(("GET", self.path))
        query = parse_qs(url.query)
        if s.cloud == "aws":
            return self._aws(url.path)
        if s.cloud == "gcp":
            return self._gce(url.path, query)
        return self._azure(url.path)

    def _aws(self, path: str) -> None:
        s = self.state
        if self.headers.get("X-aws-ec2-metadata-token") not in s.tokens:
            return self._answer(401)
        with s.lock:
            doc = {"/latest/meta-data/spot/instance-action": s.instance_action,
                   "/latest/meta-data/events/recommendations/rebalance": s.rebalance}.get(path)
        return self._answer(200, json.dumps(doc)) if doc else self._answer(404)

    def _gce(self, path: str, query: dict[str, list[str]]) -> None:
        s = self.state
        if self.headers.get("Metadata-Flavor") != "Google":
            return self._answer(403)
        flavor = {"Metadata-Flavor": "Google"}
        if path == "/computeMetadata/v1/instance/id":
            return self._answer(200, "4567890123456789", flavor)
        if path != "/computeMetadata/v1/instance/preempted":
            return self._answer(404, "", flavor)
        if query.get("wait_for_change") == ["true"]:
            # Answer when the value differs from the caller's last etag (without one: from the
            # value when asked), or at timeout_sec, as GCE documents.
            timeout = float((query.get("timeout_sec") or ["60"])[0])
            with s.lock:
                last = (query.get("last_etag") or [_etag(s.preempted)])[0]
                s.lock.wait_for(lambda: last != _etag(s.preempted), timeout=timeout)
        value = s.preempted
        return self._answer(200, "TRUE" if value else "FALSE", flavor | {"ETag": _etag(value)})

    def _azure(self, path: str) -> None:
        s = self.state
        if self.headers.get("Metadata") != "true":
            return self._answer(400)
        if path == "/metadata/instance":
            return self._answer(200, json.dumps({"compute": {"name": s.vm_name}}))
        if path == "/metadata/instance/compute/name":
            return self._answer(200, s.vm_name)
        if path == "/metadata/scheduledevents":
            with s.lock:
                doc = {"DocumentIncarnation": s.incarnation, "Events": list(s.events)}
            return self._answer(200, json.dumps(doc))
        return self._answer(404)


def _etag(value: bool) -> str:
    return "e1" if value else "e0"


@contextlib.contextmanager
def metadata_server(cloud: str) -> Iterator[MetadataState]:
    """A metadata service for `cloud` ("aws", "gcp", "azure") on a free port of 127.0.0.1; its
    state (with `.url`) for the block."""
    state = MetadataState(cloud)
    handler = type("Handler", (_Handler,), {"state": state})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        with state.lock:
            state.lock.notify_all()
        server.shutdown()
        server.server_close()
