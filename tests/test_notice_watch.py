"""The notice watcher (tidal/cluster/notice_watch.py) against a metadata service on 127.0.0.1 that
answers as each cloud documents (tidal/testing/metadata.py): a notice becomes one drain request
with the notice's deadline; advice and withdrawn notices drain nothing twice, and a later real
notice still drains. The drain is recorded here (tests/test_notice_e2e.py drains a real raylet)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from tidal.cluster.notice_watch import Metadata, detect, reader_for, run_watcher, watch
from tidal.testing.metadata import MetadataState, metadata_server
from tidal.testing.processes import wait_for

pytestmark = pytest.mark.slow  # real HTTP servers and threads (a few seconds in all)

POLL_S = 0.05


class Watching:
    def __init__(self, md: MetadataState, cloud: str) -> None:
        self.md, self.drains, self.said = md, [], []
        self.stop = threading.Event()
        reader = reader_for(cloud, Metadata(md.url), 1.0 if cloud == "gcp" else POLL_S)
        self.thread = threading.Thread(target=watch, args=(reader, self.drain, self.said.append, POLL_S, self.stop),
                                       daemon=True)
        self.thread.start()

    def drain(self, deadline_s: float, reason: str) -> tuple[bool, str]:
        self.drains.append((deadline_s, reason))
        return True, ""

    def polls(self, n: int = 3) -> None:
        """Let the watcher read the service at least `n` more times."""
        seen = len(self.md.requests)
        wait_for(f"{n} more reads", lambda: len(self.md.requests) >= seen + n, timeout=10)


@pytest.fixture
def watching(request) -> Iterator[Watching]:
    with metadata_server(request.param) as md:
        w = Watching(md, request.param)
        yield w
        w.stop.set()
        with md.lock:
            md.lock.notify_all()
        w.thread.join(10)


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_each_cloud_is_detected_by_its_own_metadata_service(cloud):
    with metadata_server(cloud) as md:
        assert detect(Metadata(md.url)) == cloud


def test_no_metadata_service_turns_the_watcher_off_saying_so_once(capsys):
    said: list[str] = []
    assert run_watcher(None, None, "auto", "http://127.0.0.1:9", 0.1, said.append) == 0
    assert len(said) == 1 and "off on this node" in said[0]


@pytest.mark.parametrize("watching", ["aws"], indirect=True)
def test_aws_spot_notice_drains_once_with_its_deadline(watching):
    watching.polls()
    assert watching.drains == []
    watching.md.aws_interrupt(in_s=120)
    wait_for("a drain", lambda: watching.drains, timeout=10)
    watching.polls(6)  # the notice stays up: no second drain
    assert len(watching.drains) == 1
    deadline, reason = watching.drains[0]
    assert abs(deadline - (time.time() + 120)) < 5  # whole seconds in AWS's time
    assert "instance-action (terminate)" in reason
    assert ("PUT", "/latest/api/token") in watching.md.requests  # IMDSv2


@pytest.mark.parametrize("watching", ["aws"], indirect=True)
def test_aws_rebalance_alone_drains_nothing_and_the_interruption_after_it_drains(watching):
    watching.md.aws_rebalance()
    watching.polls(6)
    assert watching.drains == []
    assert sum("rebalance recommendation" in s for s in watching.said) == 1
    watching.md.aws_interrupt(in_s=60)
    wait_for("a drain", lambda: watching.drains, timeout=10)
    watching.polls(4)
    assert len(watching.drains) == 1


@pytest.mark.parametrize("watching", ["aws"], indirect=True)
def test_aws_expired_token_is_renewed(watching):
    watching.polls()
    watching.md.tokens.clear()  # every token the watcher holds is refused from now on (401)
    watching.md.aws_interrupt(in_s=60)
    wait_for("a drain", lambda: watching.drains, timeout=10)
    assert sum(r == ("PUT", "/latest/api/token") for r in watching.md.requests) >= 2


@pytest.mark.parametrize("watching", ["gcp"], indirect=True)
def test_gce_preemption_drains_with_thirty_seconds(watching):
    time.sleep(0.3)
    assert watching.drains == []
    noticed = time.time()
    watching.md.gce_preempt()  # answers the watcher's waiting wait_for_change at once
    wait_for("a drain", lambda: watching.drains, timeout=10)
    deadline, reason = watching.drains[0]
    assert noticed + 29 < deadline < time.time() + 30.5
    assert "gce preempted" in reason
    assert any("wait_for_change=true" in path for _, path in watching.md.requests)
    time.sleep(2.5)  # a few more waits, each answered TRUE: no second drain
    assert len(watching.drains) == 1


@pytest.mark.parametrize("watching", ["azure"], indirect=True)
def test_azure_preempt_drains_with_not_before_and_is_acknowledged_at_it(watching):
    other = watching.md.azure_preempt(in_s=600, event_id="OTHER", resources=["someone-else"])
    watching.polls()
    assert watching.drains == [], "an event for another VM"
    event = watching.md.azure_preempt(in_s=3)
    wait_for("a drain", lambda: watching.drains, timeout=10)
    assert abs(watching.drains[0][0] - (time.time() + 3)) < 2  # NotBefore, in whole seconds
    assert watching.md.acks == []  # not before the deadline: an approval would start the eviction
    wait_for("the acknowledgement", lambda: watching.md.acks, timeout=10)
    assert watching.md.acks == [event] and other not in watching.md.acks
    assert len(watching.drains) == 1


@pytest.mark.parametrize("watching", ["azure"], indirect=True)
def test_azure_withdrawn_event_then_a_real_one_each_drain_once(watching):
    """A cancelled Preempt drained once (Tidal's workers then saved once and train on after the
    deadline, tests/test_preemption_rearm.py); the later real one drains again."""
    first = watching.md.azure_preempt(in_s=600, event_id="FIRST")
    wait_for("a drain", lambda: watching.drains, timeout=10)
    watching.md.azure_withdraw(first)
    watching.polls(4)
    assert len(watching.drains) == 1
    watching.md.azure_preempt(in_s=300, event_id="SECOND")
    wait_for("a second drain", lambda: len(watching.drains) == 2, timeout=10)
    watching.polls(4)
    assert len(watching.drains) == 2
    assert abs(watching.drains[1][0] - (time.time() + 300)) < 3


def test_a_drain_that_fails_is_asked_again_at_the_next_poll():
    """The GCS unreachable a moment, then a refusal: the watcher asks again until Ray accepts, then
    no more."""
    calls: list[float] = []

    def flaky(deadline_s: float, reason: str) -> tuple[bool, str]:
        calls.append(deadline_s)
        if len(calls) == 1:
            raise ConnectionError("GCS unreachable")
        return len(calls) > 2, "refused"

    said: list[str] = []
    stop = threading.Event()
    with metadata_server("aws") as md:
        t = threading.Thread(target=watch, args=(reader_for("aws", Metadata(md.url), POLL_S), flaky, said.append,
                                                 POLL_S, stop), daemon=True)
        t.start()
        md.aws_interrupt(in_s=60)
        wait_for("a drain accepted", lambda: len(calls) >= 3, timeout=10)
        seen = len(md.requests)
        wait_for("more reads", lambda: len(md.requests) >= seen + 6, timeout=10)
        stop.set()
        t.join(5)
    assert len(calls) == 3, "asked until accepted, then no more"
    assert any("GCS unreachable" in s for s in said) and any("refused" in s for s in said)


def test_a_metadata_answer_that_is_not_utf8_is_read_not_the_watchers_end():
    """A proxy's page in another encoding is a malformed answer (the readers say so and read again):
    it raised UnicodeDecodeError from the read itself, which the unattended watcher does not outlive."""
    import http.server

    from tidal.cluster.notices import Malformed, parse_aws_instance_action

    class Latin1(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = "<html>Zugriff verweigert: Proxy-Fehler ä</html>".encode("latin-1")
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Latin1)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        status, body, _ = Metadata(f"http://127.0.0.1:{server.server_address[1]}").request("GET", "/")
    finally:
        server.shutdown()
        server.server_close()
    assert status == 200 and "Proxy-Fehler" in body
    with pytest.raises(Malformed):
        parse_aws_instance_action(status, body)


def test_a_metadata_answer_cut_short_is_unreachable_not_the_watchers_end():
    """A body shorter than its Content-Length (the connection dropped): http.client's IncompleteRead is
    no OSError, and it ended the watcher; it is a failed read, tried again at the next poll."""
    import http.server

    from tidal.cluster.notice_watch import Unreachable

    class CutShort(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            self.wfile.write(b'{"action": "termi')
            self.close_connection = True

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), CutShort)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(Unreachable):
            Metadata(f"http://127.0.0.1:{server.server_address[1]}").request("GET", "/")
    finally:
        server.shutdown()
        server.server_close()
