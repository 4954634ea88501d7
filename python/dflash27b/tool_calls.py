"""OpenAI tools on Qwen3.5's own tool-call format: the request's tools checked, the grammar that makes every call
well formed and valid against its function's schema (compiled by constraint.py like any other constraint, so
every decode mode gives the constrained AR reply), and the reply's text parsed back into OpenAI `tool_calls`.

Qwen3.5 (and 3.6 / 3.8) write a call as XML inside <tool_call> (the format of their chat templates, which
llama-server parses with its Qwen3-Coder parser):

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

A string argument is written as its raw text, any other as JSON (the templates' `tojson`).  The grammar writes
exactly that layout: parameters in the order the schema declares them, required ones always, and nothing but
the end of the reply after the last call.  tool_choice "auto" is lazy: free text until the model writes
<tool_call>, then a call; "required" and a named function start with the call; "none" adds no grammar.
A parameter whose schema admits strings and other types too is written as JSON (strings quoted), so its value
parses back to exactly what the schema allows.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Iterable

from ._lib import DFlashError

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNC_OPEN, FUNC_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_END = "<parameter=", "\n</parameter>\n"

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")          # OpenAI's rule for function names
_KEY_BAD = re.compile(r"[<>=\n\r/]")                   # characters the XML form cannot carry in a key
CHOICES = ("auto", "none", "required")


class ToolError(DFlashError):
    """A tools list or tool_choice that cannot be served: the message names the tool and the problem."""


# -- the request's tools --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Param:
    name: str
    schema: dict
    required: bool

    @property
    def parts(self) -> tuple[dict | None, dict | None]:
        """(the schema's string part, written as raw text; its other part, written as JSON); None where the
        schema admits no such value.  An unconstrained schema admits both: (ANY, ANY)."""
        return split_schema(self.schema)


@dataclass(frozen=True)
class Tool:
    name: str
    params: tuple[Param, ...]
    open_params: bool         # no declared properties: any parameter name, values JSON or text
    defs: dict                # the parameters schema's $defs / definitions, for $refs inside a parameter


ANY: dict = {}
_STRING_KEYS = ("pattern", "minLength", "maxLength", "format")


def split_schema(s: Any) -> tuple[dict | None, dict | None]:
    """A parameter's schema as (string part, non-string part).  Qwen's format writes a string argument as its
    raw text and any other as JSON, so a schema admitting both (["string", "null"], anyOf of a string and a
    number, an enum of both) is two grammars: raw text for its strings, JSON for the rest."""
    if not isinstance(s, dict) or not (set(s) - {"description", "title", "default", "examples"}):
        return ANY, ANY
    for key in ("anyOf", "oneOf"):
        if isinstance(s.get(key), list) and "type" not in s:
            strs, others = [], []
            for branch in s[key]:
                a, b = split_schema(branch)
                if a is not None:
                    strs.append(a)
                if b is not None:
                    others.append(b)
            if ANY in strs or ANY in others:
                return ANY, ANY
            return ({key: strs} if len(strs) > 1 else strs[0] if strs else None,
                    {key: others} if len(others) > 1 else others[0] if others else None)
    vals = s["enum"] if isinstance(s.get("enum"), list) else [s["const"]] if "const" in s else None
    t = s.get("type")
    types = [t] if isinstance(t, str) else list(t) if isinstance(t, list) else None
    rest = {k: v for k, v in s.items() if k not in ("enum", "const", "type")}
    if types is None and vals is None:
        # a $ref, or keywords without a type: a JSON value (strings quoted)
        return None, s
    if types is None:
        types = sorted({"string" if isinstance(v, str) else "other" for v in vals})
    string = other = None
    if "string" in types and (vals is None or any(isinstance(v, str) for v in vals)):
        string = {**{k: v for k, v in rest.items() if k in _STRING_KEYS}, "type": "string"}
        if vals is not None:
            string["enum"] = [v for v in vals if isinstance(v, str)]
    non_string = [x for x in types if x != "string"]
    if non_string and (vals is None or any(not isinstance(v, str) for v in vals)):
        other = {k: v for k, v in rest.items() if k not in _STRING_KEYS}
        if s.get("type") is not None:
            other["type"] = non_string if len(non_string) > 1 else non_string[0]
        if vals is not None:
            other["enum"] = [v for v in vals if not isinstance(v, str)]
    return string, other


def parse_tools(tools: Any) -> tuple[Tool, ...]:
    """OpenAI's `tools` list -> Tools, or ToolError naming the problem."""
    if not isinstance(tools, list) or not tools:
        raise ToolError("tools must be a non-empty list of {\"type\": \"function\", \"function\": {...}}")
    out: list[Tool] = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise ToolError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}")
        if set(t) - {"type", "function"}:
            raise ToolError(f"{where}: unknown field {sorted(set(t) - {'type', 'function'})[0]!r}")
        f = t["function"]
        extra = set(f) - {"name", "description", "parameters", "strict"}
        if extra:
            raise ToolError(f"{where}.function: unknown field {sorted(extra)[0]!r}")
        name = f.get("name")
        if not isinstance(name, str) or not name:
            raise ToolError(f"{where}.function has no name")
        if not _NAME.match(name):
            raise ToolError(f"{where}: function name {name!r} must be 1-64 letters, digits, '_' or '-'")
        if any(o.name == name for o in out):
            raise ToolError(f"{where}: function name {name!r} is given twice")
        if "description" in f and not isinstance(f["description"], str):
            raise ToolError(f"{where}.function.description must be a string")
        if "strict" in f and not isinstance(f["strict"], bool):
            raise ToolError(f"{where}.function.strict must be true or false")
        # no parameters: an empty parameter list (OpenAI's rule), not an open one
        params = f.get("parameters", {"type": "object", "properties": {}, "additionalProperties": False})
        out.append(_tool(name, params, f"{where} ({name})"))
    return tuple(out)


