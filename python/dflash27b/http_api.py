"""OpenAI-compatible HTTP front of the daemon (`dflash27b serve --http HOST:PORT`), on Starlette + uvicorn.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (JSON or SSE streaming with
`data: [DONE]`), GET /health, POST /tokenize, POST /detokenize, GET /metrics (Prometheus text), as
llama-server offers them.  Every OpenAI request field is honoured, a no-op where it cannot change the answer,
or refused with 400 naming it; null means "not given", as in OpenAI's API.  Requests go through the
daemon's one decode queue, like socket requests, and a request whose client disconnects (streamed or not)
is cancelled at the next decode step.  OpenAI's sampling fields map onto the engine's; `mode`, `budget`,
`top_k`, `min_p`, `ignore_eos`, `timeout`, ... may be passed as extra body fields (openai client:
`extra_body={...}`).  Chat prompts use the GGUF's template.  The guards in front of the app (Host, API key,
CORS, body limits, read deadlines) are in http_guard.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass

from ._lib import DFlashError, version_line
from .decode_service import Job
from .params import INT32_MAX, GenParams
from .tool_calls import parse_tools
from .chat_reply import ReplySplit, template_thinks
from .serve_protocol import (BAD_REQUEST, CHOICE_FAILED, CLIENT_GONE, INTERNAL, SHUTDOWN, TIMEOUT, RequestError,
                             parse_generate, parse_off_loop)

try:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response
    from starlette.routing import Route

    from .http_guard import (ApiKeyGuard, BodyGuard, HostGuard, JsonCORSMiddleware, allowed_hosts, deadline_protocol,
                             error_body)
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise DFlashError("the HTTP front needs starlette and uvicorn: pip install 'dflash27b[serve]'") from e

# engine fields a body may carry besides OpenAI's (openai client: extra_body): every generation setting
# (GenParams, its old spellings too) but those OpenAI names itself, and the protocol's cache_prompt and timeout
_OPENAI_SPELLED = {"max_new_tokens", "logprobs", "temperature", "top_p", "seed", "logit_bias"}
_EXTRA = tuple(n for n in (*GenParams.names(), *GenParams.aliases()) if n not in _OPENAI_SPELLED) + \
    ("cache_prompt", "timeout")

# Every OpenAI request field is honoured, accepted as a no-op where it cannot change the answer, or refused
# with HTTP 400 naming it (docs/PROTOCOL.md has the table).  Unknown fields are refused too.
_HONOURED = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
             "stop", "stream", "stream_options", "n", "logprobs", "top_logprobs",
             "return_tokens_as_token_ids", "response_format", "chat_template_kwargs", "logit_bias"} | set(_EXTRA)
# no-ops, with the type OpenAI gives them (a wrong type is still a 400)
_NO_OP = {"user": (str, "a string"), "metadata": (dict, "an object"), "store": (bool, "true or false"),
          "service_tier": (str, "a string")}
_TYPED = {"model": (str, "a string"), "stream": (bool, "true or false"),
          "return_tokens_as_token_ids": (bool, "true or false")}


def _neutral(k: str, v) -> bool:
    """Values of the not-honoured fields that ask for nothing (so the answer cannot change)."""
    return {
        "functions": v == [],
        "function_call": v == "none",
        "echo": v is False,
        "suffix": v == "",
        "best_of": v == 1,
        "modalities": v == ["text"],
    }.get(k, False)


_WHY = {"functions": "function calls are not supported", "function_call": "function calls are not supported",
        "echo": "chat completions do not echo the prompt (/v1/completions does)",
        "suffix": "suffix (insertion) is not supported",
        "best_of": "only best_of=1 is supported", "modalities": "only [\"text\"] output is supported"}

# fields of /v1/chat/completions only
_CHAT_ONLY = ("chat_template_kwargs", "tools", "tool_choice", "parallel_tool_calls")

_MESSAGE_FIELD_WHY = {"name": "participant names are not passed to the chat template",
                      "function_call": "function calls are not supported (use tool_calls)",
                      "audio": "audio is not supported",
                      "refusal": "refusals are not passed to the chat template"}

STATUS = {BAD_REQUEST: 400, TIMEOUT: 503, SHUTDOWN: 503, INTERNAL: 500, CLIENT_GONE: 499, CHOICE_FAILED: 500}


def _fail(message: str) -> RequestError:
    return RequestError(message)


def _typed(v, t) -> bool:
    return isinstance(v, t) and not (t is not bool and isinstance(v, bool))


# -- an OpenAI body -> an engine request ----------------------------------------------------------------------

@dataclass
class Shape:
    """How the reply is written: the HTTP side of the request."""
    chat: bool
    stream: bool = False
    include_usage: bool = False
    token_ids: bool = False   # vLLM's return_tokens_as_token_ids: tokens spelled "token_id:N"
    n: int = 1                # choices: n requests, decoded in slots as the daemon's --parallel allows
    echo: bool = False        # completions: the prompt's text (and log-probabilities) before the reply's


# choices one request may ask for, and queued requests in all (a batch of prompts times n): each is a request of
# its own in the daemon's queue
MAX_CHOICES = 64
MAX_REQUESTS = 256


def _check_fields(body: dict, chat: bool) -> None:
    for k, v in body.items():
        if k == "echo" and not chat:   # honoured on completions
            if not isinstance(v, bool):
                raise _fail("'echo' must be true or false")
        elif k in _NO_OP or k in _TYPED:
            t, what = _NO_OP.get(k) or _TYPED[k]
            if not _typed(v, t):
                raise _fail(f"'{k}' must be {what}")
        elif k in _WHY:
            if not _neutral(k, v):
                raise _fail(f"'{k}' is not supported: {_WHY[k]}")
        elif k not in _HONOURED:
            raise _fail(f"unknown request field '{k}'")
    chat_only = [k for k in _CHAT_ONLY if k in body]
    if not chat and chat_only:   # (a raw prompt has no template to list the tools, nor a reply to parse calls from)
        raise _fail(f"'{chat_only[0]}' belongs to /v1/chat/completions")
    if ("messages" if not chat else "prompt") in body:
        raise _fail(f"'{'messages' if not chat else 'prompt'}' belongs to /v1/"
                    f"{'chat/completions' if not chat else 'completions'}")
    n = body.get("n", 1)
    if not _typed(n, int) or not 1 <= n <= MAX_CHOICES:
        raise _fail(f"'n' must be an integer from 1 to {MAX_CHOICES}")


def _stream_shape(body: dict, chat: bool) -> Shape:
    shape = Shape(chat, stream=body.get("stream", False), token_ids=body.get("return_tokens_as_token_ids", False),
                  n=body.get("n", 1), echo=not chat and body.get("echo", False))
    so = body.get("stream_options")
    if so is not None:
        if not shape.stream:
            raise _fail("'stream_options' is only allowed with \"stream\": true")
        if not isinstance(so, dict) or set(so) - {"include_usage"} or not isinstance(so.get("include_usage", False),
                                                                                        bool):
            raise _fail("'stream_options' takes only {\"include_usage\": true|false}")
        shape.include_usage = so.get("include_usage", False)
    return shape


def _content_text(content, where: str) -> str:
    """A message's content: a string, or a list of text parts (joined); anything else is refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _fail(f"{where}.content must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise _fail(f"{where}.content[{j}]: {repr(kind) + ' parts are' if kind else 'a part without a type is'}"
                        " not supported (text only)")
        if set(part) - {"type", "text"} or not isinstance(part.get("text"), str):
            raise _fail(f"{where}.content[{j}] must be {{\"type\": \"text\", \"text\": string}}")
        texts.append(part["text"])
    return "".join(texts)


