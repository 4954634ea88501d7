"""The resident daemon: one loaded `Decoder`, a FIFO of requests, newline-delimited JSON over a Unix socket.

Clients write one JSON object per line and read events, one JSON object per line, until a terminal event
(`done` or `error`, or the reply to `health`/`shutdown`).  The protocol is written down in docs/PROTOCOL.md.

Threads: the asyncio loop owns the sockets; one worker thread owns the decoder (the core's context is not
shared), so decodes run one at a time in arrival order while the loop keeps reading, answering `health`
and noticing disconnects.  Prompts are rendered and tokenized on a helper thread before they queue, in
pieces, and only as far as the context reaches.  A request ends early when its client goes away, its
deadline passes or the daemon shuts down: `Job.cancel` drops a waiting job at once, and the worker checks
a running one before every decode step (and after every prefill chunk).  The counters in `health` prove it:
no step starts after its job was cancelled.
"""
from __future__ import annotations

import asyncio
import errno
import json
import math
import os
import queue
import re
import select
import signal
import socket
import stat
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ._lib import DFlashError
from .decoder import MODES, Decoder
from .tokenizer import TOKEN_CONTROL, TOKEN_USER_DEFINED

PROTOCOL_VERSION = 1
DEFAULT_MAX_BODY = 4 << 20   # bytes of one request: an HTTP body or a socket request line
MAX_JSON_DEPTH = 64          # nesting of arrays / objects in a request
MAX_INT_DIGITS = 100         # longer JSON integers are refused while parsing (Python's own limit is 4300)
INT32_MAX = 2**31 - 1        # the core's ints

# why a request ended early; error events carry one of these as `code` (plus bad_request / internal)
CLIENT_GONE, TIMEOUT, SHUTDOWN = "client_gone", "timeout", "shutdown"
CANCEL_REASONS = (CLIENT_GONE, TIMEOUT, SHUTDOWN)
BAD_REQUEST, INTERNAL = "bad_request", "internal"


class RequestError(DFlashError):
    """A request that cannot be served as asked; `code` says why (bad_request, timeout, shutdown, ...)."""

    def __init__(self, message: str, code: str = BAD_REQUEST):
        super().__init__(message)
        self.code = code


# -- request JSON -------------------------------------------------------------------------------------------

class _Refused(Exception):
    """A JSON value we refuse while parsing (its message is the client's)."""


def _parse_int(digits: str) -> int:
    n = len(digits.lstrip("-"))
    if n > MAX_INT_DIGITS:
        raise _Refused(f"a number with {n} digits (more than {MAX_INT_DIGITS})")
    return int(digits)


def _parse_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise _Refused(f"the number {text[:40]} is out of range")
    return v


def _parse_constant(name: str):
    raise _Refused(f"{name} is not a JSON value")


