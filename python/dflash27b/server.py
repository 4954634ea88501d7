"""The resident daemon: the listening sockets (bound before the models load), the newline-delimited JSON
socket protocol and the start-up/shutdown of the whole service.

Clients write one JSON object per line and read events, one JSON object per line, until a terminal event
(`done` or `error`, or the reply to `health`/`shutdown`).  The protocol is written down in docs/PROTOCOL.md;
requests are parsed and validated by serve_protocol.py and decoded by decode_service.py (one worker thread
owns the Decoder), which the HTTP front (http_api.py) shares.  The asyncio loop owns the sockets, answers
`health` and notices disconnects while the worker decodes.
"""
from __future__ import annotations

import asyncio
import errno
import json
import os
import select
import signal
import socket
import stat
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Callable

from ._lib import DFlashError
from .decoder import Decoder
from .serve_protocol import (CLIENT_GONE, DEFAULT_MAX_BODY, INTERNAL, PROTOCOL_VERSION, RequestError, SHUTDOWN,
                             event_error, parse_generate, parse_off_loop)
from .decode_service import DecodeService, Job

def _rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# -- listening sockets, bound before the models load ------------------------------------------------------------

def check_socket_free(path: str) -> None:
    """Raise if `path` cannot become our socket (a live daemon serves there, or it is another kind of
    file).  A stale socket is left for claim_socket to replace."""
    if len(os.fsencode(path)) >= 104:  # sun_path is 104-108 bytes depending on the OS
        raise DFlashError(f"socket path is too long for a Unix socket ({len(path)} bytes): {path}")
    if not os.path.lexists(path):
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise DFlashError(f"cannot create socket {path}: directory {parent} does not exist")
        return
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise DFlashError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return  # stale: left by a daemon that died
    except OSError as e:
        raise DFlashError(f"{path}: cannot tell whether a daemon is serving there ({e})") from None
    finally:
        probe.close()
    raise DFlashError(f"another dflash27b daemon is already serving on {path}")


def claim_socket(path: str) -> socket.socket:
    """Bind a listening Unix socket at `path`, mode 0600.  A live daemon on the path is refused; a stale
    socket file (nobody listening) is replaced; any other file is never touched."""
    check_socket_free(path)
    if os.path.lexists(path):
        os.unlink(path)  # stale
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the file is created 0600: no window where others could connect
    try:
        sock.bind(path)
    except OSError as e:
        sock.close()
        raise DFlashError(f"cannot create socket {path}: {e.strerror}") from None
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(64)
    sock.setblocking(False)
    return sock