def _tool(name: str, schema: Any, where: str) -> Tool:
    if not isinstance(schema, dict):
        raise ToolError(f"{where}: parameters must be a JSON schema object")
    if schema.get("type", "object") != "object":
        raise ToolError(f"{where}: parameters must be a schema of type 'object' (got {schema.get('type')!r})")
    props = schema.get("properties", {})
    required = schema.get("required", [])
    if not isinstance(props, dict) or not all(isinstance(v, (dict, bool)) for v in props.values()):
        raise ToolError(f"{where}: parameters.properties must map names to schemas")
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ToolError(f"{where}: parameters.required must be a list of names")
    missing = [r for r in required if r not in props]
    if missing:
        raise ToolError(f"{where}: required parameter {missing[0]!r} is not among its properties")
    for key in props:
        if not key or _KEY_BAD.search(key):
            raise ToolError(f"{where}: parameter name {key!r} cannot be written in Qwen's tool-call format "
                            "(no '<', '>', '=', '/' or newlines)")
    unsupported = sorted(set(schema) & {"anyOf", "oneOf", "allOf", "not", "if", "patternProperties",
                                        "dependentRequired", "dependentSchemas", "minProperties", "maxProperties"})
    if unsupported:
        raise ToolError(f"{where}: parameters.{unsupported[0]} is not supported on the arguments object "
                        "(put alternatives inside a parameter's schema)")
    params = tuple(Param(k, v if isinstance(v, dict) else {}, k in required) for k, v in props.items())
    defs = {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema.get(k), dict)}
    return Tool(name, params, open_params=not props and schema.get("additionalProperties", True) is not False,
                defs=defs)


def parse_tool_choice(choice: Any, tools: tuple[Tool, ...]) -> str:
    """"auto" | "none" | "required" | {"type": "function", "function": {"name": N}} -> one of CHOICES or N."""
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise ToolError(f"tool_choice must be one of {', '.join(CHOICES)} or {{\"type\": \"function\", "
                            f"\"function\": {{\"name\": ...}}}} (got {choice!r})")
        return choice
    if (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
            and set(choice) == {"type", "function"} and set(choice["function"]) == {"name"}):
        name = choice["function"]["name"]
        if not any(t.name == name for t in tools):
            raise ToolError(f"tool_choice names the function {name!r}, which is not among the tools")
        return name
    raise ToolError("tool_choice must be \"auto\", \"none\", \"required\" or "
                    "{\"type\": \"function\", \"function\": {\"name\": ...}}")