_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_tree(obj: Any) -> None:
    """Depth and strings of a parsed request: iterative, so no input can exhaust the stack."""
    stack = [(obj, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise _Refused(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, x in items:
                if isinstance(k, str):
                    _check_string(k)
                stack.append((x, depth + 1))
        elif isinstance(v, str):
            _check_string(v)


def _check_string(s: str) -> None:
    m = _SURROGATE.search(s)
    if m:
        raise _Refused(f"a string holds a lone UTF-16 surrogate (\\u{ord(m.group()):04x}), which is not text")


def parse_json_request(data: bytes | str) -> Any:
    """A request's JSON with limits: UTF-8, nesting depth, integer size, finite numbers, no lone surrogates.
    Raises RequestError with a message for the client (never an exception class name)."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(f"request is not valid UTF-8 (byte {e.start})") from None
    try:
        obj = json.loads(data, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant)
        _check_tree(obj)
    except json.JSONDecodeError as e:
        raise RequestError(f"malformed JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except _Refused as e:
        raise RequestError(f"refused JSON: {e}") from None
    except RecursionError:  # the parser's own guard, long before the stack could run out
        raise RequestError(f"refused JSON: nested deeper than {MAX_JSON_DEPTH} levels") from None
    return obj


# -- generate requests --------------------------------------------------------------------------------------

_PROMPT_FIELDS = ("prompt", "messages", "prompt_ids")
CHAT_ROLES = ("system", "user", "assistant", "developer")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _int_in(lo: int, hi: int = INT32_MAX, note: str = "") -> tuple[Callable[[Any], bool], str]:
    top = "2^31 - 1" if hi == INT32_MAX else str(hi)
    return (lambda v: _is_int(v) and lo <= v <= hi), f"must be an integer in {lo}..{top}{note}"


def _good_messages(v) -> bool:
    return isinstance(v, list) and len(v) > 0 and all(
        isinstance(m, dict) and set(m) == {"role", "content"} and m["role"] in CHAT_ROLES
        and isinstance(m["content"], str) for m in v)


_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "op": (lambda v: v == "generate", "must be 'generate'"),
    "id": (lambda v: isinstance(v, (str, int)) and not isinstance(v, bool), "must be a string or an integer"),
    "prompt": (lambda v: isinstance(v, str), "must be a string"),
    "messages": (_good_messages, "must be a non-empty list of {\"role\": one of " + ", ".join(CHAT_ROLES)
                 + ", \"content\": string} (no other keys)"),
    "prompt_ids": (lambda v: isinstance(v, list) and len(v) > 0 and all(_is_int(t) and 0 <= t <= INT32_MAX
                                                                         for t in v),
                   "must be a non-empty list of token ids (integers >= 0)"),
    "max_new_tokens": _int_in(0),
    "mode": (lambda v: v is None or v in MODES, f"must be one of {', '.join(MODES)}"),
    "budget": _int_in(0),
    "topk": _int_in(0),
    "tree_topk": _int_in(0),
    "block_size": (lambda v: v is None or (_is_int(v) and 1 <= v <= INT32_MAX), "must be an integer in 1..2^31 - 1"),
    "chain_seed": (lambda v: isinstance(v, bool), "must be true or false"),
    # a draft model's tree: 0 = from one draft pass, w = expanding branches, w nodes run per depth
    "expand": _int_in(0),
    "temperature": (lambda v: _is_num(v) and v >= 0, "must be a number >= 0"),
    "top_k": _int_in(0),
    "top_p": (lambda v: _is_num(v) and 0 < v <= 1, "must be a number in (0, 1]"),
    "min_p": (lambda v: _is_num(v) and 0 <= v <= 1, "must be a number in [0, 1]"),
    "repeat_penalty": (lambda v: _is_num(v) and v > 0, "must be a number > 0 (1 = off)"),
    "frequency_penalty": (lambda v: _is_num(v), "must be a number (0 = off)"),
    "presence_penalty": (lambda v: _is_num(v), "must be a number (0 = off)"),
    "repeat_last_n": _int_in(-1, note=" (-1 = all, 0 = off)"),
    "seed": (lambda v: v is None or (_is_int(v) and 0 <= v < 2 ** 32), "must be an integer in [0, 2^32)"),
    "ignore_eos": (lambda v: isinstance(v, bool), "must be true or false"),
    "stop": (lambda v: isinstance(v, str) and v != "" or (isinstance(v, list) and len(v) <= 16 and all(
        isinstance(s, str) and s for s in v)), "must be a non-empty string or a list of up to 16 of them"),
    "stream": (lambda v: isinstance(v, bool), "must be true or false"),
    # llama-server's name: false decodes without the prefix cache (neither reads nor feeds it)
    "cache_prompt": (lambda v: isinstance(v, bool), "must be true or false"),
    # per emitted token: its log-probability and the k most likely alternatives (null = off)
    "logprobs": (lambda v: v is None or (_is_int(v) and 0 <= v <= 20), "must be null or an integer in 0..20"),
    # seconds from arrival to the end of the request, queue wait included (capped by --request-timeout)
    "timeout": (lambda v: _is_num(v) and 0 < v <= 1e6, "must be a number of seconds in (0, 1e6]"),
}


def parse_generate(req: dict, names: Mapping[str, str] | None = None) -> dict:
    """Validate a generate request; returns it with defaults filled.  Raises RequestError naming the field
    (as `names` spells it for the client, e.g. the OpenAI front's max_tokens for max_new_tokens)."""
    names = names or {}
    unknown = sorted(set(req) - set(_FIELDS))
    if unknown:
        raise RequestError(f"unknown request field {unknown[0]!r} (known: {', '.join(sorted(_FIELDS))})")
    given = [k for k in _PROMPT_FIELDS if k in req]
    if len(given) != 1:
        raise RequestError("a generate request needs exactly one of 'prompt', 'messages', 'prompt_ids'"
                           + (f" (got {', '.join(given)})" if given else ""))
    for k, v in req.items():
        ok, why = _FIELDS[k]
        if not ok(v):
            raise RequestError(f"field {names.get(k, k)!r} {why} (got {json.dumps(v)[:80]})")
    out = {"max_new_tokens": 256, "stream": True, "stop": [], "ignore_eos": False, **req}
    if isinstance(out["stop"], str):
        out["stop"] = [out["stop"]]
    return out


# -- prompts: rendered and tokenized before they queue, never further than the context --------------------------

# Places where the tokenizer's pre-split (the qwen35 / qwen2 regex) always cuts, whatever follows: after a
# newline before an ASCII letter or digit, and between an ASCII letter and " " + letter.  No regex match spans
# them, so tokenizing the pieces gives the same ids as tokenizing the whole text (tests check it).
_CUT = re.compile(r"\n(?=[A-Za-z0-9])|(?<=[A-Za-z]) (?=[A-Za-z])")
PIECE_CHARS = 8192   # about 5 ms of tokenizing: the GIL is given back between pieces


class PromptTooLong(RequestError):
    pass


class PromptTokenizer:
    """Tokenizes a prompt piece by piece and stops as soon as it cannot fit `limit` tokens."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        added = [t for t, ty in zip(tokenizer.tokens, tokenizer.token_types)
                 if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
        # a special token holding a newline or a space could span a cut: then do not cut
        self.can_cut = not any("\n" in t or " " in t for t in added)
        self._max_token_bytes = None

    @property
    def max_token_bytes(self) -> int:
        if self._max_token_bytes is None:
            self._max_token_bytes = max(len(self.tok.token_bytes(i)) for i in range(self.tok.vocab_size))
        return self._max_token_bytes

    def pieces(self, text: str):
        """(piece, is_last): `text` cut where tokenizing the pieces equals tokenizing the whole."""
        start = 0
        while True:
            m = _CUT.search(text, start + PIECE_CHARS) if self.can_cut else None
            if m is None:
                yield text[start:], True
                return
            cut = m.end() if m.group() == "\n" else m.start()
            yield text[start:cut], False
            start = cut

    def encode(self, text: str, limit: int | None = None, parse_special: bool = True) -> list[int]:
        """Token ids of `text` (as Decoder.tokenize); past `limit` tokens raises PromptTooLong("N" or
        "at least N") without tokenizing the rest."""
        if limit is not None:
            # every token covers at most max_token_bytes bytes: a text this long cannot fit, tokenized or not
            at_least = -(-len(text.encode("utf-8", "surrogatepass")) // self.max_token_bytes)
            if at_least > limit:
                raise PromptTooLong(f"at least {at_least}")
        ids: list[int] = []
        for piece, last in self.pieces(text):
            ids += self.tok.encode(piece, parse_special=parse_special)
            if limit is not None and len(ids) > limit:
                raise PromptTooLong(str(len(ids)) if last else f"at least {len(ids)}")
        return ids


def too_long(count: str, n_ctx: int) -> RequestError:
    return RequestError(f"prompt of {count} tokens does not fit the context length {n_ctx} "
                        "(leave room for at least one new token)")


def chat_text(decoder: Decoder, messages: list[dict]) -> str:
    """Messages rendered with the GGUF's template; `developer` (OpenAI's newer name for the system role) is
    passed as `system` to templates that do not know it."""
    import jinja2
    template = decoder.tokenizer.chat_template or ""
    if "developer" not in template:
        messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    try:
        return decoder.chat_prompt(messages)
    except jinja2.TemplateError as e:
        raise RequestError(f"the chat template refused the messages: {e.message or 'template error'}") from None


# -- jobs ----------------------------------------------------------------------------------------------------

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


class Job:
    """One queued request.  `emit` may be called from any thread and hands events to the loop."""

    def __init__(self, params: dict, loop: asyncio.AbstractEventLoop, service: "DecodeService",
                 timeout: float | None, arrived: float | None = None):
        self.params = params
        self.loop = loop
        self.service = service
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.reason: str | None = None
        self.cancel_time: float | None = None    # monotonic, set just after the flag
        self.state = WAITING
        self.timeout = timeout
        self.arrived = time.monotonic() if arrived is None else arrived
        self.deadline = self.arrived + timeout if timeout else None
        self.timer: asyncio.TimerHandle | None = None   # the deadline on the loop, for a waiting job

    def finished(self) -> None:
        """Called once it ended: drop the deadline timer (it would keep the job alive until it fires)."""
        if self.timer is not None:
            try:
                self.loop.call_soon_threadsafe(self.timer.cancel)
            except RuntimeError:  # the loop is closed: nothing left to fire
                pass

    def emit(self, event: dict | None) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def cancel(self, reason: str = CLIENT_GONE) -> bool:
        """End this request early (first reason wins; a finished one is left alone).  Thread-safe."""
        return self.service.cancel(self, reason)

    def stop_requested(self) -> bool:
        """Checked by the worker before every step: cancelled, or past the deadline (which cancels it)."""
        if not self.cancelled.is_set() and self.deadline is not None and time.monotonic() >= self.deadline:
            self.cancel(TIMEOUT)
        return self.cancelled.is_set()


@dataclass
class CancelStats:
    """What cancellation cost.  `steps_after` / `tokens_after` count decode steps that *started* after their
    job's cancel flag was set (the flag is checked before every step, so they stay 0)."""
    by_reason: dict = field(default_factory=lambda: {r: 0 for r in CANCEL_REASONS})
    steps_after: int = 0
    tokens_after: int = 0
    latency_max_s: float = 0.0   # cancel -> the worker let go of the job (running jobs; waiting ones: 0)


def _event_error(message: str, code: str = BAD_REQUEST) -> dict:
    return {"event": "error", "message": message, "code": code}


class DecodeService:
    """Owns the decoder; runs queued jobs one at a time on a worker thread."""

    def __init__(self, decoder: Decoder, request_timeout: float = 0.0, log: Callable[[str], None] = lambda m: None):
        self.decoder = decoder
        self.request_timeout = request_timeout
        self.log = log
        self.prompts = PromptTokenizer(decoder.tokenizer)
        self.n_vocab = decoder.info["n_vocab"]
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._waiting: list[Job] = []
        self.running: Job | None = None
        self.accepting = True
        self.served = 0
        self.started = time.time()
        self.cancel_stats = CancelStats()
        # totals for /metrics (written by the worker thread only)
        self.prompt_tokens_total = 0
        self.prefilled_tokens_total = 0     # prompt tokens actually run (not restored from the prefix cache)
        self.prefill_seconds_total = 0.0
        self.cached_tokens_total = 0
        self.generated_tokens_total = 0
        self.decode_steps_total = 0
        self.decode_seconds_total = 0.0
        self._worker = threading.Thread(target=self._run, name="dflash27b-decode", daemon=True)
        self._worker.start()

    # -- loop side ---------------------------------------------------------------------------------------
    def prepare(self, params: dict) -> dict:
        """The request with its prompt as token ids (chat rendered, text tokenized), checked against the
        context before it queues.  Blocking: run it off the event loop."""
        n_ctx = self.decoder.n_ctx
        p = {k: v for k, v in params.items() if k not in ("prompt", "messages")}
        if "prompt_ids" in params:
            ids = params["prompt_ids"]
            if len(ids) >= n_ctx:
                raise too_long(str(len(ids)), n_ctx)
            n_vocab = self.n_vocab
            bad = next((t for t in ids if t >= n_vocab), None)
            if bad is not None:
                raise RequestError(f"prompt token id {bad} is outside the vocabulary (0..{n_vocab - 1})")
            return p
        text = chat_text(self.decoder, params["messages"]) if "messages" in params else params["prompt"]
        try:
            p["prompt_ids"] = self.prompts.encode(text, limit=n_ctx - 1)
        except PromptTooLong as e:
            raise too_long(str(e), n_ctx) from None
        if not p["prompt_ids"]:
            raise RequestError("empty prompt: give at least one token")
        return p

    def timeout_for(self, params: dict) -> float | None:
        """The request's own `timeout`, capped by the server's --request-timeout (0 = none)."""
        mine, cap = params.get("timeout"), self.request_timeout or None
        return min(x for x in (mine, cap) if x) if (mine or cap) else None

    def submit(self, params: dict, loop: asyncio.AbstractEventLoop, arrived: float | None = None) -> tuple[Job, int]:
        """Queue a prepared request (from the loop); returns the job and how many requests are ahead of it.
        `arrived`: when the request came in (monotonic), where its deadline counts from."""
        timeout = self.timeout_for(params)
        job = Job(params, loop, self, timeout, arrived)
        with self._lock:
            if not self.accepting:
                raise RequestError("the daemon is shutting down and takes no new requests", SHUTDOWN)
            ahead = len(self._waiting) + (self.running is not None)
            self._waiting.append(job)
        if job.deadline is not None:  # a waiting job times out at its deadline, not when it reaches the worker
            job.timer = loop.call_later(max(0.0, job.deadline - time.monotonic()), job.cancel, TIMEOUT)
        self._queue.put(job)
        return job, ahead

    def queue_length(self) -> int:
        with self._lock:
            return len(self._waiting) + (self.running is not None)

    def counts(self) -> tuple[int, int]:
        """(running, waiting)."""
        with self._lock:
            return int(self.running is not None), len(self._waiting)

    def cancel(self, job: Job, reason: str) -> bool:
        with self._lock:
            if job.state == FINISHED or job.cancelled.is_set():
                return False
            job.reason = reason
            job.cancelled.set()
            job.cancel_time = time.monotonic()   # after the flag: a step decided before this saw no flag
            self.cancel_stats.by_reason[reason] += 1
            dropped = job.state == WAITING
            if dropped:  # never started: gone from the queue now, so health and positions stop counting it
                self._waiting.remove(job)
                job.state = FINISHED
        if dropped:
            job.finished()
            job.emit(self._unstarted_end(job))
            job.emit(None)
        return True

    def cancel_waiting(self, reason: str) -> None:
        with self._lock:
            waiting = list(self._waiting)
        for j in waiting:
            j.cancel(reason)

    def stop_accepting(self) -> None:
        with self._lock:
            self.accepting = False

    def close(self, timeout: float = 5.0) -> None:
        self.stop_accepting()
        self.cancel_waiting(SHUTDOWN)
        running = self.running
        if running is not None:
            running.cancel(SHUTDOWN)
        self._queue.put(None)
        self._worker.join(timeout=timeout)

    # -- worker side ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._lock:
                if job.state != WAITING:   # dropped while it waited
                    continue
                self._waiting.remove(job)
                job.state = RUNNING
                self.running = job
            end = self._serve(job)
            with self._lock:  # finished before the client can read its end: health never counts it
                job.state = FINISHED
                self.running = None
                self.served += 1
            job.finished()
            job.emit(end)
            job.emit(None)

    def _serve(self, job: Job) -> dict:
        """Run one job; returns its terminal event."""
        try:
            job.emit({"event": "start"})
            return self._decode(job)
        except DFlashError as e:
            if job.cancelled.is_set():  # e.g. "prefill cancelled": say why it was cancelled instead
                return self._early_end(job, None)
            return _event_error(str(e), getattr(e, "code", BAD_REQUEST))
        except Exception:  # a bug: the log gets the traceback, the client a plain message; keep serving
            self.log("internal error while decoding:\n" + traceback.format_exc().rstrip())
            return _event_error("internal error while decoding (the daemon's log has the details)", INTERNAL)

    def _unstarted_end(self, job: Job) -> dict:
        if job.reason == TIMEOUT:
            return _event_error(f"timed out after {job.timeout:g} s waiting in the queue (timeout)", TIMEOUT)
        if job.reason == SHUTDOWN:
            return _event_error("the daemon is shutting down: the request was not started", SHUTDOWN)
        return _event_error("cancelled: the client went away", CLIENT_GONE)

    def _early_end(self, job: Job, done: dict | None) -> dict:
        """The terminal event of a job stopped before its end.  `done`: what it decoded (None: in prefill)."""
        self.cancel_stats.latency_max_s = max(self.cancel_stats.latency_max_s, time.monotonic() - job.cancel_time)
        n = len(done["tokens"]) if done else 0
        if job.reason == TIMEOUT:
            if done is None:
                return _event_error(f"timed out after {job.timeout:g} s during the prompt's prefill (timeout)",
                                    TIMEOUT)
            done["stats"]["stop_reason"] = "timeout"
            return done
        if job.reason == SHUTDOWN:
            return _event_error(f"the daemon is shutting down: the request was stopped after {n} tokens",
                                SHUTDOWN)
        return _event_error("cancelled: the client went away", CLIENT_GONE)

    def _count_after_cancel(self, job: Job, decided: float, n_tokens: int) -> None:
        if job.cancel_time is not None and job.cancel_time < decided:
            self.cancel_stats.steps_after += 1
            self.cancel_stats.tokens_after += n_tokens

    def _decode(self, job: Job) -> dict:
        p, dec = job.params, self.decoder
        stream, stop = p["stream"], StopMatcher(p["stop"])
        sd = dec.tokenizer.stream_decoder()
        tokens: list[int] = []
        stopped = cancelled = False
        want_lp = p.get("logprobs") is not None
        steps = dec.stream_ids(p["prompt_ids"], p["max_new_tokens"], **_decode_kwargs(p),
                               cache=p.get("cache_prompt", True), logprobs=p.get("logprobs"),
                               on_prefill=lambda done, total: job.stop_requested())
        try:
            while True:
                decided = time.monotonic()
                if job.stop_requested():
                    cancelled = True
                    break
                toks = next(steps, None)
                if toks is None:
                    break
                self._count_after_cancel(job, decided, len(toks))
                tokens += toks
                piece, stopped = stop.push("".join(sd.push(t) for t in toks))
                if stream:
                    ev = {"event": "token", "ids": toks, "text": piece}
                    if want_lp:
                        ev["logprobs"] = dec.last_logprobs(len(tokens) - len(toks))
                    job.emit(ev)
                if stopped:
                    break
        finally:
            steps.close()
        stats = self._account(dec.last_stats().to_dict())
        if cancelled and job.reason != TIMEOUT:
            return self._early_end(job, {"tokens": tokens})
        if not stopped:
            piece, stopped = stop.push(sd.flush())
            piece += "" if stopped else stop.flush()
            if stream and piece:
                job.emit({"event": "token", "ids": [], "text": piece})
        if stopped:
            stats["stop_reason"] = "stop"
        done = {"event": "done", "tokens": tokens, "text": stop.text, "stats": stats}
        if want_lp:
            done["logprobs"] = dec.last_logprobs()[:len(tokens)]
        return self._early_end(job, done) if cancelled else done

    def _account(self, stats: dict) -> dict:
        """Add a decode's stats to the totals /metrics reports."""
        self.prompt_tokens_total += stats["prompt_tokens"]
        self.prefilled_tokens_total += stats["prompt_tokens"] - stats["cached_tokens"]
        self.prefill_seconds_total += stats["prefill_s"]
        self.cached_tokens_total += stats["cached_tokens"]
        self.generated_tokens_total += stats["generated_tokens"]
        self.decode_steps_total += stats["steps"]
        self.decode_seconds_total += stats["decode_s"]
        return stats


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


async def parse_off_loop(data: bytes | str) -> Any:
    """parse_json_request, on a helper thread for anything big enough to be felt by the loop."""
    if len(data) < 65536:
        return parse_json_request(data)
    return await asyncio.to_thread(parse_json_request, data)


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
        self.service = DecodeService(self.decoder, self.options.request_timeout, self.log)
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
                "served": s.served, "cancelled": dict(c.by_reason),
                "after_cancel": {"steps": c.steps_after, "tokens": c.tokens_after},
                "cancel_latency_max_s": round(c.latency_max_s, 4), "loop_lag_max_s": round(self.loop_lag_max_s, 4),
                "uptime_s": round(time.time() - s.started, 3), "rss_bytes": _rss_bytes(), "pid": os.getpid(),
                "cache": d.prefix_cache.stats() if d.prefix_cache is not None else None}

    # -- requests, from either front ---------------------------------------------------------------------------
    async def admit(self, params: dict) -> tuple[Job, int]:
        """Prepare (render, tokenize, check against the context; off the loop) and queue a validated request."""
        arrived = time.monotonic()
        if not self.service.accepting:
            raise RequestError("the daemon is shutting down and takes no new requests", SHUTDOWN)
        prepared = await asyncio.to_thread(self.service.prepare, params)
        return self.service.submit(prepared, asyncio.get_running_loop(), arrived)

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
            await self._write(writer, _event_error(f"request line longer than {self.options.max_body} bytes"))
            return True
        if not raw.strip():
            return True
        try:
            req = await parse_off_loop(raw)
        except RequestError as e:
            await self._write(writer, _event_error(str(e), e.code))
            return True
        if not isinstance(req, dict):
            await self._write(writer, _event_error("a request must be a JSON object"))
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
            await self._write(writer, {**_event_error(f"unknown op {op!r} (known: generate, health, shutdown)"),
                                       **tag})
            return True
        try:
            job, ahead = await self.admit(parse_generate(req))
        except RequestError as e:
            await self._write(writer, {**_event_error(str(e), e.code), **tag})
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
        """Stop taking requests, let the running one finish within the grace, end everything else."""
        self.service.stop_accepting()
        for s in servers:
            s.close()
        if self._http_server is not None:
            self._http_server.stop_listening()
        self.service.cancel_waiting(SHUTDOWN)
        if not await self._wait(lambda: self.service.running is None, self.options.shutdown_grace):
            running = self.service.running
            if running is not None:
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
