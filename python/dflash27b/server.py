"""The resident daemon: one loaded `Decoder`, a FIFO of requests, newline-delimited JSON over a Unix socket.

Clients write one JSON object per line and read events, one JSON object per line, until a terminal event
(`done` or `error`, or the reply to `health`/`shutdown`).  The protocol is written down in docs/PROTOCOL.md.

Threads: the asyncio loop owns the sockets; one worker thread owns the decoder (the core's context is not
shared), so decodes run one at a time in arrival order while the loop keeps reading, answering `health`
and noticing disconnects.  A client that goes away sets its job's cancel flag, which the worker checks
between decode steps.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import queue
import select
import signal
import socket
import stat
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ._lib import DFlashError
from .decoder import MODES, Decoder

MAX_LINE_BYTES = 1 << 20   # a request line longer than this is refused (and skipped to its newline)
PROTOCOL_VERSION = 1

# request fields: name -> (check, message).  Everything optional except one prompt form.
_PROMPT_FIELDS = ("prompt", "messages", "prompt_ids")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "op": (lambda v: v == "generate", "must be 'generate'"),
    "id": (lambda v: isinstance(v, (str, int)) and not isinstance(v, bool), "must be a string or an integer"),
    "prompt": (lambda v: isinstance(v, str), "must be a string"),
    "messages": (lambda v: isinstance(v, list) and len(v) > 0 and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in v),
        "must be a non-empty list of {\"role\": str, \"content\": str}"),
    "prompt_ids": (lambda v: isinstance(v, list) and len(v) > 0 and all(_is_int(t) for t in v),
                   "must be a non-empty list of integers"),
    "max_new_tokens": (lambda v: _is_int(v) and v >= 0, "must be an integer >= 0"),
    "mode": (lambda v: v is None or v in MODES, f"must be one of {', '.join(MODES)}"),
    "budget": (lambda v: _is_int(v) and v >= 0, "must be an integer >= 0"),
    "topk": (lambda v: _is_int(v) and v >= 0, "must be an integer >= 0"),
    "tree_topk": (lambda v: _is_int(v) and v >= 0, "must be an integer >= 0"),
    "block_size": (lambda v: v is None or (_is_int(v) and v >= 1), "must be an integer >= 1"),
    "chain_seed": (lambda v: isinstance(v, bool), "must be true or false"),
    # a draft model's tree: 0 = from one draft pass, w = expanding branches, w nodes run per depth
    "expand": (lambda v: _is_int(v) and v >= 0, "must be an integer >= 0"),
    "temperature": (lambda v: _is_num(v) and v >= 0, "must be a number >= 0"),
    "top_k": (lambda v: _is_int(v) and v >= 0, "must be an integer >= 0"),
    "top_p": (lambda v: _is_num(v) and 0 < v <= 1, "must be a number in (0, 1]"),
    "min_p": (lambda v: _is_num(v) and 0 <= v <= 1, "must be a number in [0, 1]"),
    "repeat_penalty": (lambda v: _is_num(v) and v > 0, "must be a number > 0 (1 = off)"),
    "frequency_penalty": (lambda v: _is_num(v), "must be a number (0 = off)"),
    "presence_penalty": (lambda v: _is_num(v), "must be a number (0 = off)"),
    "repeat_last_n": (lambda v: _is_int(v) and v >= -1, "must be an integer >= -1 (-1 = all, 0 = off)"),
    "seed": (lambda v: v is None or (_is_int(v) and 0 <= v < 2 ** 32), "must be an integer in [0, 2^32)"),
    "ignore_eos": (lambda v: isinstance(v, bool), "must be true or false"),
    "stop": (lambda v: isinstance(v, str) and v != "" or (isinstance(v, list) and len(v) <= 16 and all(
        isinstance(s, str) and s for s in v)), "must be a non-empty string or a list of up to 16 of them"),
    "stream": (lambda v: isinstance(v, bool), "must be true or false"),
    # llama-server's name: false decodes without the prefix cache (neither reads nor feeds it)
    "cache_prompt": (lambda v: isinstance(v, bool), "must be true or false"),
    # per emitted token: its log-probability and the k most likely alternatives (null = off)
    "logprobs": (lambda v: v is None or (_is_int(v) and 0 <= v <= 20), "must be null or an integer in 0..20"),
}


def parse_generate(req: dict) -> dict:
    """Validate a generate request; returns it with defaults filled.  Raises DFlashError naming the field."""
    unknown = sorted(set(req) - set(_FIELDS))
    if unknown:
        raise DFlashError(f"unknown request field {unknown[0]!r} (known: {', '.join(sorted(_FIELDS))})")
    given = [k for k in _PROMPT_FIELDS if k in req]
    if len(given) != 1:
        raise DFlashError("a generate request needs exactly one of 'prompt', 'messages', 'prompt_ids'"
                          + (f" (got {', '.join(given)})" if given else ""))
    for k, v in req.items():
        ok, why = _FIELDS[k]
        if not ok(v):
            raise DFlashError(f"field {k!r} {why} (got {json.dumps(v)[:80]})")
    out = {"max_new_tokens": 256, "stream": True, "stop": [], "ignore_eos": False, **req}
    if isinstance(out["stop"], str):
        out["stop"] = [out["stop"]]
    return out


class Job:
    """One queued request.  `emit` is called from the worker thread and hands events to the loop."""

    def __init__(self, params: dict, loop: asyncio.AbstractEventLoop):
        self.params = params
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()

    def emit(self, event: dict | None) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def cancel(self) -> None:
        self.cancelled.set()


def _decode_kwargs(p: dict) -> dict:
    keys = ("mode", "budget", "tree_topk", "block_size", "chain_seed", "expand", "temperature", "top_k", "top_p",
            "min_p", "seed", "ignore_eos", "repeat_penalty", "frequency_penalty", "presence_penalty", "repeat_last_n")
    out = {k: p[k] for k in keys if k in p}
    if "topk" in p:  # the protocol's first name for tree_topk
        out["tree_topk"] = p["topk"]
    return out


class StopMatcher:
    """Text-level stop strings: finds the first occurrence and holds back a possible partial match."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.sent = 0

    def push(self, piece: str) -> tuple[str, bool]:
        """Append decoded text; returns (text safe to emit now, stopped)."""
        start = max(0, len(self.text) - self.hold)
        self.text += piece
        if self.stops:
            hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                out, self.sent = self.text[self.sent:], len(self.text)
                return out, True
        safe = max(self.sent, len(self.text) - self.hold) if self.stops else len(self.text)
        out, self.sent = self.text[self.sent:safe], safe
        return out, False

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


