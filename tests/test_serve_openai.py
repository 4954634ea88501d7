"""The OpenAI field table and response shapes (issue 38, findings 8, 9, 10): nulls where OpenAI allows them,
`developer` as `system`, image / audio parts and `name` refused, strict types, no exception names in messages;
logprob and /tokenize shapes as OpenAI and llama-server give them; llama-server's metric names.  A daemon on
the tiny test target (random weights, so byte tokens show up among the alternatives), loopback only."""
from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from dflash27b import Decoder
from serve_util import serve, socket_request, sse_events

DISTILLED = Path(__file__).resolve().parent / "fixtures" / "tiny_draft_distilled"
CTX = 256
CLASS_NAME = re.compile(r"\b[A-Z][A-Za-z]*(Error|Exception)\b")
MSGS = [{"role": "user", "content": "Write a stack class."}]


@pytest.fixture(scope="module")
def d(tiny_f32_gguf, tmp_path_factory):
    s = serve(tmp_path_factory.mktemp("oai"), "-m", str(tiny_f32_gguf), "-md", str(DISTILLED), ctx=CTX)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def local(tiny_f32_gguf):
    with Decoder(tiny_f32_gguf, DISTILLED, ctx=CTX, threads=1) as dec:
        yield dec


def _chat(d, **kw):
    return httpx.post(d.url + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 8, "temperature": 0,
                                                             **kw}, timeout=30)


def _completion(d, **kw):
    return httpx.post(d.url + "/v1/completions", json={"prompt": "def fibonacci(n):", "max_tokens": 8,
                                                        "temperature": 0, **kw}, timeout=30)


def _refused(r, needle: str) -> None:
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert needle in msg and not CLASS_NAME.search(msg), msg


# -- finding 8: the field table -------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["false", "true", 0, 1])
def test_stream_must_be_a_boolean(d, value):
    _refused(_completion(d, stream=value), "'stream'")
    _refused(_chat(d, stream=value), "'stream'")


def test_nulls_where_openai_allows_them(d, local):
    want = local.generate(MSGS, 8, chat=True, cache=False).message   # (the template opens a thinking block)
    nulls = dict(n=None, frequency_penalty=None, presence_penalty=None, logprobs=None, top_logprobs=None,
                 stop=None, seed=None, user=None, stream=None, stream_options=None, logit_bias=None,
                 response_format=None, tools=None, tool_choice=None, max_completion_tokens=None, top_p=None,
                 metadata=None, service_tier=None, parallel_tool_calls=None, modalities=None)
    r = _chat(d, **nulls)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == want
    r = _completion(d, n=None, frequency_penalty=None, presence_penalty=None, logprobs=None, echo=None,
                    suffix=None, best_of=None, stop=None, seed=None, user=None)
    assert r.status_code == 200, r.text


def test_developer_role_is_the_system_role(d, local):
    msgs = [{"role": "developer", "content": "You write Python."}, *MSGS]
    want = local.generate([{"role": "system", "content": "You write Python."}, *MSGS], 8, chat=True,
                          cache=False).message
    r = httpx.post(d.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 8, "temperature": 0},
                   timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == want


@pytest.mark.parametrize("message,needle", [
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]},
     "image_url"),
    ({"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "input_audio",
                                                                   "input_audio": {"data": "AA==", "format": "wav"}}]},
     "input_audio"),
    ({"role": "user", "content": [{"type": "file", "file": {"file_id": "f"}}]}, "file"),
    ({"role": "user", "content": "hi", "name": "alice"}, "'name'"),
    ({"role": "user", "content": "42", "tool_call_id": "c1"}, "'tool_call_id' is not allowed on a user message"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]}, "tool"),
    ({"role": "user", "content": "hi", "colour": "red"}, "'colour'"),
    ({"role": "wizard", "content": "hi"}, "'wizard'"),
    ({"role": "user", "content": 5}, "content"),
    ({"role": "user", "content": [{"type": "text"}]}, "text"),
])
def test_unhonoured_message_parts_are_refused(d, message, needle):
    r = httpx.post(d.url + "/v1/chat/completions", json={"messages": [message], "max_tokens": 2}, timeout=30)
    _refused(r, needle)


