"""The daemon's request protocol, shared by the socket server and the HTTP front: request JSON parsed with
limits (depth, number size, lone surrogates), generate requests validated (the protocol's own fields here,
the generation settings as a GenParams), prompts rendered and tokenized no further than the context, stop
strings matched on the text, and the error codes a request can end with (docs/PROTOCOL.md)."""
from __future__ import annotations

import asyncio
import json
import math
import re
import warnings
from typing import TYPE_CHECKING, Any, Callable, Mapping

from ._lib import DFlashError
from .chat_reply import THINK_CLOSE, THINK_OPEN, ReasoningSplit, template_thinks  # noqa: F401 (the protocol's)
from .params import INT32_MAX, GenParams, SettingError, is_int, is_num
from .tokenizer import TOKEN_CONTROL, TOKEN_USER_DEFINED, ChatTemplateError, Tokenizer

if TYPE_CHECKING:  # the service hands a Decoder in; importing it here would close a circle via the client
    from .decoder import Decoder

PROTOCOL_VERSION = 1
DEFAULT_MAX_BODY = 4 << 20   # bytes of one request: an HTTP body or a socket request line
MAX_JSON_DEPTH = 64          # nesting of arrays / objects in a request
MAX_INT_DIGITS = 100         # longer JSON integers are refused while parsing (Python's own limit is 4300)

# why a request ended early; error events carry one of these as `code` (plus bad_request / internal)
CLIENT_GONE, TIMEOUT, SHUTDOWN = "client_gone", "timeout", "shutdown"
CHOICE_FAILED = "choice_failed"   # another choice of the same request (OpenAI's n) failed: the reply is an error
CANCEL_REASONS = (CLIENT_GONE, TIMEOUT, SHUTDOWN, CHOICE_FAILED)
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
CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")


def _int_in(lo: int, hi: int = INT32_MAX, note: str = "") -> tuple[Callable[[Any], bool], str]:
    top = "2^31 - 1" if hi == INT32_MAX else str(hi)
    return (lambda v: is_int(v) and lo <= v <= hi), f"must be an integer in {lo}..{top}{note}"


def message_problem(m: Any, where: str) -> str | None:
    """What is wrong with one chat message (None: nothing).  A message is {"role", "content"}; an assistant's
    may carry tool_calls (then content may be null) and reasoning_content, a tool result its tool_call_id."""
    if not isinstance(m, dict):
        return f"{where} must be an object {{role, content}}"
    role = m.get("role")
    if role not in CHAT_ROLES:
        return f"{where}.role must be one of {', '.join(CHAT_ROLES)} (got {role!r:.40})"
    allowed = {"role", "content"} | ({"tool_calls", "reasoning_content"} if role == "assistant" else
                                     {"tool_call_id"} if role == "tool" else set())
    extra = sorted(set(m) - allowed)
    if extra:
        return f"{where}: field {extra[0]!r} is not allowed on a {role} message"
    content = m.get("content")
    if not (isinstance(content, str) or (content is None and role == "assistant" and m.get("tool_calls"))):
        return f"{where}.content must be a string" + (" (or null beside tool_calls)" if role == "assistant" else "")
    if "reasoning_content" in m and not isinstance(m["reasoning_content"], (str, type(None))):
        return f"{where}.reasoning_content must be a string"
    if "tool_call_id" in m and not isinstance(m["tool_call_id"], str):
        return f"{where}.tool_call_id must be a string"
    if "tool_calls" in m:
        from .tool_calls import ToolError, check_message_tool_calls
        try:
            check_message_tool_calls(m["tool_calls"], where)
        except ToolError as e:
            return str(e)
    return None


def _messages_problem(v) -> str | None:
    if not isinstance(v, list) or not v:
        return "must be a non-empty list of messages"
    return next((p for i, m in enumerate(v) if (p := message_problem(m, f"messages[{i}]"))), None)


_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "op": (lambda v: v == "generate", "must be 'generate'"),
    "id": (lambda v: isinstance(v, (str, int)) and not isinstance(v, bool), "must be a string or an integer"),
    "prompt": (lambda v: isinstance(v, str), "must be a string"),
    "messages": (lambda v: _messages_problem(v) is None, "must be a list of messages (message_problem says why not)"),
    "prompt_ids": (lambda v: isinstance(v, list) and len(v) > 0 and all(is_int(t) and 0 <= t <= INT32_MAX
                                                                         for t in v),
                   "must be a non-empty list of token ids (integers >= 0)"),
    "stop": (lambda v: isinstance(v, str) and v != "" or (isinstance(v, list) and len(v) <= 16 and all(
        isinstance(s, str) and s for s in v)), "must be a non-empty string or a list of up to 16 of them"),
    "stream": (lambda v: isinstance(v, bool), "must be true or false"),
    # vLLM's: every prompt token's log-probability given the ones before it, with k alternatives (0..20), in
    # the done event (the first token: null); OpenAI's echo with logprobs reads them
    "prompt_logprobs": _int_in(0, 20),
    # llama-server's name: false decodes without the prefix cache (neither reads nor feeds it)
    "cache_prompt": (lambda v: isinstance(v, bool), "must be true or false"),
    # seconds from arrival to the end of the request, queue wait included (capped by --request-timeout)
    "timeout": (lambda v: is_num(v) and 0 < v <= 1e6, "must be a number of seconds in (0, 1e6]"),
    # variables for the chat template (vLLM's / llama-server's name), e.g. {"enable_thinking": false}
    "chat_template_kwargs": (lambda v: isinstance(v, dict) and len(v) <= 32 and all(
        isinstance(k, str) and k.isidentifier() and (v[k] is None or isinstance(v[k], (bool, str, int, float)))
        for k in v), "must be an object of up to 32 template variables (names -> true/false, numbers, strings "
        "or null)"),
}