class DecodeService:
    """Owns the decoder; runs queued jobs one at a time on a worker thread."""

    def __init__(self, decoder: Decoder):
        self.decoder = decoder
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._waiting: list[Job] = []
        self.running: Job | None = None
        self.served = 0
        self.started = time.time()
        # totals for /metrics (written by the worker thread only)
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.generated_tokens_total = 0
        self.decode_steps_total = 0
        self.decode_seconds_total = 0.0
        self._worker = threading.Thread(target=self._run, name="dflash27b-decode", daemon=True)
        self._worker.start()

    # -- loop side ---------------------------------------------------------------------------------------
    def submit(self, params: dict, loop: asyncio.AbstractEventLoop) -> tuple[Job, int]:
        """Queue a validated request; returns the job and how many requests are ahead of it."""
        job = Job(params, loop)
        with self._lock:
            ahead = len(self._waiting) + (self.running is not None)
            self._waiting.append(job)
        self._queue.put(job)
        return job, ahead

    def queue_length(self) -> int:
        with self._lock:
            return len(self._waiting) + (self.running is not None)

    def close(self) -> None:
        with self._lock:
            for j in self._waiting:
                j.cancel()
            if self.running is not None:
                self.running.cancel()
        self._queue.put(None)
        self._worker.join(timeout=30)

    # -- worker side ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._lock:
                self._waiting.remove(job)
                self.running = job
            try:
                if not job.cancelled.is_set():
                    job.emit({"event": "start"})
                    self._decode(job)
            except DFlashError as e:
                job.emit({"event": "error", "message": str(e)})
            except Exception as e:  # a bug: report it to the client, keep serving
                job.emit({"event": "error", "message": f"internal error: {type(e).__name__}: {e}"})
            finally:
                with self._lock:
                    self.running = None
                    self.served += 1
                job.emit(None)

    def _prompt(self, p: dict) -> str | list[int]:
        """Text (chat messages rendered with the GGUF's template) or token ids, decoded as a raw prompt."""
        if "messages" in p:
            return self.decoder.chat_prompt(p["messages"])
        return p["prompt_ids"] if "prompt_ids" in p else p["prompt"]

    def _decode(self, job: Job) -> None:
        p, dec = job.params, self.decoder
        prompt = self._prompt(p)
        stream, stop = p["stream"], StopMatcher(p["stop"])
        sd = dec.tokenizer.stream_decoder()
        tokens: list[int] = []
        stopped = cancelled = False
        want_lp = p.get("logprobs") is not None
        steps = dec.stream_ids(prompt, p["max_new_tokens"], **_decode_kwargs(p), cache=p.get("cache_prompt", True),
                               logprobs=p.get("logprobs"), on_prefill=lambda done, total: job.cancelled.is_set())
        try:
            for toks in steps:
                tokens += toks
                piece, stopped = stop.push("".join(sd.push(t) for t in toks))
                if stream:
                    ev = {"event": "token", "ids": toks, "text": piece}
                    if want_lp:
                        ev["logprobs"] = dec.last_logprobs(len(tokens) - len(toks))
                    job.emit(ev)
                if stopped:
                    break
                if job.cancelled.is_set():
                    cancelled = True
                    break
        finally:
            steps.close()
        if cancelled:
            return
        if not stopped:
            piece, stopped = stop.push(sd.flush())
            piece += "" if stopped else stop.flush()
            if stream and piece:
                job.emit({"event": "token", "ids": [], "text": piece})
        stats = dec.last_stats().to_dict()
        self.prompt_tokens_total += stats["prompt_tokens"]
        self.cached_tokens_total += stats["cached_tokens"]
        self.generated_tokens_total += stats["generated_tokens"]
        self.decode_steps_total += stats["steps"]
        self.decode_seconds_total += stats["decode_s"]
        if stopped:
            stats["stop_reason"] = "stop"
        done = {"event": "done", "tokens": tokens, "text": stop.text, "stats": stats}
        if want_lp:
            done["logprobs"] = dec.last_logprobs()[:len(tokens)]
        job.emit(done)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def check_socket_free(path: str) -> None:
    """Raise if `path` cannot become our socket (a live daemon serves there, or it is another kind of
    file); called before loading models so a refusal is immediate.  A stale socket is left for
    claim_socket to replace."""
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


