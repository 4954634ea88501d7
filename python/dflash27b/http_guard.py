"""What stands between the network and the OpenAI-compatible app (`http_api.py`): plain ASGI middleware and
a deadline for request headers.

In request order:
  * HostGuard: the Host header must name this server (the bound address, localhost, 127.0.0.1, [::1], or a
    name given with --allow-host), else 403.  A web page the user visits cannot reach the port through DNS
    rebinding (its requests carry the attacker's host name).
  * CORS (Starlette's CORSMiddleware; a refused preflight answered in JSON) only when --cors-origin names
    origins; without it browsers get no CORS headers, so a page on another origin cannot read replies.
  * ApiKeyGuard: with --api-key, `Authorization: Bearer KEY` (or llama-server's `X-Api-Key: KEY`) on every
    request but `GET /health`, which then answers a bare liveness check to those without the key; else 401.
  * BodyGuard: POST bodies must be `application/json` (415: a cross-site form or text/plain post, which a
    browser sends without asking, is never parsed), at most --max-body bytes (413, from Content-Length
    before reading, or while reading), received within --read-timeout seconds (408).  A client that goes
    away mid-upload is let go quietly (no traceback).  The app then reads the buffered body, and its
    `receive` waits for the client's disconnect, which the app uses to cancel the request's decode.
  * DeadlineH11Protocol (uvicorn's h11 protocol): a request's headers must arrive within --read-timeout
    seconds of the connection's first byte (or of the connection), else 408 and the connection closes; a
    request on a connection past --max-connections gets 503 in the OpenAI error shape.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time

from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from uvicorn.protocols.http.h11_impl import H11Protocol


def error_body(status: int, message: str, kind: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()


async def send_error(send, status: int, message: str, kind: str = "invalid_request_error",
                     headers: list[tuple[bytes, bytes]] = (), close: bool = False) -> None:
    body = error_body(status, message, kind)
    hs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    if close:
        hs.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": hs})
    await send({"type": "http.response.body", "body": body})


def header(scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return v
    return None


def host_name(value: bytes | None) -> str | None:
    """`name[:port]` or `[v6][:port]` -> the lower-cased name (IPv6 in brackets), None if unreadable."""
    if not value:
        return None
    try:
        h = value.decode("ascii").strip().lower()
    except UnicodeDecodeError:
        return None
    if h.startswith("["):
        end = h.find("]")
        return h[:end + 1] if end > 0 else None
    return h.rsplit(":", 1)[0].rstrip(".") if h.count(":") <= 1 else None


def allowed_hosts(bound: str, extra: tuple[str, ...]) -> set[str] | None:
    """Host names this server answers to (None: any, with --allow-host '*')."""
    if "*" in extra:
        return None
    names = {"localhost", "127.0.0.1", "[::1]"}
    for h in (bound, *extra):
        h = h.strip().lower()
        if h.count(":") > 1 and not h.startswith("["):
            h = f"[{h}]"   # a bare IPv6 address, as a Host header brackets it
        names.add(host_name(h.encode()) or h)   # a port given with the name is dropped
    return names


class HostGuard:
    def __init__(self, app, allowed: set[str] | None):
        self.app, self.allowed = app, allowed

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.allowed is not None:
            name = host_name(header(scope, b"host"))
            if name not in self.allowed:
                # (the names it does serve are not listed: this answer goes to anyone, key or not)
                why = ("a request without a Host header is not served" if name is None else
                       f"Host {name!r} is not served here (the server's operator can add it with --allow-host)")
                return await send_error(send, 403, why, "permission_error")
        await self.app(scope, receive, send)


class JsonCORSMiddleware(CORSMiddleware):
    """Starlette's CORS, with a refused preflight answered in the OpenAI error shape like every other error."""

    def preflight_response(self, request_headers):
        resp = super().preflight_response(request_headers)
        if resp.status_code == 200:
            return resp
        headers = {k: v for k, v in resp.headers.items() if k not in ("content-length", "content-type")}
        message = resp.body.decode(errors="replace") + " (this server's --cors-origin does not allow it)"
        return Response(error_body(resp.status_code, message, "invalid_request_error"), resp.status_code,
                        headers=headers, media_type="application/json")