def template_kwargs_problem(v: dict) -> str | None:
    """Why a chat_template_kwargs object cannot be used: a variable named like something the template reads
    from the request or the renderer (its messages, the tools field's list, raise_exception, namespace...)."""
    taken = sorted(k for k in v if k in Tokenizer.TEMPLATE_NAMES)
    if taken:
        return (f"field 'chat_template_kwargs' may not set {', '.join(map(repr, taken))}: the request's own fields "
                "or the template's functions go by that name" + (" (give tools in the 'tools' field)"
                                                                 if "tools" in taken else ""))
    return None


def parse_generate(req: dict, names: Mapping[str, str] | None = None) -> dict:
    """Validate a generate request: the protocol's own fields here, the generation settings as a GenParams
    (params.py) under "params".  Returns it with defaults filled.  Raises RequestError naming the field (as
    `names` spells it for the client, e.g. the OpenAI front's max_tokens for max_new_tokens)."""
    names = names or {}
    settings = {k: v for k, v in req.items() if k not in _FIELDS}
    known_settings = set(GenParams.names()) | set(GenParams.aliases())
    unknown = sorted(set(settings) - known_settings)
    if unknown:
        known = sorted(set(_FIELDS) | set(GenParams.names()))
        raise RequestError(f"unknown request field {unknown[0]!r} (known: {', '.join(known)})")
    given = [k for k in _PROMPT_FIELDS if k in req]
    if len(given) != 1:
        raise RequestError("a generate request needs exactly one of 'prompt', 'messages', 'prompt_ids'"
                           + (f" (got {', '.join(given)})" if given else ""))
    if "messages" in req:
        problem = _messages_problem(req["messages"])
        if problem:
            raise RequestError(problem if problem.startswith("messages[") else f"field 'messages' {problem}")
    for k, v in req.items():
        if k in _FIELDS:
            ok, why = _FIELDS[k]
            if not ok(v):
                raise RequestError(f"field {names.get(k, k)!r} {why} (got {json.dumps(v)[:80]})")
    if "chat_template_kwargs" in req and "messages" not in req:
        raise RequestError("field 'chat_template_kwargs' needs 'messages' (a raw prompt has no chat template)")
    if isinstance(req.get("chat_template_kwargs"), dict):
        problem = template_kwargs_problem(req["chat_template_kwargs"])
        if problem:
            raise RequestError(problem)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the protocol keeps accepting 'topk'
            params = GenParams.from_mapping(settings, strict=True)
    except SettingError as e:
        raise RequestError(f"field {names.get(e.name, e.name)!r} must be {e.what} (got {json.dumps(e.value)[:80]})") \
            from None
    except DFlashError as e:
        raise RequestError(str(e)) from None
    out = {"stream": True, "stop": [], **{k: v for k, v in req.items() if k in _FIELDS}, "params": params}
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


def chat_text(decoder: Decoder, messages: list[dict], template_kwargs: dict | None = None,
              tools: list | None = None) -> str:
    """Messages rendered with the GGUF's template (template_kwargs: its variables, e.g. enable_thinking; tools:
    OpenAI's list, which the template lists for the model); `developer` (OpenAI's newer name for the system
    role) is passed as `system` to templates that do not know it."""
    import jinja2

    from .tool_calls import ToolError
    template = decoder.tokenizer.chat_template or ""
    if "developer" not in template:
        messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    try:
        return decoder.chat_prompt(messages, tools=tools, **(template_kwargs or {}))
    except (ToolError, ChatTemplateError) as e:
        raise RequestError(str(e)) from None
    except jinja2.TemplateError as e:
        raise RequestError(f"the chat template refused the messages: {e.message or 'template error'}") from None
    except (TypeError, ValueError, AttributeError, LookupError, ArithmeticError) as e:
        # the template computing with what the request gave it (a variable of another type than it expects)
        raise RequestError("the chat template failed on these messages and variables: "
                           f"{type(e).__name__}: {str(e)[:200]}") from None


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


async def parse_off_loop(data: bytes | str) -> Any:
    """parse_json_request, on a helper thread for anything big enough to be felt by the loop."""
    if len(data) < 65536:
        return parse_json_request(data)
    return await asyncio.to_thread(parse_json_request, data)


def event_error(message: str, code: str = BAD_REQUEST) -> dict:
    return {"event": "error", "message": message, "code": code}