def bind_tcp(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (what uvicorn would bind), or one clear DFlashError."""
    where = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise DFlashError(f"cannot listen on {where}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        why = "address already in use" if e.errno == errno.EADDRINUSE else e.strerror
        raise DFlashError(f"cannot listen on {where}: {why}") from None
    sock.setblocking(False)
    return sock


class Listeners:
    """The daemon's listening sockets, opened before the models load (a busy port or path fails in a
    moment, not after the load) and closed, the socket file removed, however the daemon ends."""

    def __init__(self, socket_path: str | None = None, http: tuple[str, int] | None = None):
        self.socket_path, self.http = socket_path, http
        self.unix: socket.socket | None = None
        self.tcp: socket.socket | None = None
        self._inode: tuple[int, int] | None = None

    def open(self) -> "Listeners":
        try:
            if self.socket_path:
                self.unix = claim_socket(self.socket_path)
                st = os.stat(self.socket_path)
                self._inode = (st.st_dev, st.st_ino)
            if self.http:
                self.tcp = bind_tcp(*self.http)
        except DFlashError:
            self.close()
            raise
        return self

    def remove_socket_file(self) -> None:
        """Unlink the socket file if it is still ours (a later daemon may have claimed the path)."""
        if self._inode is None:
            return
        try:
            st = os.lstat(self.socket_path)
            if (st.st_dev, st.st_ino) == self._inode:
                os.unlink(self.socket_path)
        except OSError:
            pass
        self._inode = None

    def close(self) -> None:
        for s in (self.unix, self.tcp):
            if s is not None:
                s.close()
        self.unix = self.tcp = None
        self.remove_socket_file()


# -- the socket protocol -------------------------------------------------------------------------------------

def _hung_up(fd: int) -> bool:
    p = select.poll()
    p.register(fd, select.POLLOUT)
    return any(ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL) for _, ev in p.poll(0))


class LineTooLong(Exception):
    pass


class LineReader:
    """Newline-delimited reads with a byte cap: an oversized line is discarded up to its newline and
    reported once, so the connection stays usable."""

    def __init__(self, reader: asyncio.StreamReader, limit: int = DEFAULT_MAX_BODY):
        self.reader, self.limit, self.buf = reader, limit, b""

    async def next(self) -> bytes | None:
        skipping = False
        while True:
            nl = self.buf.find(b"\n")
            if nl >= 0:
                line, self.buf = self.buf[:nl], self.buf[nl + 1:]
                if skipping or len(line) > self.limit:
                    raise LineTooLong()
                return line
            if len(self.buf) > self.limit:
                skipping, self.buf = True, b""
            chunk = await self.reader.read(65536)
            if not chunk:
                if skipping:
                    raise LineTooLong()
                line, self.buf = self.buf, b""
                return line if line.strip() else None
            self.buf += chunk


@dataclass
class ServeOptions:
    """The serving limits and exposure settings (`dflash27b serve` flags)."""
    max_body: int = DEFAULT_MAX_BODY
    request_timeout: float = 0.0      # seconds per request, queue wait included (0 = none)
    shutdown_grace: float = 5.0       # seconds the running request may take to finish on shutdown
    read_timeout: float = 30.0        # HTTP: seconds to receive a request's headers, and then its body
    api_key: str | None = None        # HTTP: Authorization: Bearer KEY on every endpoint but /health
    allow_hosts: tuple[str, ...] = ()  # HTTP: Host names accepted besides the bound address and loopback
    cors_origins: tuple[str, ...] = ()  # HTTP: browser origins allowed to read replies (none: CORS off)
    max_connections: int = 256        # HTTP: concurrent connections before 503
    parallel: int = 1                 # requests decoded at once (slots; one batched forward per step)


@dataclass
class Daemon:
    """The serving process: a DecodeService behind a Unix socket (and optionally the HTTP front)."""
    decoder: Decoder
    socket_path: str | None = None
    http: tuple[str, int] | None = None
    model_name: str = "dflash27b"
    log: Callable[[str], None] = field(default=lambda m: None)
    options: ServeOptions = field(default_factory=ServeOptions)
    listeners: Listeners | None = None   # opened by the caller before loading; else opened by serve()

    def __post_init__(self):
        self.service = DecodeService(self.decoder, self.options.request_timeout, self.log, self.options.parallel)
        self._stop: asyncio.Event | None = None
        self._signals = 0
        self._open_requests = 0
        self._connections: set[asyncio.Task] = set()
        self._http_server = None
        self.loop_lag_max_s = 0.0   # the longest the event loop was late: how long a request could wait unread

    # -- health -----------------------------------------------------------------------------------------------
    def health(self) -> dict:
        d, s = self.decoder, self.service
        c = s.cancel_stats
        return {"event": "health", "status": "ok" if s.accepting else "shutting_down",
                "protocol": PROTOCOL_VERSION, "target": d.target, "draft": d.draft, "model": self.model_name,
                "device": d.device, "n_ctx": d.n_ctx, "default_mode": d.default_mode, "queue": s.queue_length(),
                "slots": {"total": s.parallel, "busy": s.counts()[0], "n_ctx_each": d.n_ctx},
                "served": s.served, "cancelled": dict(c.by_reason),
                "after_cancel": {"steps": c.steps_after, "tokens": c.tokens_after},
                "cancel_latency_max_s": round(c.latency_max_s, 4), "loop_lag_max_s": round(self.loop_lag_max_s, 4),
                "uptime_s": round(time.time() - s.started, 3), "rss_bytes": _rss_bytes(), "pid": os.getpid(),
                "cache": d.prefix_cache.stats() if d.prefix_cache is not None else None}

    # -- requests, from either front ---------------------------------------------------------------------------
    async def _prepare(self, params: dict) -> tuple[dict, float]:
        """(the request prepared: rendered, tokenized, checked against the context, off the loop; its arrival)."""
        arrived = time.monotonic()
        if not self.service.accepting:
            raise RequestError("the daemon is shutting down and takes no new requests", SHUTDOWN)
        return await asyncio.to_thread(self.service.prepare, params), arrived

    async def admit(self, params: dict) -> tuple[Job, int]:
        """Prepare and queue a validated request: its job and how many requests are ahead of it."""
        prepared, arrived = await self._prepare(params)
        return self.service.submit(prepared, asyncio.get_running_loop(), arrived)

    async def admit_choices(self, params: dict, n: int) -> list[Job]:
        """n requests for one prompt (OpenAI's `n`): prepared once, queued n times, choice i sampling with
        seed + i when a seed is given (each its own fresh seed when not), so choice i is the reply the same
        request with that seed gets alone.  They decode side by side in the slots --parallel gives."""
        prepared, arrived = await self._prepare(params)
        seed = prepared["params"].seed
        loop, jobs = asyncio.get_running_loop(), []
        try:
            for i in range(n):
                p = dict(prepared, params=replace(prepared["params"], seed=None if seed is None else (seed + i) % 2**32))
                if i:   # the prompt's log-probabilities (echo) are every choice's: the first computes them
                    p.pop("prompt_logprobs", None)
                jobs.append(self.service.submit(p, loop, arrived)[0])
        except BaseException:
            for j in jobs:   # (submit fails only once the daemon is shutting down)
                j.cancel(SHUTDOWN)
            raise
        return jobs

    def request_opened(self) -> None:
        self._open_requests += 1

    def request_closed(self) -> None:
        self._open_requests -= 1

    # -- Unix socket ---------------------------------------------------------------------------------------
    async def _write(self, writer: asyncio.StreamWriter, obj: dict) -> None:
        writer.write((json.dumps(obj, ensure_ascii=False) + "\n").encode())
        await writer.drain()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        lines: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()

        async def read_lines():
            lr = LineReader(reader, self.options.max_body)
            try:
                while True:
                    try:
                        line = await lr.next()
                    except LineTooLong:
                        await lines.put(LineTooLong())
                        continue
                    if line is None:
                        break
                    await lines.put(line)
            except (ConnectionError, OSError):
                pass
            else:
                # EOF may be a half-close (the client shut its write side and still reads): the client is
                # gone only when the socket reports a hang-up in both directions.
                sock = writer.get_extra_info("socket")
                await lines.put(None)
                while sock is not None and not _hung_up(sock.fileno()):
                    await asyncio.sleep(0.05)
            finally:
                gone.set()
                await lines.put(None)

        rt = asyncio.create_task(read_lines())
        try:
            while True:
                item = await lines.get()
                if item is None:
                    break
                if not await self._request(item, writer, gone):
                    break
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass
        finally:
            rt.cancel()
            writer.close()
            self._connections.discard(task)

    async def _request(self, raw, writer, gone: asyncio.Event) -> bool:
        """Serve one request line; False when the connection (or the daemon) should end."""
        if isinstance(raw, LineTooLong):
            await self._write(writer, event_error(f"request line longer than {self.options.max_body} bytes"))
            return True
        if not raw.strip():
            return True
        try:
            req = await parse_off_loop(raw)
        except RequestError as e:
            await self._write(writer, event_error(str(e), e.code))
            return True
        if not isinstance(req, dict):
            await self._write(writer, event_error("a request must be a JSON object"))
            return True
        op = req.get("op", "generate")
        rid = req.get("id")
        tag = {"id": rid} if isinstance(rid, (str, int)) and not isinstance(rid, bool) else {}
        if op == "health":
            await self._write(writer, self.health())
            return True
        if op == "shutdown":
            # stop first: a fire-and-forget client (`printf ... | nc -U`) is gone before the reply is written,
            # and only a generate request may be cancelled by its client's disconnect
            self.request_stop()
            try:
                await self._write(writer, {"event": "shutdown", "status": "ok",
                                           "grace_s": self.options.shutdown_grace})
            except (ConnectionError, OSError):
                pass
            return False
        if op != "generate":
            await self._write(writer, {**event_error(f"unknown op {op!r} (known: generate, health, shutdown)"),
                                       **tag})
            return True
        try:
            job, ahead = await self.admit(parse_generate(req))
        except RequestError as e:
            await self._write(writer, {**event_error(str(e), e.code), **tag})
            return True
        except Exception as e:  # noqa: BLE001 - a bug: the log gets the traceback, the connection stays usable
            self.log("internal error while admitting a request:\n"
                     + "".join(traceback.format_exception(e)).rstrip())
            await self._write(writer, {**event_error("internal error (the daemon's log has the details)", INTERNAL),
                                       **tag})
            return True
        await self._relay(job, ahead, writer, gone, tag)
        return True

    async def _relay(self, job: Job, ahead: int, writer, gone: asyncio.Event, tag: dict) -> None:
        """Write a job's events to its connection until its end; a client that goes away cancels it."""
        self.request_opened()
        gone_wait = asyncio.create_task(gone.wait())
        try:
            if ahead:
                await self._write(writer, {"event": "queued", "position": ahead, **tag})
            while True:
                get = asyncio.create_task(job.events.get())
                done, _ = await asyncio.wait({get, gone_wait}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    job.cancel(CLIENT_GONE)
                    return
                ev = get.result()
                if ev is None:
                    return
                await self._write(writer, {**ev, **tag})
        except BaseException:  # the connection broke or the daemon is closing it: free the slot
            job.cancel(CLIENT_GONE)
            raise
        finally:
            gone_wait.cancel()
            self.request_closed()

    # -- lifecycle ------------------------------------------------------------------------------------------
    def request_stop(self) -> None:
        if self._stop is not None and not self._stop.is_set():
            self.log(f"shutting down: new requests are refused, a running one has {self.options.shutdown_grace:g} s "
                     "to finish (a second SIGTERM exits at once)")
            self._stop.set()

    def _on_signal(self) -> None:
        self._signals += 1
        if self._signals == 1:
            self.request_stop()
            return
        self.log("second signal: exiting now")
        if self.listeners is not None:
            self.listeners.remove_socket_file()
        os._exit(1)

    def _install_signal_handlers(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self._on_signal)
            except (NotImplementedError, RuntimeError, ValueError):
                pass  # not the main thread (tests): stop through request_stop / the shutdown op

    async def _start(self) -> list:
        if self.listeners is None:
            self.listeners = Listeners(self.socket_path, self.http).open()
        servers = []
        if self.listeners.unix is not None:
            servers.append(await asyncio.start_unix_server(self._connection, sock=self.listeners.unix))
            self.log(f"serving on unix:{self.socket_path}")
        if self.listeners.tcp is not None:
            from .http_api import start_http
            self._http_server = await start_http(self, self.listeners.tcp)
            host, port = self.http
            self.log(f"serving on http://{host if ':' not in host else f'[{host}]'}:{port}/v1")
            self._exposure_notes(host)
        return servers

    def _exposure_notes(self, host: str) -> None:
        o = self.options
        if host in ("0.0.0.0", "::", ""):
            if not o.allow_hosts:
                self.log("note: bound to every interface, but only Host names localhost / 127.0.0.1 / [::1] "
                         "are answered: add the names clients use with --allow-host")
            if not o.api_key:
                self.log("note: no --api-key: anyone who can reach this port can use it")

    async def _drain(self, servers: list) -> None:
        """Stop taking requests, let the running ones finish within the grace, end everything else."""
        self.service.stop_accepting()
        for s in servers:
            s.close()
        if self._http_server is not None:
            self._http_server.stop_listening()
        self.service.cancel_waiting(SHUTDOWN)
        if not await self._wait(lambda: self.service.running is None, self.options.shutdown_grace):
            for running in list(self.service.running_jobs):
                running.cancel(SHUTDOWN)
            await self._wait(lambda: self.service.running is None, 1.0)
        # the ended requests' last events are on their way to the clients
        await self._wait(lambda: self._open_requests == 0, 0.5)

    @staticmethod
    async def _wait(cond: Callable[[], bool], seconds: float) -> bool:
        t_end = time.monotonic() + seconds
        while not cond():
            if time.monotonic() >= t_end:
                return False
            await asyncio.sleep(0.01)
        return True

    async def _close(self, servers: list) -> None:
        for s in servers:
            s.close()
        if self._http_server is not None:
            await self._http_server.close(timeout=0.5)
        for t in list(self._connections):
            t.cancel()
        await asyncio.to_thread(self.service.close, 1.0)
        if self.listeners is not None:
            self.listeners.close()

    async def _watch_loop_lag(self, period: float = 0.05) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(period)
            self.loop_lag_max_s = max(self.loop_lag_max_s, loop.time() - t - period)

    async def serve(self, ready: Callable[[], None] | None = None) -> None:
        self._stop = asyncio.Event()
        self._install_signal_handlers(asyncio.get_running_loop())
        lag = asyncio.create_task(self._watch_loop_lag())
        servers: list = []
        try:
            servers = await self._start()
            if ready is not None:
                ready()
            await self._stop.wait()
            await self._drain(servers)
        finally:
            lag.cancel()
            await self._close(servers)

    def run(self) -> None:
        asyncio.run(self.serve())
