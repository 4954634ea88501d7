"""Client of the resident daemon (`dflash27b serve --socket PATH`): `Decoder.connect(PATH)` returns one.

Speaks docs/PROTOCOL.md; `generate`/`stream` mirror `Decoder`'s so a script can switch between an
in-process decoder and a daemon by changing one line.  Besides Decoder's keywords they take the protocol's
request fields, e.g. `timeout=SECONDS` (the daemon ends the request at that deadline: a `done` whose
stop_reason is "timeout", or an error with code "timeout" if it never started).  Error events raise
`RequestError`, a DFlashError whose `code` says why (bad_request, timeout, shutdown, internal).
"""
from __future__ import annotations

import json
import math
import os
import socket
import stat
from typing import Iterator, Sequence

from ._lib import DFlashError
from .results import GenerateResult, GenerateStats
from .serve_protocol import RequestError

_TERMINAL = {"done", "error", "health", "shutdown"}


class RemoteDecoder:
    """A connection target: every call opens its own connection (the daemon serves one decode at a time
    and queues the rest), so one RemoteDecoder may be shared by threads."""

    def __init__(self, path: str, timeout: float | None = None):
        self.path = str(path)
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not math.isfinite(timeout) or timeout <= 0):
            raise DFlashError(f"timeout must be a positive number of seconds or None (got {timeout!r})")
        self.timeout = timeout
        self.last_events: list[dict] = []
        self.health()  # fail now, with the reason, if nobody is serving there

    def _connect(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self.path)
        except FileNotFoundError:
            s.close()
            raise DFlashError(f"no daemon socket at {self.path} (start one with: dflash27b serve --socket "
                              f"{self.path} -m MODEL)") from None
        except ConnectionRefusedError:
            s.close()
            if not stat.S_ISSOCK(os.stat(self.path).st_mode):
                raise DFlashError(f"{self.path} is not a socket (a daemon's socket is made by dflash27b serve "
                                  "--socket PATH)") from None
            raise DFlashError(f"{self.path}: nobody is listening (stale socket of a daemon that exited)") from None
        except OSError as e:
            s.close()
            raise DFlashError(f"{self.path}: cannot connect: {e.strerror or e}") from None
        return s

    def request(self, obj: dict) -> Iterator[dict]:
        """Send one request; yield its events up to and including the terminal one."""
        s = self._connect()
        try:
            s.sendall((json.dumps(obj) + "\n").encode())
            f = s.makefile("rb")
            for line in f:
                ev = json.loads(line)
                yield ev
                if ev.get("event") in _TERMINAL:
                    return
            raise DFlashError(f"{self.path}: the daemon closed the connection before answering")
        finally:
            s.close()

    def health(self) -> dict:
        ev = list(self.request({"op": "health"}))[-1]
        if ev.get("event") != "health":
            raise DFlashError(ev.get("message", f"unexpected reply {ev}"))
        return ev

    def shutdown(self) -> None:
        for _ in self.request({"op": "shutdown"}):
            pass

    @property
    def info(self) -> dict:
        return self.health()

    # -- decoding, shaped like Decoder's --------------------------------------------------------------------
    def _request_obj(self, prompt, max_new_tokens, chat, stream, kw) -> dict:
        if isinstance(prompt, str):
            req = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
        elif chat and prompt and all(isinstance(m, dict) for m in prompt):
            req = {"messages": list(prompt)}
        else:
            req = {"prompt_ids": [int(t) for t in prompt]}
        kw = dict(kw)
        params = kw.pop("params", None)  # a GenParams: its settings that differ from the defaults, keywords over them
        settings = {**(params.to_mapping(only_changed=True) if params is not None else {}), **kw}
        if max_new_tokens is not None:
            settings["max_new_tokens"] = max_new_tokens
        req["max_new_tokens"] = int(settings.pop("max_new_tokens", 256))
        req["stream"] = stream
        if "cache" in settings:  # Decoder's keyword, the protocol's (llama-server's) field name
            req["cache_prompt"] = bool(settings.pop("cache"))
        req.update({k: v for k, v in settings.items() if v is not None})
        return req

    def events(self, prompt: str | Sequence[int], max_new_tokens: int | None = None, *, chat: bool = False,
               stream: bool = True, **kw) -> Iterator[dict]:
        """The raw event stream of one generate request (errors raised as DFlashError)."""
        self.last_events = []
        for ev in self.request(self._request_obj(prompt, max_new_tokens, chat, stream, kw)):
            self.last_events.append(ev)
            if ev.get("event") == "error":
                raise RequestError(ev.get("message", "daemon error"), ev.get("code", "bad_request"))
            yield ev

    def stream(self, prompt: str | Sequence[int], max_new_tokens: int | None = None, *, chat: bool = False,
               **kw) -> Iterator[str]:
        for ev in self.events(prompt, max_new_tokens, chat=chat, stream=True, **kw):
            if ev["event"] == "token" and ev["text"]:
                yield ev["text"]
            elif ev["event"] == "done":
                self._last_done = ev
                self._last_tokens = list(ev["tokens"])  # as Decoder keeps them

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int | None = None, *, chat: bool = False,
                 **kw) -> GenerateResult:
        done = None
        for ev in self.events(prompt, max_new_tokens, chat=chat, stream=False, **kw):
            if ev["event"] == "done":
                done = ev
        if done is None:
            raise DFlashError("the daemon ended the request without a result")
        self._last_done = done
        self._last_tokens = list(done["tokens"])
        return _result(done)

    def last_stats(self) -> GenerateStats:
        return _result(self._last_done).stats

    def last_message(self) -> dict | None:
        """The last chat decode's reply as an OpenAI assistant message (None after a raw completion)."""
        return self._last_done.get("message")

    def close(self) -> None:
        pass

    def __enter__(self) -> "RemoteDecoder":
        return self

    def __exit__(self, *exc) -> None:
        pass


def _result(done: dict) -> GenerateResult:
    known = GenerateStats.__dataclass_fields__
    stats = GenerateStats(**{k: v for k, v in done["stats"].items() if k in known})
    return GenerateResult(tokens=list(done["tokens"]), text=done["text"], stats=stats, message=done.get("message"))