def _hung_up(fd: int) -> bool:
    p = select.poll()
    p.register(fd, select.POLLOUT)
    return any(ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL) for _, ev in p.poll(0))


class LineTooLong(Exception):
    pass


class LineReader:
    """Newline-delimited reads with a byte cap: an oversized line is discarded up to its newline and
    reported once, so the connection stays usable."""

    def __init__(self, reader: asyncio.StreamReader, limit: int = MAX_LINE_BYTES):
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
class Daemon:
    """The serving process: a DecodeService behind a Unix socket (and optionally the HTTP front)."""
    decoder: Decoder
    socket_path: str | None = None
    http: tuple[str, int] | None = None
    model_name: str = "dflash27b"
    log: Callable[[str], None] = field(default=lambda m: None)

    def __post_init__(self):
        self.service = DecodeService(self.decoder)
        self._stop: asyncio.Event | None = None
        self._conns: set[asyncio.Task] = set()

    def health(self) -> dict:
        d = self.decoder
        return {"event": "health", "status": "ok", "protocol": PROTOCOL_VERSION, "target": d.target,
                "draft": d.draft, "model": self.model_name, "device": d.device, "n_ctx": d.n_ctx,
                "default_mode": d.default_mode, "queue": self.service.queue_length(),
                "served": self.service.served, "uptime_s": round(time.time() - self.service.started, 3),
                "rss_bytes": _rss_bytes(), "pid": os.getpid(),
                "cache": d.prefix_cache.stats() if d.prefix_cache is not None else None}

    # -- Unix socket ---------------------------------------------------------------------------------------
    async def _write(self, writer: asyncio.StreamWriter, obj: dict) -> None:
        writer.write((json.dumps(obj, ensure_ascii=False) + "\n").encode())
        await writer.drain()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lines: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()

        async def read_lines():
            lr = LineReader(reader)
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
        except (ConnectionError, OSError):
            pass
        finally:
            rt.cancel()
            writer.close()

    async def _request(self, raw, writer, gone: asyncio.Event) -> bool:
        """Serve one request line; False when the connection (or the daemon) should end."""
        def err(msg, rid=None):
            return {"event": "error", "message": msg, **({"id": rid} if rid is not None else {})}

        if isinstance(raw, LineTooLong):
            await self._write(writer, err(f"request line longer than {MAX_LINE_BYTES} bytes"))
            return True
        if not raw.strip():
            return True
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            await self._write(writer, err(f"request is not valid UTF-8 (byte {e.start})"))
            return True
        try:
            req = json.loads(text)
        except json.JSONDecodeError as e:
            await self._write(writer, err(f"malformed JSON: {e.msg} at column {e.colno}"))
            return True
        if not isinstance(req, dict):
            await self._write(writer, err("a request must be a JSON object"))
            return True
        op = req.get("op", "generate")
        rid = req.get("id")
        if op == "health":
            await self._write(writer, self.health())
            return True
        if op == "shutdown":
            # stop first: a fire-and-forget client (`printf ... | nc -U`) is gone before the reply is written,
            # and only a generate request may be cancelled by its client's disconnect
            self.request_stop()
            with contextlib.suppress(ConnectionError, OSError):
                await self._write(writer, {"event": "shutdown", "status": "ok"})
            return False
        if op != "generate":
            await self._write(writer, err(f"unknown op {op!r} (known: generate, health, shutdown)", rid))
            return True
        try:
            params = parse_generate(req)
        except DFlashError as e:
            await self._write(writer, err(str(e), rid))
            return True
        await self._generate(params, writer, gone, rid)
        return True

    async def _generate(self, params: dict, writer, gone: asyncio.Event, rid) -> None:
        job, ahead = self.service.submit(params, asyncio.get_running_loop())
        tag = {"id": rid} if rid is not None else {}
        try:
            if ahead:
                await self._write(writer, {"event": "queued", "position": ahead, **tag})
            gone_wait = asyncio.create_task(gone.wait())
            try:
                while True:
                    get = asyncio.create_task(job.events.get())
                    done, _ = await asyncio.wait({get, gone_wait}, return_when=asyncio.FIRST_COMPLETED)
                    if get not in done:
                        get.cancel()
                        job.cancel()   # the client went away: free the slot
                        return
                    ev = get.result()
                    if ev is None:
                        return
                    await self._write(writer, {**ev, **tag})
            finally:
                gone_wait.cancel()
        except (ConnectionError, OSError):
            job.cancel()
            raise
        except asyncio.CancelledError:
            job.cancel()
            raise

    # -- lifecycle ------------------------------------------------------------------------------------------
    def request_stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    async def serve(self, ready: Callable[[], None] | None = None) -> None:
        self._stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self.request_stop)
            except (NotImplementedError, RuntimeError, ValueError):
                pass  # not the main thread (tests): stop through request_stop / the shutdown op
        servers = []
        sock = None
        http_task = None
        try:
            if self.socket_path:
                sock = claim_socket(self.socket_path)
                servers.append(await asyncio.start_unix_server(self._connection, sock=sock))
                self.log(f"serving on unix:{self.socket_path}")
            if self.http:
                from .http_api import make_http_server
                http_server = make_http_server(self, *self.http)
                http_task = asyncio.create_task(http_server.serve())
                while not http_server.started and not http_task.done():
                    await asyncio.sleep(0.02)
                if http_task.done():
                    http_task.result()
                    raise DFlashError(f"HTTP server on {self.http[0]}:{self.http[1]} did not start")
                self.log(f"serving on http://{self.http[0]}:{self.http[1]}/v1")
            if ready is not None:
                ready()
            await self._stop.wait()
        finally:
            for s in servers:
                s.close()
            if http_task is not None:
                http_server.should_exit = True
                try:
                    await asyncio.wait_for(http_task, 10)
                except (asyncio.TimeoutError, Exception):
                    http_task.cancel()
            await asyncio.get_running_loop().run_in_executor(None, self.service.close)
            if sock is not None and self.socket_path and os.path.lexists(self.socket_path):
                try:
                    os.unlink(self.socket_path)
                except OSError:
                    pass

    def run(self) -> None:
        asyncio.run(self.serve())