# -- the grammar ----------------------------------------------------------------------------------------------

def _lit(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _regex_of_pattern(p: str) -> str:
    """A JSON-schema pattern as a whole-value lexeme (its ^ / $ anchors are implied), '/' escaped for Lark."""
    if p.startswith("^"):
        p = p[1:]
    if p.endswith("$") and not p.endswith("\\$"):
        p = p[:-1]
    return p.replace("/", "\\/")


# The formats a raw-text argument is held to (RFC 3339 dates and times, UUIDs), each a regex of valid values
# only (calendar days per month; 29 February left out); other formats are annotations, as JSON Schema has them
# by default.
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\.[0-9]{1,9})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_DATE = (r"(000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])"
         r"|(0[469]|11)-(0[1-9]|[12][0-9]|30)|02-(0[1-9]|1[0-9]|2[0-8]))")
FORMATS = {"date": _DATE, "time": _TIME, "date-time": _DATE + "T" + _TIME,
           "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"}


def _string_value(s: dict) -> str:
    """The Lark body of a raw-text argument (the string part of its schema), ended by the closing line; lazy
    where it is free text: the value ends at the first closing line, where the parser splits it too."""
    if s.get("enum") is not None:
        return "(" + " | ".join(_lit(v) for v in s["enum"]) + ") " + _lit(PARAM_END)
    parts = []
    if isinstance(s.get("pattern"), str):
        parts.append(f"/{_regex_of_pattern(s['pattern'])}/")
    if s.get("format") in FORMATS:
        parts.append(f"/{FORMATS[s['format']]}/")
    lo, hi = s.get("minLength", 0), s.get("maxLength")
    if lo or hi is not None:
        parts.append(f"/(?s:.{{{int(lo)},{'' if hi is None else int(hi)}}})/")
    return f"[lazy]: ({' & '.join(parts) if parts else '/(?s:.*)/'}) {_lit(PARAM_END)}"


def _value_rules(r: str, p: Param, defs: dict, layout: dict) -> list[str]:
    """Rules for parameter p's value, named r: raw text for its strings, JSON for the rest, or either."""
    string, other = p.parts
    rules, alts = [], []
    if string is not None:
        body = _string_value(string if string is not ANY else {})
        rules.append(f"{r}_s{body}" if body.startswith("[lazy]") else f"{r}_s: {body}")
        alts.append(f"{r}_s")
    if other is not None and string is not ANY:   # free text already covers any JSON text
        rules.append(f"{r}_j: %json {json.dumps({**defs, **other, 'x-guidance': layout})} {_lit(PARAM_END)}")
        alts.append(f"{r}_j")
    rules.append(f"{r}_v: {' | '.join(alts)}")
    return rules