def _chat_messages(msgs) -> list[dict]:
    """OpenAI messages -> the protocol's: content parts joined to text, nulls dropped (an assistant's content
    may be null beside its tool_calls); the protocol checks the rest (serve_protocol.message_problem)."""
    if not isinstance(msgs, list) or not msgs:
        raise _fail("'messages' must be a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _fail(f"{where} must be an object {{role, content}}")
        for k, v in m.items():
            if k in _MESSAGE_FIELD_WHY and v is not None:
                raise _fail(f"{where}: '{k}' is not supported: {_MESSAGE_FIELD_WHY[k]}")
        if m.get("role") == "function":
            raise _fail(f"{where}: 'function' messages are not supported (use role 'tool')")
        msg = {k: v for k, v in m.items() if v is not None and k not in _MESSAGE_FIELD_WHY}
        if "content" in msg or m.get("role") != "assistant":
            msg["content"] = _content_text(m.get("content"), where)
        elif "tool_calls" in msg:
            msg["content"] = None
        out.append(msg)
    return out


def _prompts(p) -> list[dict]:
    """A completion's prompt: a string, a list of token ids, or a batch (a list of either), one request each."""
    def one(q):
        if isinstance(q, str):
            return {"prompt": q}
        if isinstance(q, list) and q and all(_typed(t, int) for t in q):
            return {"prompt_ids": q}
        return None
    if (single := one(p)) is not None:
        return [single]
    batch = [one(q) for q in p] if isinstance(p, list) and p and all(isinstance(q, (str, list)) for q in p) else [None]
    if None in batch:
        raise _fail("'prompt' must be a string, a list of token ids, or a batch: a list of either")
    return batch


def _logprobs(body: dict, chat: bool) -> dict:
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:  # logprobs: bool, top_logprobs: 0..20 alternatives
        if lp is not None and not isinstance(lp, bool):
            raise _fail("'logprobs' must be true or false")
        if top is not None and (not _typed(top, int) or not 0 <= top <= 20):
            raise _fail("'top_logprobs' must be an integer in 0..20")
        if top and not lp:
            raise _fail("'top_logprobs' needs 'logprobs': true")
        return {"logprobs": top or 0} if lp else {}
    if top is not None:  # completions: logprobs = the number of alternatives (0..20)
        raise _fail("'top_logprobs' is a chat field; completions take 'logprobs': k")
    if lp is None:
        return {}
    if not _typed(lp, int) or not 0 <= lp <= 20:
        raise _fail("'logprobs' must be an integer in 0..20")
    return {"logprobs": lp}


def _response_format(v) -> dict:
    """OpenAI's response_format -> the engine's json_schema setting: {"type": "text"} asks for nothing,
    {"type": "json_object"} any JSON object, {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    that schema (strict or not, the reply always validates)."""
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise _fail("'response_format' must be an object with a 'type'")
    kind = v["type"]
    if kind == "text" and len(v) == 1:
        return {}
    if kind == "json_object" and len(v) == 1:
        return {"json_schema": {"type": "object"}}
    if kind == "json_schema" and set(v) == {"type", "json_schema"}:
        js = v["json_schema"]
        if not isinstance(js, dict) or set(js) - {"name", "schema", "strict", "description"}:
            raise _fail("'response_format.json_schema' takes name, schema, strict and description")
        if not isinstance(js.get("name"), str) or not js["name"]:
            raise _fail("'response_format.json_schema.name' is required (a string)")
        schema = js.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise _fail("'response_format.json_schema.schema' must be a JSON schema object")
        return {"json_schema": schema}
    raise _fail("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                "{\"type\": \"json_schema\", \"json_schema\": {...}}")


def to_engine(body: dict, chat: bool) -> tuple[list[dict], Shape]:
    """An OpenAI request body -> (validated daemon generate requests: one, or one per prompt of a completions
    batch; how to write the reply)."""
    body = {k: v for k, v in body.items() if v is not None}   # OpenAI: null = not given
    _check_fields(body, chat)
    shape = _stream_shape(body, chat)
    if chat:
        req = {"messages": _chat_messages(body.get("messages"))}
    else:
        if "prompt" not in body:
            raise _fail("'prompt' is required")
        prompts = _prompts(body["prompt"])
        if len(prompts) * shape.n > MAX_REQUESTS:
            raise _fail(f"{len(prompts)} prompts x n={shape.n} choices is more than {MAX_REQUESTS} requests")
        req = prompts[0]
    req.update(_logprobs(body, chat))
    if shape.echo and "logprobs" in req:   # echo with logprobs: every prompt token's too (vLLM's prompt_logprobs)
        req["prompt_logprobs"] = req["logprobs"]
    names = {}
    # without max_tokens a reply runs to its end or the context's, as OpenAI's chat, vLLM and llama-server
    # decode (the engine's own default, 256, is the CLI's)
    req["max_new_tokens"] = INT32_MAX
    for k in ("max_tokens", "max_completion_tokens"):   # the newer name wins where both are given
        if k in body:
            req["max_new_tokens"], names["max_new_tokens"] = body[k], k
    # OpenAI's default temperature is 1.0 (sampling); pass temperature=0 for greedy, exact decoding
    req["temperature"] = body.get("temperature", 1.0)
    for k in ("top_p", "seed", "stop", "chat_template_kwargs", "logit_bias", *_EXTRA):
        if k in body:
            req[k] = body[k]
    if "response_format" in body:
        rf = _response_format(body["response_format"])
        if rf and ("json_schema" in body or "grammar" in body):
            raise _fail("'response_format' and 'json_schema' / 'grammar' ask for two constraints: give one")
        req.update(rf)
    req["stream"] = shape.stream
    if chat:
        return [parse_generate(req, names)], shape
    base = {k: v for k, v in req.items() if k not in ("prompt", "prompt_ids")}
    return [parse_generate({**base, **p}, names) for p in prompts], shape


# -- replies ----------------------------------------------------------------------------------------------------

class TokenSpelling:
    """A token's text in replies: its text when its bytes are UTF-8, else OpenAI's `bytes:\\xNN...` spelling
    (so two partial-character tokens never share a key); "token_id:N" with return_tokens_as_token_ids."""

    def __init__(self, tokenizer, as_ids: bool):
        self.tok, self.as_ids = tokenizer, as_ids

    def text(self, t: int) -> str:
        if self.as_ids:
            return f"token_id:{t}"
        b = self.tok.token_bytes(t)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{x:02x}" for x in b)

    def entry(self, t: int, logprob: float) -> dict:
        return {"token": self.text(t), "logprob": logprob, "bytes": list(self.tok.token_bytes(t))}


class LogprobShaper:
    """OpenAI's logprobs shapes: chat {"content": [...]}, completions {"tokens", "token_logprobs",
    "top_logprobs", "text_offset"}.  Offsets run on across the chunks of one reply."""

    def __init__(self, tokenizer, shape: Shape):
        self.spell = TokenSpelling(tokenizer, shape.token_ids)
        self.chat = shape.chat
        self._chars = tokenizer.stream_decoder()   # text offsets count the reply's decoded characters
        self._offset = 0

    def __call__(self, entries: list[dict] | None) -> dict | None:
        if entries is None:
            return None
        if self.chat:
            return {"content": [{**self.spell.entry(e["token"], e["logprob"]),
                                 "top_logprobs": [self.spell.entry(i, p) for i, p in e["top"]]} for e in entries]}
        return {"tokens": [self.spell.text(e["token"]) for e in entries],
                "token_logprobs": [e["logprob"] for e in entries],   # (an echoed prompt's first token: null)
                "top_logprobs": [None if e["top"] is None else {self.spell.text(i): p for i, p in e["top"]}
                                 for e in entries],
                "text_offset": [self._advance(e["token"]) for e in entries]}

    def _advance(self, t: int) -> int:
        at = self._offset
        self._offset += len(self._chars.push(t))
        return at


def _finish(stop_reason: str, calls: bool = False) -> str:
    # a deadline is a limit like max_tokens (llama-server maps its time limit to "length" too); a reply that
    # ended on its own after tool calls ends with "tool_calls", as OpenAI's do
    if stop_reason in ("length", "context_full", "timeout"):
        return "length"
    return "tool_calls" if calls else "stop"


def _usage(stats: dict) -> dict:
    return {"prompt_tokens": stats["prompt_tokens"], "completion_tokens": stats["generated_tokens"],
            "total_tokens": stats["prompt_tokens"] + stats["generated_tokens"],
            "prompt_tokens_details": {"cached_tokens": stats.get("cached_tokens", 0)}}


def _ours(stats: dict) -> dict:
    return {k: stats[k] for k in ("mode", "mean_accept", "decode_tok_s", "stop_reason")}


def _timings(stats: dict) -> dict:
    """llama-server's `timings` object, which harnesses written for it read (tokens/s, and whether speculation
    ran and paid: draft_n, draft_n_accepted).  prompt_n counts the prompt tokens prefilled, cache_n those the
    prefix cache restored; the reply's first token comes out of the prefill, so predicted_per_second is the
    rate of the tokens after it over predicted_ms (our decode_tok_s).  draft_n: the draft tokens verified (a
    tree's nodes), draft_n_accepted: those kept; both only when a step drafted, as llama-server omits them."""
    cached = stats.get("cached_tokens", 0)
    prompt_n, prompt_ms = stats["prompt_tokens"] - cached, stats["prefill_s"] * 1e3
    out = {"cache_n": cached, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
           "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
           "prompt_per_second": prompt_n / stats["prefill_s"] if stats["prefill_s"] > 0 else 0.0,
           "predicted_n": stats["generated_tokens"], "predicted_ms": stats["decode_s"] * 1e3,
           "predicted_per_token_ms": 1e3 / stats["decode_tok_s"] if stats["decode_tok_s"] > 0 else 0.0,
           "predicted_per_second": stats["decode_tok_s"]}
    drafted = sum(stats.get("tree_size") or [])
    if drafted:
        # a step commits its accepted draft tokens and one of the target's own (the last step only what
        # max_tokens kept; a step that drafted nothing commits its one token, none accepted)
        out["draft_n"] = drafted
        out["draft_n_accepted"] = sum(max(a - 1, 0) for a in stats["accept_lengths"])
    return out


class Reply:
    """The OpenAI objects of one reply (JSON body, or SSE chunks)."""

    def __init__(self, shape: Shape, model: str, tokenizer, think_open: bool = False, tools=None, index: int = 0):
        self.shape, self.index = shape, index
        self.echo_text: str | None = None   # echo: the prompt's text, written before the reply's
        self.echo_logprobs = False          # ... with the prompt tokens' log-probabilities
        # a chat reply: a thinking template's <think> block goes to reasoning_content, tool calls (with tools)
        # to tool_calls
        thinks = template_thinks(tokenizer.chat_template)
        self.split = ReplySplit(thinks, think_open, tools) if shape.chat and (thinks or tools) else None
        self.n_calls = 0
        self.id = ("chatcmpl-" if shape.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created, self.model = int(time.time()), model
        self.kind = "chat.completion" if shape.chat else "text_completion"
        self.logprobs = LogprobShaper(tokenizer, shape)

    def _head(self, chunk: bool) -> dict:
        kind = self.kind + ".chunk" if chunk and self.shape.chat else self.kind
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def chunk(self, text: str | None, finish: str | None = None, first: bool = False, lps=None,
              extra: dict | None = None, reasoning: str | None = None, calls: list | None = None) -> bytes:
        if self.shape.chat:
            delta = ({"role": "assistant"} if first else {}) | ({"reasoning_content": reasoning} if reasoning else {})
            if text is not None:
                delta["content"] = text
            if calls:   # each call whole, in one delta (OpenAI's clients assemble deltas by index)
                delta["tool_calls"] = calls
                self.n_calls += len(calls)
            choice = {"index": self.index, "delta": delta, "finish_reason": finish, "logprobs": self.logprobs(lps)}
        else:
            choice = {"index": self.index, "text": text or "", "finish_reason": finish, "logprobs": self.logprobs(lps)}
        return sse({**self._head(True), "choices": [choice], **(extra or {})})

    def usage_chunk(self, usage: dict) -> bytes:   # OpenAI's shape: one more chunk, no choices, the usage
        return sse({**self._head(True), "choices": [], "usage": usage})

    def body(self, done: dict) -> dict:
        text, entries = done["text"], done.get("logprobs")
        # echo: the prompt first, its log-probabilities too (asked for them, a reply cut before they existed is
        # the reply alone: text and logprobs stay in step)
        if self.echo_text is not None and (not self.echo_logprobs or done.get("prompt_logprobs") is not None):
            text = self.echo_text + text
            if self.echo_logprobs:
                entries = done["prompt_logprobs"] + (entries or [])
        fin, lps = _finish(done["stats"]["stop_reason"]), self.logprobs(entries)
        if self.shape.chat:
            msg = {"role": "assistant", "content": done["text"]}
            if self.split is not None:
                msg = self.split.message(done["text"])
                fin = _finish(done["stats"]["stop_reason"], bool(msg.get("tool_calls")))
            choice = {"index": self.index, "message": msg, "finish_reason": fin, "logprobs": lps}
        else:
            choice = {"index": self.index, "text": text, "finish_reason": fin, "logprobs": lps}
        return {**self._head(False), "choices": [choice], "usage": _usage(done["stats"]),
                "timings": _timings(done["stats"]), "dflash27b": _ours(done["stats"])}


def _usage_of(stats: list[dict], n: int) -> dict:
    """The usage of a request's choices (n per prompt, prompt by prompt): each prompt once, every choice's tokens."""
    firsts = stats[::n]
    prompt = sum(s["prompt_tokens"] for s in firsts)
    completion = sum(s["generated_tokens"] for s in stats)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(s.get("cached_tokens", 0) for s in firsts)}}


def _body_of(replies: list[Reply], done: list[dict]) -> dict:
    """One response for every choice (n per prompt; a completions batch prompt by prompt): each choice's own
    body, one usage; our stats per choice (a list when there are several)."""
    bodies = [r.body(d) for r, d in zip(replies, done)]
    out = bodies[0]
    if len(bodies) > 1:
        out["choices"] = [b["choices"][0] for b in bodies]
        out["usage"] = _usage_of([d["stats"] for d in done], replies[0].shape.n)
        out["timings"] = [b["timings"] for b in bodies]
        out["dflash27b"] = [b["dflash27b"] for b in bodies]
    return out


def sse(obj: dict) -> bytes:
    import json
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def error_response(status: int, message: str, kind: str | None = None, headers: dict | None = None) -> Response:
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    return Response(error_body(status, message, kind), status_code=status, media_type="application/json",
                    headers=headers)


def _request_error(e: RequestError) -> Response:
    return error_response(STATUS.get(e.code, 400), str(e))


async def wait_disconnect(receive) -> None:
    """Returns when the client has gone (the body was read before, so nothing else arrives)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream:
    """A request's reply as server-sent events, ending in `data: [DONE]`: one job, or one per choice (`n`),
    their chunks in the order they come, each naming its choice.  Every job is cancelled the moment the client
    disconnects; a job ended by the daemon (shutdown, a queue timeout, an error) ends the stream with an
    `{"error": {...}}` object naming why, and the other choices with it."""

    def __init__(self, jobs: list[Job], replies: list[Reply], daemon):
        self.jobs, self.replies, self.daemon = jobs, replies, daemon

    def _cancel(self, reason: str = CLIENT_GONE) -> None:
        for job in self.jobs:
            job.cancel(reason)   # no-op when it finished

    async def __call__(self, scope, receive, send) -> None:
        self.daemon.request_opened()
        watcher = asyncio.create_task(self._watch(receive))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]})
            async with contextlib.aclosing(self._chunks()) as chunks:   # closed at once when send fails
                async for data in chunks:
                    await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass   # the client went away while we wrote
        finally:
            watcher.cancel()
            self._cancel()
            self.daemon.request_closed()

    async def _watch(self, receive) -> None:
        await wait_disconnect(receive)
        self._cancel()

    async def _events(self):
        """(choice, event) of every job as they come, until each job has ended."""
        if len(self.jobs) == 1:
            while (ev := await self.jobs[0].events.get()) is not None:
                yield 0, ev
            return
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, job: Job) -> None:
            while (ev := await job.events.get()) is not None:
                await merged.put((i, ev))
            await merged.put((i, None))
        pumps = [asyncio.create_task(pump(i, job)) for i, job in enumerate(self.jobs)]
        try:
            left = len(pumps)
            while left:
                i, ev = await merged.get()
                if ev is None:
                    left -= 1
                else:
                    yield i, ev
        finally:
            for p in pumps:
                p.cancel()

    def _event_chunks(self, i: int, ev: dict, stats: list) -> list[bytes]:
        """Choice i's chunks for one of its events (its prompt_logprobs, a token, its end)."""
        r = self.replies[i]
        if ev["event"] == "prompt_logprobs" and r.echo_text is not None:
            return [r.chunk(r.echo_text, lps=ev["logprobs"])]
        if ev["event"] == "token" and (ev["text"] or ev.get("logprobs")):
            if r.split is None:
                return [r.chunk(ev["text"], lps=ev.get("logprobs"))]
            reasoning, content, calls = r.split.push(ev["text"])
            if reasoning or content or calls or ev.get("logprobs"):
                return [r.chunk(content or None, lps=ev.get("logprobs"), reasoning=reasoning, calls=calls)]
        elif ev["event"] == "done":
            out = []
            stats[i] = ev["stats"]
            if r.split is not None:
                reasoning, content, calls = r.split.flush()
                if reasoning or content or calls:
                    out.append(r.chunk(content or None, reasoning=reasoning, calls=calls))
            out.append(r.chunk(None if r.shape.chat else "", _finish(stats[i]["stop_reason"], r.n_calls > 0),
                               extra={"timings": _timings(stats[i]), "dflash27b": _ours(stats[i])}))
            return out
        return []

    async def _chunks(self):
        replies = self.replies
        n = replies[0].shape.n
        if replies[0].shape.chat:
            for r in replies:
                yield r.chunk(None, first=True)
        stats: list[dict | None] = [None] * len(replies)
        failed = False
        for r in replies:   # echo without log-probabilities: the prompt's text first (with them: when they come)
            if r.echo_text is not None and not r.echo_logprobs:
                yield r.chunk(r.echo_text)
        # the prompt's log-probabilities are every choice's: its first choice computes them (admit_choices), and
        # the others' chunks wait for them, their echo first
        held = {i: [] for i, r in enumerate(replies) if r.echo_logprobs and r.echo_text is not None and i % n}

        def release(first: int, lps) -> list[bytes]:
            out = []
            for j in range(first + 1, first + n):
                if j in held:
                    out += ([replies[j].chunk(replies[j].echo_text, lps=lps)] if lps is not None else []) + held.pop(j)
            return out
        async with contextlib.aclosing(self._events()) as events:
            async for i, ev in events:
                if failed:
                    continue   # the other choices, cancelled with the first error: drained, not written
                if ev["event"] == "error":
                    failed = True
                    self._cancel(CHOICE_FAILED)
                    code = STATUS.get(ev.get("code"), 400)
                    yield sse({"error": {"message": ev["message"], "type": "server_error" if code >= 500 else
                                         "invalid_request_error", "code": code}})
                    continue
                out = self._event_chunks(i, ev, stats)
                if i in held:
                    held[i] += out
                    continue
                for data in out:
                    yield data
                if i % n == 0 and (ev["event"] == "prompt_logprobs" or ev["event"] == "done"):
                    # (a first choice that ended without them: its cut reply had none to share)
                    for data in release(i, ev.get("logprobs") if ev["event"] == "prompt_logprobs" else None):
                        yield data
        for i in list(held):   # (a group whose first choice never spoke: what the others said, as it came)
            for data in held.pop(i):
                yield data
        if replies[0].shape.include_usage and not failed and all(s is not None for s in stats):
            yield replies[0].usage_chunk(_usage_of(stats, replies[0].shape.n))
        yield b"data: [DONE]\n\n"


# -- endpoints --------------------------------------------------------------------------------------------------

class OpenAIFront:
    def __init__(self, daemon):
        self.daemon = daemon
        self.service = daemon.service
        self.decoder = daemon.decoder
        self._bucket = (0, 0.0, 0, 0.0)   # llama-server's throughput gauges cover the time since the last scrape

    async def _json_body(self, request: Request) -> dict:
        body = await parse_off_loop(await request.body())
        if not isinstance(body, dict):
            raise _fail("the request body must be a JSON object")
        return body

    async def models(self, _: Request):
        d = self.decoder
        return JSONResponse({"object": "list", "data": [{
            "id": self.daemon.model_name, "object": "model", "created": int(self.service.started),
            "owned_by": "dflash27b", "meta": {"target": d.target, "draft": d.draft, "n_ctx": d.n_ctx}}]})

    async def props(self, _: Request):
        """llama-server's GET /props, the fields its clients read: the model, the slots and their context, the
        chat template and its special tokens, what an omitted sampling field means here, the build; plus the
        drafter and default mode.  Setting properties (POST) is not offered."""
        d, tok = self.decoder, self.decoder.tokenizer
        defaults = GenParams()

        def piece(i: int | None) -> str:
            return tok.decode([i]) if i is not None else ""
        return JSONResponse({
            "model_alias": self.daemon.model_name, "model_path": d.target, "total_slots": self.service.parallel,
            "modalities": {"vision": False, "audio": False}, "build_info": version_line(),
            "chat_template": tok.chat_template or "",
            "bos_token": piece(tok.bos_id), "eos_token": piece(tok.eos_id),
            # an omitted field over HTTP: OpenAI's temperature 1.0, no token limit but the context's (-1)
            "default_generation_settings": {"n_ctx": d.n_ctx, "params": {
                "temperature": 1.0, "top_k": defaults.top_k, "top_p": defaults.top_p, "min_p": defaults.min_p,
                "typical_p": defaults.typical_p, "n_predict": -1, "seed": -1}},
            "dflash27b": {"draft": d.draft, "default_mode": d.default_mode, "device": d.device}})

    async def health(self, request: Request):
        state = request.scope.get("state", {})
        h = self.daemon.health()
        status = 200 if self.service.accepting else 503
        if state.get("authorised") is False:   # --api-key set, none given: liveness only, no paths or pid
            return JSONResponse({"status": h["status"]}, status_code=status)
        return JSONResponse(h, status_code=status)

    async def chat_completions(self, request: Request):
        return await self._completion(request, chat=True)

    async def completions(self, request: Request):
        return await self._completion(request, chat=False)

    async def _completion(self, request: Request, chat: bool):
        jobs: list[Job] = []
        try:
            batch, shape = to_engine(await self._json_body(request), chat)
            for params in batch:   # prompt by prompt, n choices each: choice index = prompt * n + j
                jobs += await self.daemon.admit_choices(params, shape.n)
            first = jobs[0].params
            p = first["params"]
            tools = parse_tools(p.tools) if p.calls_tools else None
            replies = [Reply(shape, self.daemon.model_name, self.decoder.tokenizer,
                             think_open=bool(first.get("think_open")), tools=tools, index=i) for i in range(len(jobs))]
        except BaseException as e:
            for job in jobs:   # (a later prompt refused, or the replies' setup failing: nobody would read them)
                job.cancel(CHOICE_FAILED)
            if isinstance(e, RequestError):
                return _request_error(e)
            raise
        for r in replies[1:]:   # one response: one id, one time
            r.id, r.created = replies[0].id, replies[0].created
        if shape.echo:   # each choice's prompt as the client gave it (token ids: their text)
            for i, r in enumerate(replies):
                given = batch[i // shape.n]
                r.echo_text = given["prompt"] if "prompt" in given else self.decoder.tokenizer.decode(given["prompt_ids"])
                r.echo_logprobs = "prompt_logprobs" in given
        if shape.stream:
            return EventStream(jobs, replies, self.daemon)
        return await self._result(jobs, replies, request)

    @staticmethod
    async def _end(job: Job) -> dict | None:
        """A job's last event: its result or its error (None: it ended without either)."""
        while (ev := await job.events.get()) is not None:
            if ev["event"] in ("done", "error"):
                return ev
        return None

    async def _result(self, jobs: list[Job], replies: list[Reply], request: Request):
        """Wait for a non-streamed request's end (every choice's); the client's disconnect cancels them at the
        next step, and one choice's error ends the others."""
        self.daemon.request_opened()
        gone = asyncio.create_task(wait_disconnect(request.receive))
        ends = {asyncio.create_task(self._end(job)): i for i, job in enumerate(jobs)}
        done: list[dict] = [{}] * len(jobs)
        try:
            while ends:
                finished, _ = await asyncio.wait({*ends, gone}, return_when=asyncio.FIRST_COMPLETED)
                if gone in finished:
                    return Response(status_code=499)   # nobody reads it
                for t in finished:
                    ev = t.result()
                    if ev is None:
                        return error_response(500, "the request ended without a result")
                    if ev["event"] == "error":
                        for job in jobs:   # the others' results would go unread
                            job.cancel(CHOICE_FAILED)
                        return error_response(STATUS.get(ev.get("code"), 400), ev["message"])
                    done[ends.pop(t)] = ev
            n = replies[0].shape.n
            for i, r in enumerate(replies):   # the prompt's log-probabilities: its first choice's (admit_choices)
                if r.echo_logprobs and i % n:
                    done[i] = {**done[i], "prompt_logprobs": done[i - i % n].get("prompt_logprobs")}
            return JSONResponse(_body_of(replies, done))
        finally:
            gone.cancel()
            for t in ends:
                t.cancel()
            for job in jobs:
                job.cancel(CLIENT_GONE)   # no-op when it finished
            self.daemon.request_closed()

    async def tokenize(self, request: Request):
        """llama-server's /tokenize: {"content", "add_special"?, "parse_special"?, "with_pieces"?}; a piece that
        is not whole UTF-8 comes as its list of bytes, as llama-server gives it."""
        try:
            body = await self._json_body(request)
            unknown = set(body) - {"content", "add_special", "parse_special", "with_pieces"}
            if unknown:
                raise _fail(f"unknown request field '{sorted(unknown)[0]}'")
            if not isinstance(body.get("content"), str):
                raise _fail("'content' must be a string")
            for k in ("add_special", "parse_special", "with_pieces"):
                if k in body and not isinstance(body[k], bool):
                    raise _fail(f"'{k}' must be true or false")
            if body.get("add_special"):
                raise _fail("'add_special' is not supported: Qwen3.5's tokenizer adds no BOS token")
        except RequestError as e:
            return _request_error(e)
        ids = await asyncio.to_thread(self.service.prompts.encode, body["content"],
                                      parse_special=body.get("parse_special", True))
        if not body.get("with_pieces"):
            return JSONResponse({"tokens": ids})
        return JSONResponse({"tokens": [{"id": t, "piece": self._piece(t)} for t in ids]})

    def _piece(self, t: int) -> str | list[int]:
        b = self.decoder.tokenizer.token_bytes(t)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return list(b)

    async def detokenize(self, request: Request):
        try:
            body = await self._json_body(request)
            toks, n_vocab = body.get("tokens"), self.service.n_vocab
            if set(body) - {"tokens"} or not isinstance(toks, list) or not all(
                    _typed(t, int) and 0 <= t < n_vocab for t in toks):
                raise _fail(f"the body must be {{\"tokens\": [ids in 0..{n_vocab - 1}]}}")
        except RequestError as e:
            return _request_error(e)
        return JSONResponse({"content": await asyncio.to_thread(self.decoder.detokenize, toks)})

    async def metrics(self, _: Request):
        """Prometheus text: our dflash27b_* names, and llama-server's llamacpp:* names where the meaning is
        the same (so its dashboards work)."""
        rows = self._our_metrics() + self._llamacpp_metrics()
        text = "".join(f"# HELP {n} {d}\n# TYPE {n} {t}\n" + "".join(f"{n}{lab} {v}\n" for lab, v in vals)
                       for n, t, d, vals in rows)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    def _our_metrics(self) -> list:
        s, h = self.service, self.daemon.health()
        cache, steps, c = h.get("cache") or {}, s.decode_steps_total, s.cancel_stats
        one = lambda v: [("", v)]  # noqa: E731
        return [(f"dflash27b_{n}", t, d, v) for n, t, d, v in [
            ("requests_total", "counter", "generate requests served", one(s.served)),
            ("requests_cancelled_total", "counter", "requests ended early, by reason",
             [(f'{{reason="{r}"}}', k) for r, k in c.by_reason.items()]),
            ("steps_after_cancel_total", "counter", "decode steps started after their request was cancelled",
             one(c.steps_after)),
            ("tokens_after_cancel_total", "counter", "tokens decoded by steps started after a cancel",
             one(c.tokens_after)),
            ("cancel_latency_max_seconds", "gauge", "longest time from a cancel to the decode letting go",
             one(round(c.latency_max_s, 6))),
            ("prompt_tokens_total", "counter", "prompt tokens of served requests", one(s.prompt_tokens_total)),
            ("prompt_tokens_cached_total", "counter", "prompt tokens restored from the prefix cache",
             one(s.cached_tokens_total)),
            ("tokens_predicted_total", "counter", "tokens generated", one(s.generated_tokens_total)),
            ("decode_steps_total", "counter", "decode steps (target forwards after prefill)", one(steps)),
            ("decode_seconds_total", "counter", "seconds spent decoding", one(round(s.decode_seconds_total, 6))),
            ("mean_accept_length", "gauge", "tokens per decode step, all requests (bonus included)",
             one(round((s.generated_tokens_total - s.served) / steps, 4) if steps else 0)),
            ("queue_length", "gauge", "requests running or waiting", one(h["queue"])),
            ("slots", "gauge", "requests that can decode at once (--parallel)", one(h["slots"]["total"])),
            ("slots_busy", "gauge", "slots decoding a request", one(h["slots"]["busy"])),
            ("prefix_cache_bytes", "gauge", "bytes held by the prefix cache", one(cache.get("bytes", 0))),
            ("prefix_cache_checkpoints", "gauge", "prefix cache checkpoints", one(cache.get("checkpoints", 0))),
            ("prefix_cache_hits_total", "counter", "requests that reused a cached prefix", one(cache.get("hits", 0))),
            ("resident_memory_bytes", "gauge", "daemon resident set size", one(h["rss_bytes"])),
        ]]

    def _llamacpp_metrics(self) -> list:
        """llama-server's /metrics names and meanings: prompt tokens are those processed (not restored from
        a cache); the two throughput gauges cover the time since the previous scrape, as llama-server's do."""
        s = self.service
        now = (s.prefilled_tokens_total, s.prefill_seconds_total, s.generated_tokens_total, s.decode_seconds_total)
        d = [a - b for a, b in zip(now, self._bucket)]
        self._bucket = now
        running, waiting = s.counts()
        return [(f"llamacpp:{n}", t, dsc, [("", v)]) for n, t, dsc, v in [
            ("prompt_tokens_total", "counter", "Number of prompt tokens processed.", s.prefilled_tokens_total),
            ("prompt_seconds_total", "counter", "Prompt process time", round(s.prefill_seconds_total, 6)),
            ("tokens_predicted_total", "counter", "Number of generation tokens processed.", s.generated_tokens_total),
            ("tokens_predicted_seconds_total", "counter", "Predict process time", round(s.decode_seconds_total, 6)),
            ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.",
             round(d[0] / d[1], 3) if d[1] > 0 else 0.0),
            ("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s.",
             round(d[2] / d[3], 3) if d[3] > 0 else 0.0),
            ("requests_processing", "gauge", "Number of requests processing.", running),
            ("requests_deferred", "gauge", "Number of requests deferred.", waiting),
        ]]


# -- the app and its server ------------------------------------------------------------------------------------

async def _http_error(_: Request, exc: HTTPException):
    return error_response(exc.status_code, exc.detail or "error", headers=getattr(exc, "headers", None))


async def _bug(_: Request, exc: Exception):   # Starlette logs it (a traceback is right for a bug)
    return error_response(500, "internal server error (the daemon's log has the details)")


def _routes(front: OpenAIFront) -> list[Route]:
    return [Route("/v1/models", front.models, methods=["GET"]),
            Route("/health", front.health, methods=["GET"]),
            Route("/v1/chat/completions", front.chat_completions, methods=["POST"]),
            Route("/v1/completions", front.completions, methods=["POST"]),
            Route("/tokenize", front.tokenize, methods=["POST"]),
            Route("/detokenize", front.detokenize, methods=["POST"]),
            Route("/metrics", front.metrics, methods=["GET"]),
            Route("/props", front.props, methods=["GET"])]


def _guards(options, bound_host: str) -> list[Middleware]:
    """Outermost first: Host, CORS (only with --cors-origin), API key, body checks."""
    guards = [Middleware(HostGuard, allowed=allowed_hosts(bound_host, options.allow_hosts))]
    if options.cors_origins:
        guards.append(Middleware(JsonCORSMiddleware, allow_origins=list(options.cors_origins),
                                 allow_methods=["GET", "POST"], allow_headers=["authorization", "content-type",
                                                                               "x-api-key"]))
    if options.api_key:
        guards.append(Middleware(ApiKeyGuard, key=options.api_key))
    guards.append(Middleware(BodyGuard, max_body=options.max_body, read_timeout=options.read_timeout))
    return guards


def make_app(daemon) -> Starlette:
    host = daemon.http[0] if daemon.http else "127.0.0.1"
    return Starlette(routes=_routes(OpenAIFront(daemon)), middleware=_guards(daemon.options, host),
                     exception_handlers={HTTPException: _http_error, Exception: _bug})


class _Server(uvicorn.Server):
    def capture_signals(self):
        import contextlib
        return contextlib.nullcontext()  # the daemon owns SIGINT/SIGTERM and stops this server itself


class HttpFront:
    """The running uvicorn server of a daemon."""

    def __init__(self, server: _Server, task: asyncio.Task):
        self.server, self.task = server, task

    def stop_listening(self) -> None:
        for s in getattr(self.server, "servers", []):
            s.close()

    async def close(self, timeout: float) -> None:
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout)
        except (asyncio.TimeoutError, Exception):
            self.server.force_exit = True
            self.task.cancel()
            try:
                await self.task
            except BaseException:
                pass


async def start_http(daemon, sock) -> HttpFront:
    """Serve the app on an already listening socket (bound before the models loaded)."""
    o = daemon.options
    config = uvicorn.Config(make_app(daemon), log_level="warning", lifespan="off",
                            http=deadline_protocol(o.read_timeout, o.max_connections), timeout_keep_alive=5,
                            timeout_graceful_shutdown=1,
                            server_header=False, h11_max_incomplete_event_size=64 * 1024)
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
            raise DFlashError("the HTTP server did not start")
        await asyncio.sleep(0.01)
    return HttpFront(server, task)