def test_text_parts_and_null_fields_of_a_message_are_fine(d, local):
    want = local.generate(MSGS, 8, chat=True, cache=False).message
    parts = [{"role": "user", "content": [{"type": "text", "text": "Write a stack "}, {"type": "text",
                                                                                       "text": "class."}],
              "name": None}]
    r = httpx.post(d.url + "/v1/chat/completions", json={"messages": parts, "max_tokens": 8, "temperature": 0},
                   timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["message"] == want


@pytest.mark.parametrize("body,needle", [
    ({"max_tokens": 10**30}, "'max_tokens'"),
    ({"max_tokens": 2**31}, "'max_tokens'"),
    ({"seed": -1}, "'seed'"),
    ({"n": 0}, "'n'"),
    ({"n": 65}, "'n'"),
    ({"n": "1"}, "'n'"),
    ({"model": 5}, "'model'"),
    ({"temperature": "0"}, "'temperature'"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"user": 5}, "'user'"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_strict_types_and_clear_messages(d, body, needle):
    _refused(_completion(d, **body), needle)


def test_lone_surrogates_and_overflows_never_leak_exception_names(d):
    for body in ({"prompt": "\ud800"}, {"prompt": [1, 2**40]}, {"prompt": "x", "logprobs": 2**70}):
        r = httpx.post(d.url + "/v1/completions", content=_dumps_raw(body),
                       headers={"Content-Type": "application/json"}, timeout=30)
        assert r.status_code == 400 and not CLASS_NAME.search(r.json()["error"]["message"]), r.text
    r = httpx.post(d.url + "/v1/chat/completions", content=_dumps_raw({"messages": [
        {"role": "user", "content": "\udc00"}]}), headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]


def _dumps_raw(obj) -> bytes:
    import json
    return json.dumps(obj).encode()   # ensure_ascii: lone surrogates travel as \ud800 escapes



# -- n: several choices, decoded in slots ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def dp(tiny_f32_gguf, tmp_path_factory):
    s = serve(tmp_path_factory.mktemp("oai-n"), "-m", str(tiny_f32_gguf), "-md", str(DISTILLED), "--parallel", "3",
              ctx=3 * CTX)
    yield s
    s.stop()


def test_n_choices_are_the_requests_with_seed_plus_i(dp, local):
    """Choice i of a request with seed s is that request alone with seed s + i (counter-based sampling: the
    same seed would give n equal choices); the prompt counts once in the usage, every choice's tokens count."""
    body = {"prompt": "def fibonacci(n):", "max_tokens": 12, "temperature": 0.9, "seed": 7, "ignore_eos": True}
    r = httpx.post(dp.url + "/v1/completions", json={**body, "n": 4}, timeout=60).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    want = [local.generate("def fibonacci(n):", 12, temperature=0.9, seed=7 + i, ignore_eos=True, cache=False).text
            for i in range(4)]
    assert [c["text"] for c in r["choices"]] == want
    assert len(set(want)) > 1
    assert r["usage"]["completion_tokens"] == 48
    assert r["usage"]["total_tokens"] == r["usage"]["prompt_tokens"] + 48 == len(local.tokenize("def fibonacci(n):")) + 48
    assert len(r["dflash27b"]) == len(r["timings"]) == 4
    one = httpx.post(dp.url + "/v1/completions", json={**body, "seed": 9}, timeout=60).json()
    assert one["choices"][0]["text"] == want[2] and one["choices"][0]["index"] == 0


def test_n_streamed_chat_choices_equal_the_whole_ones(dp):
    """Streamed, the choices' chunks interleave, each naming its index: each choice's text is the non-streamed
    one's, each gets its own role chunk and finish, and the usage chunk counts them all."""
    body = {"messages": MSGS, "max_tokens": 10, "temperature": 0.8, "seed": 3, "n": 3,
            "chat_template_kwargs": {"enable_thinking": False}}
    whole = httpx.post(dp.url + "/v1/chat/completions", json=body, timeout=60).json()
    with httpx.stream("POST", dp.url + "/v1/chat/completions", timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    text = {i: "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"][0]["index"] == i)
            for i in range(3)}
    assert [text[i] for i in range(3)] == [c["message"]["content"] for c in whole["choices"]]
    for i in range(3):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert mine[0]["delta"].get("role") == "assistant" and mine[-1]["finish_reason"] is not None
    assert len({c["id"] for c in chunks}) == 1
    usage = events[-2]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")   # (the second request's prompt was cached)
    assert usage["choices"] == [] and [usage["usage"][k] for k in counts] == [whole["usage"][k] for k in counts]



def test_a_batch_of_prompts_gives_n_choices_each_in_order(dp, local):
    """A completions batch (prompt: a list of prompts, as lm-evaluation-harness sends): n choices for each, in
    prompt order (choice index = prompt * n + j), each the prompt alone with seed + j; the usage counts every
    prompt once."""
    prompts = ["def fibonacci(n):", "import os", [5, 6, 7]]
    body = {"prompt": prompts, "max_tokens": 6, "temperature": 0.7, "seed": 2, "n": 2, "ignore_eos": True}
    r = httpx.post(dp.url + "/v1/completions", json=body, timeout=60).json()
    assert [c["index"] for c in r["choices"]] == list(range(6))
    want = [local.generate(p, 6, temperature=0.7, seed=2 + j, ignore_eos=True, cache=False).text
            for p in prompts for j in range(2)]
    assert [c["text"] for c in r["choices"]] == want
    n_prompt = sum(len(local.tokenize(p)) if isinstance(p, str) else len(p) for p in prompts)
    assert r["usage"]["prompt_tokens"] == n_prompt and r["usage"]["completion_tokens"] == 36
    with httpx.stream("POST", dp.url + "/v1/completions", timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as s:
        events = sse_events(s.iter_lines())
    chunks = [e for e in events[:-1] if e["choices"]]
    assert ["".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in range(6)] == want
    assert events[-2]["usage"]["prompt_tokens"] == n_prompt


@pytest.mark.parametrize("prompt, n, needle", [
    ([[]], 1, "'prompt'"), ([], 1, "'prompt'"), (["a", 5], 1, "'prompt'"), (["x"] * 5, 64, "256 requests")])
def test_bad_batches_are_refused(dp, prompt, n, needle):
    _refused(httpx.post(dp.url + "/v1/completions", json={"prompt": prompt, "n": n, "max_tokens": 2}, timeout=30),
             needle)


def test_echo_returns_the_prompt_and_its_logprobs(dp, local):
    """echo (completions): the prompt's text before the reply's; with logprobs, every prompt token's
    log-probability given the ones before it (the first: null), as lm-evaluation-harness's loglikelihood asks
    (a batch of token-id prompts, max_tokens 0, logprobs 1): the log-softmax of the raw logits, as the reply's."""
    prompt = "def fibonacci(n):\n    if n < 2:"
    r = httpx.post(dp.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0,
                                                      "echo": True, "ignore_eos": True}, timeout=60).json()
    want = local.generate(prompt, 5, ignore_eos=True, cache=False)
    assert r["choices"][0]["text"] == prompt + want.text
    batch = [local.tokenize(prompt), local.tokenize("import os\nimport sys")]
    r = httpx.post(dp.url + "/v1/completions", json={"prompt": batch, "max_tokens": 0, "temperature": 0,
                                                      "echo": True, "logprobs": 1}, timeout=60).json()
    for ids, c in zip(batch, r["choices"]):
        lp = c["logprobs"]
        assert c["text"] == local.detokenize(ids) and len(lp["tokens"]) == len(ids)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ref = local.prompt_logprobs(ids, 1)
        assert lp["token_logprobs"][1:] == pytest.approx([e["logprob"] for e in ref[1:]], abs=1e-6)
        assert all(len(t) == 1 for t in lp["top_logprobs"][1:])
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    # the prompt's logprobs then the reply's, streamed as whole; the reply's equal the plain request's
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 2, "ignore_eos": True}
    whole = httpx.post(dp.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    plain = httpx.post(dp.url + "/v1/completions", json={**body, "echo": False}, timeout=60).json()["choices"][0]
    n_prompt = len(local.tokenize(prompt))
    assert whole["logprobs"]["token_logprobs"][n_prompt:] == plain["logprobs"]["token_logprobs"]
    assert whole["text"] == prompt + plain["text"]
    with httpx.stream("POST", dp.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        chunks = [e for e in sse_events(s.iter_lines()) if isinstance(e, dict) and e["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    streamed = [x for c in chunks if c["choices"][0]["logprobs"] for x in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == whole["logprobs"]["token_logprobs"]
    _refused(_chat(dp, echo=True), "echo")

def test_n_greedy_choices_are_equal(dp):
    r = httpx.post(dp.url + "/v1/completions", json={"prompt": "import os", "max_tokens": 8, "temperature": 0,
                                                      "n": 2}, timeout=60).json()
    assert r["choices"][0]["text"] == r["choices"][1]["text"]

# -- finding 9: logprob and tokenize shapes --------------------------------------------------------------------

def test_streamed_text_offset_continues_across_chunks(d):
    body = {"prompt": "def fibonacci(n):", "max_tokens": 24, "temperature": 0, "logprobs": 1, "ignore_eos": True}
    full = httpx.post(d.url + "/v1/completions", json=body, timeout=30).json()["choices"][0]
    with httpx.stream("POST", d.url + "/v1/completions", json={**body, "stream": True}, timeout=30) as r:
        chunks = [e for e in sse_events(r.iter_lines()) if isinstance(e, dict) and e["choices"]]
    offsets = [o for c in chunks if c["choices"][0]["logprobs"] for o in c["choices"][0]["logprobs"]["text_offset"]]
    tokens = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert len(offsets) == 24 and offsets == full["logprobs"]["text_offset"]
    assert tokens == full["logprobs"]["tokens"]
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] > 0


def test_completion_top_logprobs_keys_are_distinct(d, local):
    """Byte tokens (partial UTF-8) get OpenAI's `bytes:\\xNN` spelling, so k alternatives give k keys."""
    r = _completion(d, prompt="def fibonacci(n):", max_tokens=16, logprobs=20, ignore_eos=True).json()
    lp = r["choices"][0]["logprobs"]
    assert [len(t) for t in lp["top_logprobs"]] == [20] * 16
    keys = {k for t in lp["top_logprobs"] for k in t}
    assert any(k.startswith("bytes:\\x") for k in keys), "the test wants byte tokens among the alternatives"
    # vLLM's return_tokens_as_token_ids: "token_id:N" keys, exact ids
    r = _completion(d, prompt="def fibonacci(n):", max_tokens=4, logprobs=3, ignore_eos=True,
                    return_tokens_as_token_ids=True).json()
    lp = r["choices"][0]["logprobs"]
    gen = local.generate("def fibonacci(n):", 4, ignore_eos=True, cache=False).tokens
    assert lp["tokens"] == [f"token_id:{t}" for t in gen]
    assert all(len(t) == 3 and all(k.startswith("token_id:") for k in t) for t in lp["top_logprobs"])


def test_chat_logprob_bytes_are_the_token_bytes(d, local):
    r = _chat(d, max_tokens=12, logprobs=True, top_logprobs=20, ignore_eos=True).json()
    content = r["choices"][0]["logprobs"]["content"]
    for e in content:
        assert len(e["top_logprobs"]) == 20
        assert len({bytes(a["bytes"]) for a in e["top_logprobs"]}) == 20
        for a in e["top_logprobs"]:
            b = bytes(a["bytes"])
            try:
                assert a["token"] == b.decode("utf-8")
            except UnicodeDecodeError:
                assert a["token"] == "bytes:" + "".join(f"\\x{x:02x}" for x in b)


def test_tokenize_pieces_keep_partial_utf8(d, local):
    text = "日本語 héllo 🙂 ok"
    pieces = httpx.post(d.url + "/tokenize", json={"content": text, "with_pieces": True}, timeout=30).json()["tokens"]
    assert [p["id"] for p in pieces] == local.tokenize(text)
    raw = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert raw == text.encode()
    assert any(isinstance(p["piece"], list) for p in pieces), "the test wants a token that is part of a character"


# -- finding 10: llama-server's metric names --------------------------------------------------------------------

def test_metrics_export_llama_server_names(d):
    assert _completion(d, max_tokens=6, ignore_eos=True).status_code == 200
    text = httpx.get(d.url + "/metrics", timeout=10).text
    vals = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}
    for name in ("prompt_tokens_total", "prompt_seconds_total", "tokens_predicted_total",
                 "tokens_predicted_seconds_total", "prompt_tokens_seconds", "predicted_tokens_seconds",
                 "requests_processing", "requests_deferred"):
        assert f"llamacpp:{name}" in vals, name
        assert f"# TYPE llamacpp:{name} " in text
    assert vals["llamacpp:tokens_predicted_total"] >= 6 and vals["llamacpp:prompt_tokens_total"] >= 1
    assert vals["llamacpp:requests_processing"] == 0 and vals["llamacpp:requests_deferred"] == 0
    assert vals["dflash27b_tokens_predicted_total"] == vals["llamacpp:tokens_predicted_total"]


# -- a user's and an attacker's pass (2026-11-29): each was a crash, a silent cap or a leak before -----------------

@pytest.mark.parametrize("variables,needle", [({"tools": "x"}, "'tools'"), ({"namespace": 1}, "'namespace'"),
                                              ({"raise_exception": 1}, "'raise_exception'"),
                                              ({"messages": "x"}, "'messages'")])
def test_template_variables_may_not_replace_what_the_template_reads(d, variables, needle):
    """These were an HTTP 500 (the render's own argument given twice, a template function replaced by a number)
    and, over the socket, a dropped connection: now a 400 naming the variable, on either side, and the
    connection and the server keep serving."""
    _refused(_chat(d, chat_template_kwargs=variables), needle)
    bad = {"messages": MSGS, "max_new_tokens": 2, "chat_template_kwargs": variables}
    good = {"prompt": "def f(x):", "max_new_tokens": 2}
    events = socket_request(d.sock, bad, good)
    errors = [e for e in events if e["event"] == "error"]
    assert len(errors) == 1 and needle in errors[0]["message"] and errors[0]["code"] == "bad_request", events
    assert events[-1]["event"] == "done", events
    assert _chat(d).status_code == 200


def test_a_template_failing_on_the_variables_is_the_requests_error():
    """A template computing with a variable of a type it does not expect raises Python's errors, not Jinja's:
    the request is refused with what failed."""
    from dflash27b.serve_protocol import RequestError, chat_text

    class Failing:
        class tokenizer:
            chat_template = "{{ messages[0].content + limit }}"

        @staticmethod
        def chat_prompt(messages, tools=None, **kw):
            return messages[0]["content"] + kw["limit"]

    with pytest.raises(RequestError, match="the chat template failed .*TypeError"):
        chat_text(Failing(), [{"role": "user", "content": "x"}], {"limit": 3})


@pytest.mark.parametrize("field,value", [("tools", [{"type": "function", "function": {"name": "f"}}]),
                                         ("tool_choice", "required"), ("parallel_tool_calls", False),
                                         ("chat_template_kwargs", {"enable_thinking": False})])
def test_chat_only_fields_are_refused_on_completions(d, field, value):
    """A raw prompt has no template to list tools in and no reply to parse calls from: tools on /v1/completions
    had constrained the text to raw <tool_call> markup and returned it unparsed."""
    _refused(_completion(d, **{field: value}), f"'{field}' belongs to /v1/chat/completions")


def test_without_max_tokens_a_reply_runs_to_the_context_end(d):
    """No max_tokens: to the end of the reply or of the context, as llama-server and OpenAI's chat (it had been
    cut at the engine's CLI default of 256 tokens with finish_reason length)."""
    r = httpx.post(d.url + "/v1/completions", json={"prompt": "def fibonacci(n):", "temperature": 0,
                                                    "ignore_eos": True, "mode": "ar"}, timeout=60)
    assert r.status_code == 200, r.text
    u, choice = r.json()["usage"], r.json()["choices"][0]
    # (the last token is emitted without a context row of its own)
    assert u["prompt_tokens"] + u["completion_tokens"] == CTX + 1 and choice["finish_reason"] == "length", r.json()


def test_chat_echo_names_where_echo_is(d):
    _refused(_chat(d, echo=True), "/v1/completions does")


def test_a_bad_constraint_is_refused_before_it_queues(d):
    """Schemas and grammars are compiled when the request is admitted, off the decode thread: a bad one is
    refused at once, while another request holds the only slot, and never waits in the queue."""
    import threading
    long = {"prompt": "def f(x):", "max_new_tokens": 200, "ignore_eos": True, "mode": "ar"}
    got = []
    t = threading.Thread(target=lambda: got.extend(socket_request(d.sock, long, timeout=120)))
    t.start()
    try:
        import time
        while d.health()["slots"]["busy"] == 0 and t.is_alive():
            time.sleep(0.01)
        events = socket_request(d.sock, {"prompt": "x", "json_schema": {"type": "string", "pattern": "(a"}})
        assert [e["event"] for e in events] == ["error"], events
        assert "invalid regex /(a/" in events[0]["message"]
    finally:
        t.join()
    assert got[-1]["event"] == "done"


def test_template_variables_without_messages_are_refused_on_the_socket(d):
    """A raw prompt has no chat template: its variables had been ignored (the CLI refused them)."""
    events = socket_request(d.sock, {"prompt": "x", "max_new_tokens": 2,
                                     "chat_template_kwargs": {"enable_thinking": False}})
    assert [e["event"] for e in events] == ["error"] and "needs 'messages'" in events[0]["message"], events


# -- llama-server's `timings` (harnesses written for it read draft_n / draft_n_accepted, predicted_per_second) ----

def test_timings_are_llama_servers(d, local):
    """`timings` in the body and on the last streamed chunk, as llama-server sends it: the prompt's part (tokens
    prefilled, ms, rates, cache_n), the reply's, and with a drafting mode the drafted and accepted tokens, which
    add up with the steps to the reply's tokens (each step commits its accepted drafts and one of its own)."""
    prompt = "def fibonacci(n):"
    r = _completion(d, prompt=prompt, max_tokens=24, ignore_eos=True, mode="chain").json()
    t = r["timings"]
    want = local.generate(prompt, 24, mode="chain", ignore_eos=True, cache=False)
    assert r["choices"][0]["text"] == want.text
    assert t["predicted_n"] == 24 == r["usage"]["completion_tokens"]
    assert t["prompt_n"] + t["cache_n"] == r["usage"]["prompt_tokens"] == len(local.tokenize(prompt))
    assert t["predicted_per_second"] == r["dflash27b"]["decode_tok_s"] > 0
    assert t["prompt_ms"] > 0 and t["predicted_ms"] > 0
    assert t["prompt_per_second"] == pytest.approx(t["prompt_n"] / t["prompt_ms"] * 1e3)
    assert t["draft_n"] == sum(want.stats.tree_size) > 0
    # every token after the prefill's first came from a step: its accepted drafts plus one of the target's own
    assert t["draft_n_accepted"] == sum(want.stats.accept_lengths) - len(want.stats.accept_lengths)
    assert 0 <= t["draft_n_accepted"] <= t["draft_n"]
    ar = _completion(d, prompt=prompt, max_tokens=8, mode="ar", ignore_eos=True).json()["timings"]
    assert "draft_n" not in ar and "draft_n_accepted" not in ar and ar["predicted_n"] == 8
    with httpx.stream("POST", d.url + "/v1/chat/completions", timeout=30,
                      json={"messages": MSGS, "max_tokens": 8, "temperature": 0, "stream": True}) as s:
        events = sse_events(s.iter_lines())
    last = [e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(last) == 1 and last[0]["timings"]["predicted_n"] == 8
    assert not any("timings" in e for e in events[:-1] if e not in last)


def test_props_are_llama_servers(d, local):
    """GET /props as llama-server's clients read it: the model, slots, context, chat template and its special
    tokens, what an omitted sampling field means over HTTP (OpenAI's temperature 1.0, no token limit), the build;
    setting properties is not offered."""
    r = httpx.get(d.url + "/props", timeout=10)
    assert r.status_code == 200, r.text
    p = r.json()
    assert p["total_slots"] == 1 and p["default_generation_settings"]["n_ctx"] == CTX
    assert p["chat_template"] == local.tokenizer.chat_template and p["eos_token"] == "<|im_end|>"
    assert p["default_generation_settings"]["params"]["temperature"] == 1.0
    assert p["default_generation_settings"]["params"]["n_predict"] == -1
    assert p["build_info"].startswith("dflash27b ") and p["modalities"] == {"vision": False, "audio": False}
    assert p["dflash27b"]["draft"] and p["dflash27b"]["default_mode"] == "auto"
    assert httpx.post(d.url + "/props", json={}, timeout=10).status_code == 405


def test_n_echoed_choices_share_the_prompts_logprobs(dp):
    """echo with logprobs and n choices: the first choice computes the prompt's log-probabilities and every
    choice carries them, streamed or whole, its echo first; each choice equals the request alone with seed + i."""
    body = {"prompt": "def fibonacci(n):\n    if n < 2:", "max_tokens": 6, "temperature": 0.8, "seed": 5,
            "echo": True, "logprobs": 2, "ignore_eos": True}
    alone = [httpx.post(dp.url + "/v1/completions", json={**body, "seed": 5 + i}, timeout=60).json()["choices"][0]
             for i in range(3)]
    whole = httpx.post(dp.url + "/v1/completions", json={**body, "n": 3}, timeout=60).json()["choices"]
    for a, c in zip(alone, whole):
        assert c["text"] == a["text"] and c["logprobs"]["token_logprobs"] == a["logprobs"]["token_logprobs"]
        assert c["logprobs"]["tokens"] == a["logprobs"]["tokens"]
    with httpx.stream("POST", dp.url + "/v1/completions", json={**body, "n": 3, "stream": True}, timeout=60) as s:
        chunks = [e for e in sse_events(s.iter_lines()) if isinstance(e, dict) and e.get("choices")]
    for i, a in enumerate(alone):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == a["text"]
        assert mine[0]["text"] == body["prompt"]   # the echo first
        lps = [x for c in mine if c["logprobs"] for x in c["logprobs"]["token_logprobs"]]
        assert lps == a["logprobs"]["token_logprobs"]