def tool_grammar(tools: tuple[Tool, ...], choice: str, parallel: bool, after_think: bool) -> str:
    """The Lark grammar (llguidance) of a reply under `tools` and the parsed tool_choice (not "none")."""
    from .constraint import JSON_LAYOUT
    rules: list[str] = []
    fn_rules = []
    chosen = [t for t in tools if choice in ("auto", "required") or t.name == choice]
    for i, t in enumerate(chosen):
        body = []
        for j, p in enumerate(t.params):
            r = f"f{i}_p{j}"
            rules.append(f"{r}: {_lit(PARAM_OPEN + p.name + '>' + chr(10))} {r}_v")
            rules += _value_rules(r, p, t.defs, JSON_LAYOUT)
            body.append(r if p.required else f"{r}?")
        if t.open_params:
            rules.append(f"f{i}_any: {_lit(PARAM_OPEN)} /[A-Za-z0-9_.-]{{1,64}}/ \">\\n\" f{i}_any_v")
            rules.append(f"f{i}_any_v[lazy]: /(?s:.*)/ {_lit(PARAM_END)}")
            body.append(f"f{i}_any*")
        rules.append(f"f{i}: {_lit(FUNC_OPEN + t.name + '>' + chr(10))} {' '.join(body)} "
                     f"{_lit(FUNC_CLOSE + chr(10) + CALL_CLOSE)}")
        fn_rules.append(f"f{i}")
    call_body = f"\"\\n\" ({' | '.join(fn_rules)})"
    more = f" (\"\\n\" {_lit(CALL_OPEN)} call_body)*" if parallel else ""
    if choice == "auto":
        reply = [f"reply: TEXT | call_open call_body{more}",
                 f"call_open[lazy]: TEXT {_lit(CALL_OPEN)}",
                 "TEXT: /(?s:.*)/"]
    else:
        reply = [f"reply: {_lit(CALL_OPEN)} call_body{more}"]
    head = ["%llguidance {}"]
    if after_think:  # the prompt opened the thinking block: free text up to </think>, then the reply
        head += ["start: think \"\\n\\n\" reply", "think[suffix=\"</think>\"]: /(?s:.*)/"]
    else:
        head += ["start: reply"]
    return "\n".join(head + reply + [f"call_body: {call_body}"] + rules) + "\n"


# -- the reply's text -> OpenAI tool_calls --------------------------------------------------------------------

def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_call(body: str, tools: tuple[Tool, ...]) -> dict | None:
    """The text between <tool_call> and </tool_call> -> {"name", "arguments" (JSON text)}, or None when it is
    not a whole call of a given function."""
    s = body.strip("\n")
    if not s.startswith(FUNC_OPEN) or not s.endswith(FUNC_CLOSE):
        return None
    end = s.find(">\n", len(FUNC_OPEN))
    if end < 0:
        return None
    name = s[len(FUNC_OPEN):end]
    tool = next((t for t in tools if t.name == name), None)
    if tool is None:
        return None
    rest = s[end + 2:len(s) - len(FUNC_CLOSE)]
    args: dict[str, Any] = {}
    kinds = {p.name: p.parts for p in tool.params}
    while rest:
        if not rest.startswith(PARAM_OPEN):
            return None
        k_end = rest.find(">\n", len(PARAM_OPEN))
        v_end = rest.find(PARAM_END, k_end + 2) if k_end >= 0 else -1
        if v_end < 0:
            return None
        key, text = rest[len(PARAM_OPEN):k_end], rest[k_end + 2:v_end]
        rest = rest[v_end + len(PARAM_END):]
        string, other = kinds.get(key, (ANY, ANY))   # an open parameter list's value: JSON, else text
        value = _NOT_JSON
        if other is not None:
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                pass
        if value is _NOT_JSON or (isinstance(value, str) and string is not None):
            if string is None:      # a JSON-only parameter whose text is not JSON: not a whole call
                return None
            value = text            # a string is its raw text (JSON text that parses to a string stays raw)
        args[key] = value
    return {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}


_NOT_JSON = object()


