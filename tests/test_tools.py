"""OpenAI tools (python/dflash27b/tool_calls.py): the model's calls in Qwen3.5's XML format, constrained by a
grammar that agrees with the chat template's own rendering of a call, parsed back into OpenAI `tool_calls`
whose arguments validate against each function's schema (jsonschema, an independent validator); every decode
mode gives the constrained AR reply, greedy and seeded; tool_choice auto is lazy (free text until the model
opens a call) and its per-node masks across the trigger equal a fresh matcher's; bad tools are refused by
name; and the OpenAI client drives a whole round trip (required, named, streamed, a tool result, auto)
against `serve --http`."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from dflash27b import Decoder, DFlashError
from dflash27b.tool_calls import ToolCallSplit, parse_call, parse_tools, tool_grammar

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

POINT = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
         "required": ["x", "y"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather of a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                         "unit": {"enum": ["c", "f"]}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search_files", "parameters": {
        "type": "object", "properties": {"pattern": {"type": "string", "pattern": "^[a-z*.]{1,10}$"},
                                         "recursive": {"type": "boolean"}},
        "required": ["pattern"]}}},
    {"type": "function", "function": {"name": "plot", "parameters": {
        "type": "object", "$defs": {"pt": POINT},
        "properties": {"points": {"type": "array", "items": {"$ref": "#/$defs/pt"}, "minItems": 1, "maxItems": 2},
                       "title": {"type": "string", "minLength": 1, "maxLength": 8},
                       "scale": {"type": "number", "minimum": 0, "maximum": 10}},
        "required": ["points", "scale"]}}},
    {"type": "function", "function": {"name": "set_mode", "parameters": {
        "type": "object", "properties": {"mode": {"type": ["string", "null"], "enum": ["fast", "slow", None]},
                                         "level": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 3},
                                                             {"const": "max"}]}},
        "required": ["mode", "level"]}}},
    {"type": "function", "function": {"name": "schedule", "parameters": {
        "type": "object", "properties": {"when": {"type": "string", "format": "date-time"},
                                         "job": {"type": "string", "format": "uuid"}},
        "required": ["when"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "ping"}},
    {"type": "function", "function": {"name": "log", "description": "any fields", "parameters": {"type": "object"}}},
]
TOOLS_BY_NAME = {t["function"]["name"]: t["function"] for t in TOOLS}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINK = {"enable_thinking": False}
MODES = [("chain", {}), ("ddtree", {"budget": 22}), ("auto", {})]
SAMPLING = [{}, {"temperature": 0.9, "seed": 5}]
N_NEW = 80


@pytest.fixture(scope="module")
def dec():
    with Decoder(threads=2) as d:
        yield d


def _validate(calls: list[dict]) -> None:
    for c in calls:
        f = TOOLS_BY_NAME[c["function"]["name"]]
        jsonschema.validate(json.loads(c["function"]["arguments"]), f.get("parameters", {"type": "object"}),
                            format_checker=jsonschema.FormatChecker())


CHOICES = ["required", "auto", "none"] + [{"type": "function", "function": {"name": n}} for n in TOOLS_BY_NAME]


@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "seeded"])
@pytest.mark.parametrize("choice", CHOICES, ids=lambda c: c if isinstance(c, str) else c["function"]["name"])
def test_every_mode_equals_constrained_ar_and_calls_validate(dec, choice, sampling):
    kw = dict(chat=True, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, chat_template_kwargs=NO_THINK,
              cache=False, **sampling)
    ar = dec.generate(MSGS, N_NEW, mode="ar", **kw)
    calls = ar.tool_calls
    if choice == "none" or choice == "auto":   # the tiny model writes Python, not calls: text only
        assert not calls and ar.message["content"] == ar.text
    elif ar.stats.stop_reason == "eos":        # one whole call (parallel_tool_calls=False), nothing after it
        assert len(calls) == 1 and ar.message["content"] is None
        if isinstance(choice, dict):
            assert calls[0]["function"]["name"] == choice["function"]["name"]
        _validate(calls)
    else:                                      # cut by max_new_tokens: the partial call stays text
        assert not calls and ar.message["content"].startswith("<tool_call>")
    for mode, mkw in MODES:
        r = dec.generate(MSGS, N_NEW, mode=mode, **mkw, **kw)
        assert r.tokens == ar.tokens, mode
        assert [c["function"] for c in r.tool_calls] == [c["function"] for c in calls]


def test_required_calls_complete_and_parallel_calls_follow_one_another(dec):
    """Every function's call completes within the budget on the bundled pair, and with parallel_tool_calls the
    reply may hold several calls (each parsed, each valid) -- the same in every mode."""
    for name in TOOLS_BY_NAME:
        if name in ("log", "plot"):   # free text / a JSON number: values this model need not end in 160 tokens
            continue
        r = dec.generate(MSGS, 160, chat=True, tools=TOOLS, tool_choice={"type": "function", "function": {"name": name}},
                         parallel_tool_calls=False, chat_template_kwargs=NO_THINK, cache=False, mode="ddtree")
        assert r.stats.stop_reason == "eos" and [c["function"]["name"] for c in r.tool_calls] == [name], r.text
        _validate(r.tool_calls)
    ar = dec.generate(MSGS, 240, chat=True, tools=TOOLS, tool_choice="required", chat_template_kwargs=NO_THINK,
                      cache=False, mode="ar")
    assert len(ar.tool_calls) >= 2, ar.text
    _validate(ar.tool_calls)
    assert ar.text.count("<tool_call>") == len(ar.tool_calls) + (ar.stats.stop_reason == "length")
    for mode, mkw in MODES:
        assert dec.generate(MSGS, 240, chat=True, tools=TOOLS, tool_choice="required", chat_template_kwargs=NO_THINK,
                            cache=False, mode=mode, **mkw).tokens == ar.tokens


def test_calls_come_after_a_thinking_block_the_prompt_opened(dec):
    """With thinking on, the template opens <think>: the grammar leaves the thinking free (a '<tool_call>' inside
    it is text) and constrains what follows </think>; every mode still equals constrained AR."""
    from dflash27b.constraint import TokenConstraint, compile_grammar
    tok = dec.tokenizer
    tools = parse_tools(TOOLS)
    g = compile_grammar(lark=tool_grammar(tools, "required", False, after_think=True))
    call = "<tool_call>\n<function=ping>\n</function>\n</tool_call>"
    c = TokenConstraint(tok, tok.eos_ids, g, tok.vocab_size)
    c.commit(tok.encode("maybe <tool_call> later</think>\n\n" + call, parse_special=False))
    assert c.done()
    kw = dict(chat=True, tools=TOOLS, tool_choice="required", cache=False)
    ar = dec.generate(MSGS, 40, mode="ar", **kw)
    for mode, mkw in MODES:
        assert dec.generate(MSGS, 40, mode=mode, **mkw, **kw).tokens == ar.tokens
    msg = dec.reply_message("thinking it over</think>\n\n" + call, dec._settings(None, None, {"tools": TOOLS}))
    assert msg["reasoning_content"] == "thinking it over" and msg["content"] is None
    assert msg["tool_calls"][0]["function"] == {"name": "ping", "arguments": "{}"}


ARGS = {
    "get_weather": [{"city": "Paris", "days": 2}, {"city": "São Paulo 東", "days": 7, "unit": "f"}],
    "search_files": [{"pattern": "*.py"}, {"pattern": "a.b", "recursive": False}],
    "plot": [{"points": [{"x": 1, "y": -2}], "scale": 0.5}, {"points": [{"x": 0, "y": 0}] * 2, "title": "t\nx",
                                                              "scale": 10}],
    "set_mode": [{"mode": "fast", "level": 2}, {"mode": None, "level": "max"}],
    "schedule": [{"when": "2026-11-27T08:00:00Z"}, {"when": "2026-01-02T03:04:05.5+01:00",
                                                     "job": "123e4567-e89b-12d3-a456-426614174000"}],
    "ping": [{}],
    "log": [{}, {"anything": [1, 2], "note": "free text", "n": 3}],
}


@pytest.mark.parametrize("name", sorted(ARGS))
def test_the_grammar_accepts_the_templates_own_calls_and_the_parser_reads_them_back(dec, name):
    """Three independent pieces agree: the chat template's rendering of a call (the format the model learnt),
    the grammar (it accepts exactly that text and then only the end of the reply), and the parser (it reads
    back the arguments the template was given)."""
    from dflash27b.constraint import TokenConstraint, compile_grammar
    tok, tools = dec.tokenizer, parse_tools(TOOLS)
    g = compile_grammar(lark=tool_grammar(tools, name, False, after_think=False))
    for args in ARGS[name]:
        jsonschema.validate(args, TOOLS_BY_NAME[name].get("parameters", {"type": "object"}))
        hist = MSGS + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}]
        rendered = dec.chat_prompt(hist, tools=TOOLS, **NO_THINK)
        turn = rendered[rendered.rindex("<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>"):]
        call = re.search(r"<tool_call>.*?</tool_call>", turn, re.S).group(0)
        c = TokenConstraint(tok, tok.eos_ids, g, tok.vocab_size)
        c.commit(tok.encode(call, parse_special=False))
        assert c.done(), call
        parsed = parse_call(call[len("<tool_call>"):-len("</tool_call>")], tools)
        assert parsed["name"] == name and json.loads(parsed["arguments"]) == args


def _walk(tok, grammar, paths: list[str]):
    """A draft tree holding each text's tokens as a path, node 0 the last decided token (its mask is the
    root's), and a fresh matcher's masks of its every node: (tokens, parents, node of each token prefix, masks)."""
    from dflash27b.constraint import TokenConstraint
    tokens, parents, node_of = [0], [-1], {(): 0}
    for text in paths:
        ids = tok.encode(text, parse_special=False)
        for d in range(1, len(ids) + 1):
            if tuple(ids[:d]) not in node_of:
                node_of[tuple(ids[:d])] = len(tokens)
                tokens.append(ids[d - 1])
                parents.append(node_of[tuple(ids[:d - 1])])
    c = TokenConstraint(tok, tok.eos_ids, grammar, tok.vocab_size)
    out = np.zeros((len(tokens), c.words), np.uint32)
    c.masks(len(tokens), np.array(tokens), np.array(parents), out)
    return tokens, parents, node_of, out

def test_auto_masks_across_the_trigger_equal_a_fresh_matchers(dec):
    """tool_choice auto: before '<tool_call>' every token is allowed, after it only a call.  A draft tree whose
    paths cross the trigger gets, at every node, the mask a fresh matcher computes after consuming that node's
    path from the start (the one walk with rollback is exact); a branch the grammar forbids is cut."""
    from dflash27b.constraint import TokenConstraint, compile_grammar
    tok, tools = dec.tokenizer, parse_tools(TOOLS)
    g = compile_grammar(lark=tool_grammar(tools, "auto", True, after_think=False))
    paths = ["Sure. <tool_call>\n<function=get_weather>\n<parameter=city>\nRome",
             "Sure. <tool_call>\n<function=ping>\n</function>\n</tool_call>",
             "Sure. <tool_call>\nnot a function", "Sure, no call needed."]
    tokens, parents, node_of, out = _walk(tok, g, paths)
    n = len(tokens)
    alive = 0
    for key, i in node_of.items():
        fresh = TokenConstraint(tok, tok.eos_ids, g, tok.vocab_size)
        ok = all(fresh.matcher.consume_token(t) for t in key)
        if ok:
            alive += 1
            assert np.array_equal(out[i], fresh._mask()), tok.decode(list(key))
        else:
            assert not out[i].any(), tok.decode(list(key))   # forbidden: no mask, no children
    assert alive < n   # "not a function" was cut
    first = node_of[tuple(tok.encode(paths[0], parse_special=False)[:1])]
    bits = int(np.unpackbits(out[0].view(np.uint8)).sum())
    assert np.array_equal(out[first], out[0]) and bits >= tok.vocab_size * 0.9   # free text: every token



def test_masks_stop_after_the_nodes_the_caller_keeps(dec):
    """keep: the core keeps the first `keep` allowed nodes of a pruned tree (drafted past its cap) and reads no
    mask after them, so the walk stops there: the rows it fills equal the whole walk's, it asks the matcher for
    at most keep + 1 masks, and leaves the matcher where it found it."""
    from dflash27b.constraint import TokenConstraint, compile_grammar
    tok, tools = dec.tokenizer, parse_tools(TOOLS)
    g = compile_grammar(lark=tool_grammar(tools, "required", True, after_think=False))
    paths = ["<tool_call>\n<function=get_weather>\n<parameter=city>\nRome", "<tool_call>\nnot a function",
             "<tool_call>\n<function=ping>\n</function>\n</tool_call>", "no call at all"]
    tokens, parents, _, full = _walk(tok, g, paths)
    n = len(tokens)
    allowed = [i for i in range(1, n) if full[parents[i]][tokens[i] >> 5] >> np.uint32(tokens[i] & 31) & 1
               and (parents[i] == 0 or full[parents[i]].any())]
    assert 6 < len(allowed) < n - 1   # some nodes forbidden, enough allowed to stop early
    for keep in (0, 1, 5, len(allowed), n):
        c = TokenConstraint(tok, tok.eos_ids, g, tok.vocab_size)
        calls = 0
        inner = c._mask

        def counted():
            nonlocal calls
            calls += 1
            return inner()
        c._mask = counted
        out = np.zeros((n, c.words), np.uint32)
        c.masks(n, np.array(tokens), np.array(parents), out, keep)
        last = allowed[keep - 1] if 0 < keep <= len(allowed) else (0 if keep == 0 else n - 1)
        assert np.array_equal(out[:last + 1], full[:last + 1]), keep
        assert not out[last + 1:].any(), keep
        assert calls <= min(keep, len(allowed)) + 1, (keep, calls)
        c._mask = inner
        assert np.array_equal(c._mask(), full[0])   # the matcher is back at node 0


def test_split_streamed_equals_whole():
    tools = parse_tools(TOOLS)
    call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\n3\n" \
           "</parameter>\n</function>\n</tool_call>"
    for text, want_text, n in [("Let me check.\n\n" + call, "Let me check.", 1), (call + "\n" + call, "", 2),
                               ("no call <tool here", "no call <tool here", 0),
                               (call + "\n<tool_call>\n<function=get_we", "<tool_call>\n<function=get_we", 1)]:
        whole_text, whole_calls = ToolCallSplit.split(text, tools)
        assert whole_text == want_text and len(whole_calls) == n, text
        s, got_text, got_calls = ToolCallSplit(tools), "", []
        for ch in text:
            t, c = s.push(ch)
            got_text, got_calls = got_text + t, got_calls + c
        t, c = s.flush()
        assert got_text + t == whole_text
        assert [x["function"] for x in got_calls + c] == [x["function"] for x in whole_calls]
        assert [x["index"] for x in got_calls + c] == list(range(n))
    args = json.loads(whole_calls[0]["function"]["arguments"]) if n else None
    assert args == {"city": "Rome", "days": 3}


BAD = [
    ({"tools": []}, "tools must be a non-empty list"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function has no name"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "function name 'a b' must be"),
    ({"tools": [TOOLS[-2], TOOLS[-2]]}, "function name 'ping' is given twice"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0] must be {\"type\": \"function\""),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "parameters must be a schema of type 'object'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]}}}]},
     "required parameter 'b' is not among its properties"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a<b": {"type": "string"}}}}}]}, "cannot be written in Qwen's tool-call"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "frobnicate"}}}}}]}, "lark"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice names the function 'nope', which is not among the tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice must be"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": TOOLS, "json_schema": {}}, "tools and a json_schema / grammar ask for two constraints"),
]


@pytest.mark.parametrize("kw, message", BAD, ids=[m for _, m in BAD])
def test_bad_tools_are_refused_by_name_and_the_decoder_goes_on(dec, kw, message):
    with pytest.raises(DFlashError, match=re.escape(message)) as e:
        dec.generate(MSGS, 8, chat=True, mode="chain", **kw)
    assert "\n" not in str(e.value).strip()
    r = dec.generate(MSGS, 60, chat=True, mode="chain", tools=TOOLS, tool_choice="required",
                     parallel_tool_calls=False, chat_template_kwargs=NO_THINK)
    assert r.tool_calls or r.stats.stop_reason == "length"


def test_cli_generate_takes_tools_from_a_file(dec, tmp_path):
    import subprocess
    import sys
    f = tmp_path / "tools.json"
    f.write_text(json.dumps(TOOLS))
    r = subprocess.run([sys.executable, "-m", "dflash27b.cli", "generate", "What is the weather?", "--chat",
                        "--tools", str(f), "--tool-choice", '{"type": "function", "function": {"name": "get_weather"}}',
                        "--chat-template-kwargs", json.dumps(NO_THINK), "-n", "120", "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    calls = out["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls][:1] == ["get_weather"]
    _validate(calls)


# -- the OpenAI client against serve --http -------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from serve_util import serve
    s = serve(tmp_path_factory.mktemp("tools"), ctx=2048)
    yield s
    s.stop()


def test_openai_client_round_trip(served, dec):
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=served.url + "/v1", api_key="unused")
    kw = dict(model="tiny", tools=TOOLS, max_tokens=120, temperature=0, parallel_tool_calls=False,
              extra_body={"chat_template_kwargs": NO_THINK})
    # required: a call, valid, finish_reason tool_calls; streamed deltas assemble to the same call
    r = c.chat.completions.create(messages=MSGS, tool_choice="required", **kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None and len(ch.message.tool_calls) == 1
    call = ch.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    _validate([call.model_dump()])
    local = dec.generate(MSGS, 120, chat=True, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                         chat_template_kwargs=NO_THINK, mode="ar", cache=False)
    assert [x["function"] for x in local.tool_calls] == [call.function.model_dump()]
    got: dict[int, dict] = {}
    finish = None
    for chunk in c.chat.completions.create(messages=MSGS, tool_choice="required", stream=True, **kw):
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for d in chunk.choices[0].delta.tool_calls or []:
            g = got.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            g["id"] = d.id or g["id"]
            g["name"] += d.function.name or ""
            g["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" and len(got) == 1
    assert {"name": got[0]["name"], "arguments": got[0]["arguments"]} == call.function.model_dump()
    # named: that function
    named = c.chat.completions.create(messages=MSGS, tool_choice={"type": "function",
                                                                  "function": {"name": "get_weather"}}, **kw)
    wcall = named.choices[0].message.tool_calls[0]
    assert wcall.function.name == "get_weather"
    _validate([wcall.model_dump()])
    # the tool's result goes back through the template; auto continues the conversation (this model answers
    # with text), and the prompt holds the call and the result as the template writes them
    msgs = MSGS + [named.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": wcall.id, "content": "sunny, 21 C"}]
    follow = c.chat.completions.create(messages=msgs, tool_choice="auto", **{**kw, "max_tokens": 16})
    assert follow.choices[0].finish_reason in ("length", "stop") and not follow.choices[0].message.tool_calls
    want = dec.generate(msgs, 16, chat=True, tools=TOOLS, chat_template_kwargs=NO_THINK, mode="ar", cache=False)
    assert follow.choices[0].message.content == want.message["content"]
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in dec.chat_prompt(msgs, tools=TOOLS)
    assert follow.usage.prompt_tokens == len(want.prompt_tokens)
    # thinking on: reasoning_content is split from the call
    think = c.chat.completions.create(messages=MSGS, tool_choice="required", **{
        **kw, "max_tokens": 30, "extra_body": {"grammar_prune": True}})
    m = think.choices[0].message
    assert m.reasoning_content and "<think>" not in (m.reasoning_content or "")


@pytest.mark.parametrize("body, message", [
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools[0].function has no name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "two constraints"),
    ({"messages": MSGS + [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {
        "name": "ping", "arguments": "{bad"}}]}]}, "arguments is not JSON"),
    ({"messages": MSGS + [{"role": "tool", "content": "x", "tool_call_id": 3}]}, "tool_call_id must be a string"),
    ({"messages": MSGS + [{"role": "function", "content": "x"}]}, "'function' messages are not supported"),
    ({"functions": [{"name": "f"}]}, "'functions' is not supported"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_tool_requests_get_a_400_naming_the_problem(served, body, message):
    r = served.post("/v1/chat/completions", {"messages": MSGS, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]["message"]
    assert message in err and "\n" not in err
    ok = served.post("/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, "tools": TOOLS,
                                              "tool_choice": "none"})
    assert ok.status_code == 200


def test_socket_protocol_returns_the_message(served, dec):
    remote = Decoder.connect(served.sock)
    kw = dict(chat=True, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, mode="ar",
              chat_template_kwargs=NO_THINK)
    r = remote.generate(MSGS, 120, **kw)
    want = dec.generate(MSGS, 120, cache=False, **kw)
    assert r.tokens == want.tokens
    assert [c["function"] for c in r.tool_calls] == [c["function"] for c in want.tool_calls]


def test_a_drafted_end_of_generation_is_a_leaf_of_the_mask_walk(dec):
    """Prompt lookup drafts what followed a call in the context: '</tool_call>' then the end of the turn.  The
    walk over the draft tree gives an allowed end-of-generation node no children and does not consume it (a
    matcher that stopped on it rolls back differently), so the decided text stays the constraint's."""
    from dflash27b.constraint import TokenConstraint, compile_grammar
    tok, tools = dec.tokenizer, parse_tools(TOOLS)
    g = compile_grammar(lark=tool_grammar(tools, "ping", False, after_think=False))
    c = TokenConstraint(tok, tok.eos_ids, g, tok.vocab_size)
    c.commit(tok.encode("<tool_call>\n<function=ping>\n</function>\n</", parse_special=False))
    eos = min(tok.eos_ids)
    rest = tok.encode("tool_call>", parse_special=False)
    tokens = [0] + rest + [eos] + tok.encode("\n", parse_special=False)
    parents = list(range(-1, len(tokens) - 1))
    out = np.zeros((len(tokens), c.words), np.uint32)
    c.masks(len(tokens), np.array(tokens), np.array(parents), out)
    assert out[len(rest)][eos >> 5] >> (eos & 31) & 1      # the end is allowed after the call
    assert not out[len(rest) + 1].any() and not out[len(rest) + 2].any()   # a leaf: nothing below it
    c.commit(rest + [eos])                                  # the matcher is where it was before the walk
    assert c.done()
    hist = MSGS + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "ping", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "1", "content": "pong"}, {"role": "user", "content": "Again."}]
    with Decoder(draft="lookup", threads=2) as lk:
        kw = dict(chat=True, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "ping"}},
                  chat_template_kwargs=NO_THINK, cache=False)
        ar = lk.generate(hist, 40, mode="ar", **kw)
        assert ar.tool_calls and ar.tool_calls[0]["function"]["name"] == "ping"
        for mode in ("chain", "ddtree", "auto"):
            assert lk.generate(hist, 40, mode=mode, **kw).tokens == ar.tokens, mode
