"""Helpers for the serving tests (tests/test_serve_*.py): a `dflash27b serve` process on the bundled tiny pair,
loopback only, and small raw HTTP / socket clients with bounded waits."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

API_KEY = "test-key-123"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    """A running `dflash27b serve` on a Unix socket and 127.0.0.1:port."""
    proc: subprocess.Popen
    sock: str
    port: int
    api_key: str | None = None
    stderr_path: Path | None = None
    _closed: bool = field(default=False, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def headers(self, **extra) -> dict:
        h = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return {**h, **extra}

    def post(self, path: str, body, timeout: float = 60, **kw):
        import httpx
        return httpx.post(self.url + path, json=body, headers=self.headers(), timeout=timeout, **kw)

    def get(self, path: str, timeout: float = 30, **kw):
        import httpx
        return httpx.get(self.url + path, headers=self.headers(), timeout=timeout, **kw)

    def health(self) -> dict:
        """The daemon's full health, over the socket (always complete there)."""
        return socket_request(self.sock, {"op": "health"})[-1]

    def stderr(self) -> str:
        return self.stderr_path.read_text() if self.stderr_path else ""

    def stop(self, timeout: float = 20) -> None:
        if self._closed:
            return
        self._closed = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def serve(tmp: Path, *args: str, http: bool = True, api_key: str | None = None, ctx: int = 1024,
          env: dict | None = None, wait: bool = True) -> Served:
    """Start `dflash27b serve` on the bundled pair (one decode thread) and wait until it answers."""
    sock = str(tmp / f"d{os.getpid()}-{time.monotonic_ns() % 10**9}.sock")
    port = free_port()
    cmd = [sys.executable, "-m", "dflash27b.cli", "serve", "--socket", sock, "-c", str(ctx), "-t", "1", *args]
    if http:
        cmd += ["--http", f"127.0.0.1:{port}"]
    if api_key:
        cmd += ["--api-key", api_key]
    err = tmp / f"stderr-{port}.log"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(err, "wb"),
                            env={**os.environ, **(env or {})})
    s = Served(proc, sock, port, api_key, err)
    if wait:
        wait_ready(s)
    return s


def wait_ready(s: Served, timeout: float = 60) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if s.proc.poll() is not None:
            raise RuntimeError(f"daemon exited ({s.proc.returncode}): {s.stderr()}")
        if os.path.exists(s.sock):
            try:
                if socket_request(s.sock, {"op": "health"}, timeout=5)[-1].get("event") == "health":
                    return
            except OSError:
                pass
        time.sleep(0.05)
    raise RuntimeError("daemon did not come up")


TERMINAL = ("done", "error", "health", "shutdown")


def socket_request(path: str, *reqs, raw: bytes | None = None, timeout: float = 30) -> list[dict]:
    """Send requests (or raw bytes) on one connection; read events until as many terminal events."""
    payload = raw if raw is not None else b"".join(json.dumps(r).encode() + b"\n" for r in reqs)
    want = len(reqs) if raw is None else payload.count(b"\n")
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(timeout)
    try:
        s.connect(path)
        s.sendall(payload)
        out, done = [], 0
        for line in s.makefile("rb"):
            ev = json.loads(line)
            out.append(ev)
            if ev.get("event") in TERMINAL:
                done += 1
                if done == want:
                    break
        return out
    finally:
        s.close()


def raw_http(port: int, data: bytes, timeout: float = 10, close_after: bool = False) -> bytes:
    """Write raw bytes to 127.0.0.1:port; read until the server closes (or `timeout`)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        s.sendall(data)
        if close_after:
            return b""
        out = b""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                break
            if not chunk:
                break
            out += chunk
            if b"\r\n\r\n" in out and _complete(out):
                break
        return out
    finally:
        s.close()


def _complete(resp: bytes) -> bool:
    head, _, body = resp.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False


def status_of(resp: bytes) -> int:
    return int(resp.split(b" ", 2)[1]) if resp.startswith(b"HTTP/") else 0


def body_json(resp: bytes) -> dict:
    return json.loads(resp.partition(b"\r\n\r\n")[2])


def iter_sse(lines):
    """The JSON objects of an SSE stream's `data:` lines ([DONE] as the string "[DONE]"), as they come."""
    for line in lines:
        line = line.strip()
        if line.startswith("data: "):
            data = line[6:]
            yield data if data == "[DONE]" else json.loads(data)


def sse_events(lines) -> list:
    return list(iter_sse(lines))