class ApiKeyGuard:
    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    def _authorised(self, scope) -> bool:
        given = None
        auth = header(scope, b"authorization")
        if auth is not None:
            scheme, _, token = auth.partition(b" ")
            given = token.strip() if scheme.lower() == b"bearer" else None
        if given is None:
            given = header(scope, b"x-api-key")
        return given is not None and hmac.compare_digest(given, self.key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        ok = self._authorised(scope)
        scope.setdefault("state", {})["authorised"] = ok
        if not ok and not (scope["path"] == "/health" and scope["method"] in ("GET", "HEAD")):
            return await send_error(send, 401, "missing or wrong API key (send Authorization: Bearer KEY)",
                                    "authentication_error", [(b"www-authenticate", b"Bearer")])
        await self.app(scope, receive, send)


class _ClientGone(Exception):
    pass


class BodyGuard:
    def __init__(self, app, max_body: int, read_timeout: float):
        self.app, self.max_body, self.read_timeout = app, max_body, read_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        refusal = self._refusal(scope)
        if refusal is not None:
            return await send_error(send, *refusal, close=True)
        try:
            body = await self._read(receive)
        except _ClientGone:
            return
        except asyncio.TimeoutError:
            return await send_error(send, 408, f"the request body did not arrive within {self.read_timeout:g} s "
                                    "(read timeout)", close=True)
        if body is None:
            return await send_error(send, 413, f"request body larger than {self.max_body} bytes (--max-body)",
                                    close=True)
        await self.app(scope, _replay(body, receive), send)

    def _refusal(self, scope) -> tuple[int, str] | None:
        ctype = (header(scope, b"content-type") or b"").decode("latin-1")
        mime, _, params = ctype.partition(";")
        charset = params.strip().lower().replace(" ", "")
        if mime.strip().lower() != "application/json" or (charset and charset not in ("charset=utf-8",
                                                                                         'charset="utf-8"')):
            return 415, (f"send the body as Content-Type: application/json (UTF-8); got "
                         f"{ctype or 'no Content-Type'!r}")
        length = header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return 413, f"request body of {int(length)} bytes is larger than {self.max_body} bytes (--max-body)"
        return None

    async def _read(self, receive) -> bytes | None:
        """The whole body (None when it outgrows max_body), within the read deadline."""
        deadline = time.monotonic() + self.read_timeout
        chunks, size = [], 0
        while True:
            msg = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            if msg["type"] == "http.disconnect":
                raise _ClientGone()
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return None
            chunks.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive):
    """A receive that gives the buffered body once, then waits on the real one (for the disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return pending.pop() if pending else await receive()
    return replayed


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a deadline for each request's headers, which uvicorn does not have: a
    client sending half a request line would otherwise hold its connection (and a slot) forever.  And the
    connection limit (--max-connections) in place of uvicorn's limit_concurrency, whose 503 is plain text:
    a request on a connection past the limit gets the OpenAI error shape, with Retry-After."""
    header_timeout = 30.0
    max_connections: int | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.limit_concurrency = None
        if self.max_connections is not None:
            inner, limit = self.app, self.max_connections

            async def limited(scope, receive, send):
                # (this connection and this request's task are among those counted)
                if scope["type"] == "http" and (len(self.connections) > limit or len(self.tasks) > limit):
                    return await send_error(send, 503, f"the server is at its limit of {limit} connections "
                                            "(--max-connections): retry shortly", "server_error",
                                            [(b"retry-after", b"1")], close=True)
                await inner(scope, receive, send)
            self.app = limited

    def connection_made(self, transport):
        self._header_timer = None
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._awaiting_headers():
            if self._header_timer is None:
                self._arm()
        else:
            self._disarm()

    def connection_lost(self, exc):
        self._disarm()
        super().connection_lost(exc)

    def _awaiting_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self._awaiting_headers() or self.transport.is_closing():
            return
        body = error_body(408, f"the request headers did not arrive within {self.header_timeout:g} s "
                               "(read timeout)", "invalid_request_error")
        self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                             b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
        self.transport.close()


def deadline_protocol(header_timeout: float, max_connections: int | None = None) -> type:
    return type("DeadlineH11", (DeadlineH11Protocol,), {"header_timeout": header_timeout,
                                                          "max_connections": max_connections})