class ToolCallSplit:
    """Splits a reply's content (after any thinking block) into text and tool calls, incrementally: push text
    pieces as they decode, flush at the end.  Text right before a call loses its trailing blank lines (the
    template's separator); a call cut short (max_tokens) comes back as text, never as a call."""

    def __init__(self, tools: tuple[Tool, ...]):
        self.tools = tools
        self.buf = ""
        self.in_call = False
        self.n_calls = 0

    def _call(self, body: str) -> dict | None:
        c = parse_call(body, self.tools)
        if c is None:
            return None
        out = {"index": self.n_calls, "id": new_call_id(), "type": "function", "function": c}
        self.n_calls += 1
        return out

    def push(self, text: str) -> tuple[str, list[dict]]:
        """(text that is final, calls completed) so far."""
        self.buf += text
        out, calls = "", []
        while True:
            if self.in_call:
                i = self.buf.find(CALL_CLOSE)
                if i < 0:
                    return out, calls
                body = self.buf[len(CALL_OPEN):i]
                call = self._call(body)
                if call is None:   # not a call after all: it stays text
                    out += self.buf[:i + len(CALL_CLOSE)]
                else:
                    calls.append(call)
                self.buf, self.in_call = self.buf[i + len(CALL_CLOSE):], False
                continue
            i = self.buf.find(CALL_OPEN)
            if i >= 0:
                out += self.buf[:i].rstrip("\n ")   # the blank line before a call, the newline between two
                self.buf, self.in_call = self.buf[i:], True
                continue
            keep = _partial(self.buf, CALL_OPEN)
            cut = len(self.buf) - keep
            while cut > 0 and self.buf[cut - 1] in "\n ":   # maybe the separator before a call
                cut -= 1
            out, self.buf = out + self.buf[:cut], self.buf[cut:]
            return out, calls

    def flush(self) -> tuple[str, list[dict]]:
        out, calls = self.push("")
        rest, self.buf = self.buf, ""
        if self.n_calls and not self.in_call and not rest.strip():
            rest = ""
        return out + rest, calls

    @classmethod
    def split(cls, text: str, tools: tuple[Tool, ...]) -> tuple[str, list[dict]]:
        s = cls(tools)
        t1, c1 = s.push(text)
        t2, c2 = s.flush()
        return t1 + t2, c1 + c2


def _partial(buf: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(buf)), 0, -1):
        if tag.startswith(buf[-n:]):
            return n
    return 0


# -- messages for the chat template ---------------------------------------------------------------------------

def template_messages(messages: Iterable[dict]) -> list[dict]:
    """OpenAI messages -> what chat templates read: an assistant's tool call arguments as a dict (OpenAI sends
    JSON text; Qwen's template walks the pairs), a missing content as ""."""
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for j, c in enumerate(m["tool_calls"]):
                f = dict(c["function"])
                a = f.get("arguments", "{}")
                if isinstance(a, str):
                    try:
                        a = json.loads(a) if a.strip() else {}
                    except json.JSONDecodeError as e:
                        raise ToolError(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON: {e.msg}") \
                            from None
                if not isinstance(a, dict):
                    raise ToolError(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object")
                f["arguments"] = a
                calls.append({**c, "function": f})
            m["tool_calls"] = calls
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    return out


def check_message_tool_calls(calls: Any, where: str) -> None:
    """An assistant message's tool_calls as OpenAI sends them back: [{"id", "type": "function",
    "function": {"name", "arguments": JSON text}}]."""
    if not isinstance(calls, list) or not calls:
        raise ToolError(f"{where}.tool_calls must be a non-empty list")
    for j, c in enumerate(calls):
        w = f"{where}.tool_calls[{j}]"
        if not isinstance(c, dict) or not isinstance(c.get("function"), dict) or set(c) - {"id", "type", "function"}:
            raise ToolError(f"{w} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}")
        if c.get("type", "function") != "function":
            raise ToolError(f"{w}.type must be \"function\"")
        f = c["function"]
        if not isinstance(f.get("name"), str) or not f["name"] or set(f) - {"name", "arguments"}:
            raise ToolError(f"{w}.function must be {{\"name\": string, \"arguments\": JSON text}}")
        if not isinstance(f.get("arguments", "{}"), (str, dict)):
            raise ToolError(f"{w}.function.arguments must be JSON text")


def request_grammar(p, think_open: bool) -> str | None:
    """The compiled grammar a request's settings (a GenParams) ask for: tool calls, a JSON schema or a
    grammar, each shaping the answer after a thinking block the prompt opened (think_open), as vLLM's
    structured output does with a reasoning parser; None without one.  A grammar that writes </think> itself
    shapes the thinking block too: it is the whole reply's."""
    from .constraint import compile_grammar
    if p.calls_tools:
        tools = parse_tools(p.tools)
        return compile_grammar(lark=tool_grammar(tools, parse_tool_choice(p.tool_choice, tools),
                                                 p.parallel_tool_calls, after_think=think_open))
    if p.json_schema is not None or p.grammar is not None:
        own_think = p.grammar is not None and "</think>" in p.grammar
        return compile_grammar(json_schema=p.json_schema, grammar=p.grammar, after_think=think_open and not own_think)
    return None
