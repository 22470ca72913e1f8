"""Object stores beside S3 for the lease's tests (tidal/exclusive.py), on 127.0.0.1: a GCS JSON
API (gcp-storage-emulator's server, with or without the `ifGenerationMatch=0` precondition GCS
documents for inserts: the emulator ignores it, as some stores do), Azure Blob Storage (Azurite,
Microsoft's emulator, which checks Shared Key signatures and `If-None-Match`) and an S3-compatible store
that ignores `If-None-Match` (moto's server behind a proxy that drops the header, as stores
without conditional writes do). Each in a process of its own, stopped by PID."""

from __future__ import annotations

import contextlib
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

from tidal.testing.processes import (
    free_port,
    listens,
    start_in_session,
    stop_session,
    wait_for_server,
)

# Run in the server's own process: the emulator, its object inserts made to honour GCS's
# documented `ifGenerationMatch=0` ("only if no live object has that name": else 412) when asked.
_GCS_SERVER = r'''
import sys, threading
from http import HTTPStatus
from gcp_storage_emulator import server
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

host, port, honour = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
if honour:
    plain, lock = objects.insert, threading.Lock()

    def insert(request, response, storage, *args, **kwargs):
        match = request.query.get("ifGenerationMatch")
        with lock:
            if match and match[0] == "0" and request.query.get("name"):
                try:
                    storage.get_file_obj(request.params["bucket_name"], request.query["name"][0])
                    response.status = HTTPStatus.PRECONDITION_FAILED
                    return
                except NotFound:
                    pass
            return plain(request, response, storage, *args, **kwargs)

    objects.insert = insert
    for _regex, handlers in server.HANDLERS:
        for method, handler in list(handlers.items()):
            if handler is plain:
                handlers[method] = insert
srv = server.create_server(host, port, in_memory=True, default_bucket="tidal")
srv.start()
print("ready", flush=True)
threading.Event().wait()
'''

# A proxy that forwards every request to an S3 endpoint with `If-None-Match` dropped.
_DROP_PROXY = r'''
import http.client, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

port, upstream = int(sys.argv[1]), sys.argv[2]

class Proxy(BaseHTTPRequestHandler):
    def _forward(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("if-none-match", "host")}
        conn = http.client.HTTPConnection(upstream, timeout=60)
        conn.request(self.command, self.path, body=body or None, headers=headers)
        reply = conn.getresponse()
        data = reply.read()
        self.send_response(reply.status)
        for k, v in reply.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    def log_message(self, *args):
        pass

ThreadingHTTPServer(("127.0.0.1", port), Proxy).serve_forever()
'''


@contextlib.contextmanager
def gcs_server(log: Path, honour_preconditions: bool = True) -> Iterator[str]:
    """A GCS JSON API on 127.0.0.1 with a bucket `tidal`; yields its `host:port`."""
    port = free_port()
    proc = start_in_session([sys.executable, "-c", _GCS_SERVER, "127.0.0.1", str(port),
                             "1" if honour_preconditions else "0"], log)
    try:
        wait_for_server(lambda: listens(port), proc, log, "gcp-storage-emulator", timeout=60)
        yield f"127.0.0.1:{port}"
    finally:
        stop_session(proc, grace_s=5)


@contextlib.contextmanager
def if_none_match_dropped(log: Path, upstream: str) -> Iterator[str]:
    """An S3 endpoint (`http://127.0.0.1:PORT`) in front of `upstream` (`http://host:port`) that
    drops `If-None-Match` from every request: an S3-compatible store that ignores it."""
    port = free_port()
    proc = start_in_session([sys.executable, "-c", _DROP_PROXY, str(port), upstream.split("://", 1)[-1]], log)
    try:
        wait_for_server(lambda: listens(port), proc, log, "the If-None-Match-dropping proxy", timeout=30)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_session(proc, grace_s=5)


def gcs_filesystem(endpoint: str):  # noqa: ANN201 - pyarrow's GcsFileSystem
    """pyarrow's GCS filesystem on a test endpoint, anonymous (the emulator takes no credentials)."""
    import datetime

    import pyarrow.fs as pafs

    return pafs.GcsFileSystem(anonymous=True, endpoint_override=endpoint, scheme="http",
                              retry_time_limit=datetime.timedelta(seconds=5))


# Azurite's documented development account (public: it opens only the emulator).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def azurite_path() -> str | None:
    """Azurite's blob server (`npm install -g azurite`), if installed."""
    return shutil.which("azurite-blob")


@contextlib.contextmanager
def azurite_blob(folder: Path) -> Iterator[str]:
    """Azure Blob Storage's emulator on 127.0.0.1, its data and log under `folder`, with a container
    `tidal`; yields its `host:port`."""
    server = azurite_path()
    if server is None:
        raise RuntimeError("Azurite is not installed: npm install -g azurite")
    port = free_port()
    log = folder / "azurite.log"
    proc = start_in_session([server, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location",
                             str(folder / "azurite"), "--silent", "--skipApiVersionCheck"], log)
    try:
        wait_for_server(lambda: listens(port), proc, log, "Azurite", timeout=60)
        azure_filesystem(f"127.0.0.1:{port}").create_dir("tidal")
        yield f"127.0.0.1:{port}"
    finally:
        stop_session(proc, grace_s=5)


def azure_filesystem(endpoint: str, key: str | None = AZURITE_KEY):  # noqa: ANN201 - pyarrow's AzureFileSystem
    """pyarrow's Azure filesystem on Azurite at `endpoint` with the development account's key (`key`
    None: no key, so Entra ID's credentials would be used)."""
    import pyarrow.fs as pafs

    auth = {"account_key": key} if key else {}
    return pafs.AzureFileSystem(account_name=AZURITE_ACCOUNT, blob_storage_authority=endpoint,
                                dfs_storage_authority=endpoint, blob_storage_scheme="http",
                                dfs_storage_scheme="http", **auth)
