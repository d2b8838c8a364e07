"""Real servers on loopback for the remote-shard tests: moto's S3 server as a process of its own, an HTTP file
server that honours Range requests (Python's http.server does not), with faults on demand, and a TCP proxy that
cuts connections in the middle of a transfer. All stop by themselves at the end of their `with` block; every wait is
bounded."""

from __future__ import annotations

import email.utils
import hashlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

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
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
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
                    raise RuntimeError(f"moto_server did not start on port {port} (exit code {proc.poll()})") from None
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

    server: RangeHTTPServer
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


class CuttingProxy:
    """A TCP proxy on loopback in front of ``port``, forwarding both ways. ``cut(after, down_s)``: once ``after``
    more bytes went from the server to the clients, every connection is closed (the client sees the response end
    early: a payload shorter than its Content-Length) and the port refuses connections for ``down_s`` seconds (the
    listening socket is closed), as when a server goes down in the middle of a transfer. ``hold()``: from then on
    no answer reaches a client (a server that never answers); ``withheld`` counts the bytes kept back."""

    def __init__(self, port: int) -> None:
        self.target = ("127.0.0.1", port)
        self._listener: socket.socket | None = None
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._budget: int | None = None  # bytes to forward to clients before the cut; None: not armed
        self._down_s, self._stopped, self._holding, self.cuts, self.withheld = 0.0, False, False, 0, 0
        self._open(0)
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _open(self, port: int) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the port again, after the outage
        listener.bind(("127.0.0.1", port))
        listener.listen(64)
        listener.settimeout(0.05)
        self._listener = listener

    def cut(self, after: int, down_s: float) -> None:
        with self._lock:
            self._budget, self._down_s = after, down_s

    def hold(self) -> None:
        with self._lock:
            self._holding = True

    def _accept(self) -> None:
        while not self._stopped:
            listener = self._listener
            if listener is None:  # down
                time.sleep(0.01)
                continue
            try:
                client, _ = listener.accept()
            except OSError:  # a timeout, or the listener closed by a cut
                continue
            client.settimeout(None)
            try:
                server = socket.create_connection(self.target, timeout=START_TIMEOUT_S)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._connections |= {client, server}
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, to_client: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                cut = False
                if to_client:
                    with self._lock:
                        if self._holding:
                            self.withheld += len(data)
                            continue
                        if self._budget is not None:
                            data, cut = data[: self._budget], len(data) >= self._budget
                            self._budget -= len(data)
                dst.sendall(data)
                if cut:
                    self._go_down()
                    return
        except OSError:  # the other direction closed the pair
            pass
        finally:
            self._close(src, dst)

    def _close(self, *sockets: socket.socket) -> None:
        with self._lock:
            for sock in sockets:
                self._connections.discard(sock)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def _go_down(self) -> None:
        with self._lock:
            self._budget, self.cuts = None, self.cuts + 1
            listener, self._listener = self._listener, None
            connections, self._connections = list(self._connections), set()
        listener.close()
        self._close(*connections)
        timer = threading.Timer(self._down_s, self._reopen)
        timer.daemon = True
        timer.start()

    def _reopen(self) -> None:
        with self._lock:
            if not self._stopped:
                self._open(self.port)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
        self._thread.join(timeout=10)
        with self._lock:
            listener, self._listener = self._listener, None
            connections = list(self._connections)
        if listener is not None:
            listener.close()
        self._close(*connections)


@contextmanager
def cutting_proxy(port: int) -> Iterator[CuttingProxy]:
    proxy = CuttingProxy(port)
    try:
        yield proxy
    finally:
        proxy.stop()
