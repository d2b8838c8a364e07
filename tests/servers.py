"""Real servers on loopback for the remote-shard tests: moto's S3 server as a process of its own, and an HTTP file
server that honours Range requests (Python's http.server does not), with faults on demand. Both stop by themselves
at the end of their `with` block; every wait is bounded."""

from __future__ import annotations

import email.utils
import hashlib
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

from tests.distributed import free_port

START_TIMEOUT_S = 30.0
CREDENTIALS = {"key": "testing", "secret": "testing"}  # moto accepts any; s3fs needs some


@contextmanager
def moto_server() -> Iterator[str]:
    """moto's standalone S3 server (``python -m moto.server``) on a free loopback port; yields its endpoint URL."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"},
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start on port {port} (exit code {proc.poll()})")
                time.sleep(0.05)
        yield endpoint
    finally:
        proc.kill()
        proc.wait(timeout=10)


def s3_options(endpoint: str, **config) -> dict:
    """storage_options for s3fs against the loopback endpoint (fsspec's convention)."""
    options = {"endpoint_url": endpoint, **CREDENTIALS}
    if config:
        options["config_kwargs"] = config
    return options


class _Handler(BaseHTTPRequestHandler):
    """GET and HEAD of files under the server's root with ETag, Last-Modified, Accept-Ranges and single ranges."""

    server: "RangeHTTPServer"
    protocol_version = "HTTP/1.1"
    _RANGE = re.compile(r"bytes=(\d*)-(\d*)$")

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        fault = self.server.take_fault()
        if fault == "error":
            self._reply(503, b"injected failure", body=body)
            return
        if fault == "stall":
            time.sleep(self.server.stall_s)
        path = os.path.join(self.server.root, self.path.split("?", 1)[0].lstrip("/"))
        if not os.path.isfile(path):
            self._reply(404, b"not found", body=body)
            return
        with open(path, "rb") as f:
            data = f.read()
        st = os.stat(path)
        headers = {
            "ETag": '"' + hashlib.md5(data).hexdigest() + '"',
            "Last-Modified": email.utils.formatdate(st.st_mtime, usegmt=True),
            "Accept-Ranges": "bytes",
        }
        status, start, end = 200, 0, len(data)
        if (match := self._RANGE.match(self.headers.get("Range", ""))) and (match.group(1) or match.group(2)):
            if match.group(1):
                start = int(match.group(1))
                end = min(len(data), int(match.group(2)) + 1) if match.group(2) else len(data)
            else:
                start = max(0, len(data) - int(match.group(2)))
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
        self._reply(status, data[start:end], headers, body)

    def _reply(self, status: int, data: bytes, headers: dict | None = None, body: bool = True) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)
            self.server.count(len(data))


class RangeHTTPServer(ThreadingHTTPServer):
    """Serves ``root`` on loopback; ``fail(n)`` answers the next n requests with 503, ``stall(n, s)`` delays them."""

    daemon_threads = True

    def __init__(self, root: str) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root, self.stall_s, self.bytes_sent = root, 0.0, 0
        self._faults: list[str] = []
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def fail(self, requests: int) -> None:  # fsspec's info() falls back from HEAD to GET: 2 requests a look-up
        with self._lock:
            self._faults += ["error"] * requests

    def stall(self, requests: int, seconds: float) -> None:
        with self._lock:
            self.stall_s = seconds
            self._faults += ["stall"] * requests

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def take_fault(self) -> str | None:
        with self._lock:
            return self._faults.pop(0) if self._faults else None

    def count(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_sent += nbytes


@contextmanager
def http_server(root: str) -> Iterator[RangeHTTPServer]:
    server = RangeHTTPServer(root)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def upload(fs, local_dir: str, bucket: str) -> None:
    """Put every file of ``local_dir`` into ``bucket`` (created) with s3fs."""
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    for name in sorted(os.listdir(local_dir)):
        fs.put_file(os.path.join(local_dir, name), f"{bucket}/{name}")

