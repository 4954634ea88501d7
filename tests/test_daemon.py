"""The resident daemon (`dflash27b serve`): socket protocol, queueing, cancellation, errors, the OpenAI
front, and `Decoder.connect`, against a real daemon process serving the tiny pair."""
from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dflash27b import Decoder
from dflash27b._lib import DFlashError

DISTILLED = Path(__file__).resolve().parent / "fixtures" / "tiny_draft_distilled"
CTX = 256


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_socket(path: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited: {proc.stderr.read().decode()}")
        if os.path.exists(path):
            try:
                Decoder.connect(path).health()
                return
            except DFlashError:
                pass
        time.sleep(0.05)
    raise RuntimeError("daemon did not come up")


def _serve(args: list[str], sock: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "dflash27b.cli", "serve", "--socket", sock, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _wait_socket(sock, proc)
    return proc


@pytest.fixture(scope="module")
def daemon(tiny_f32_gguf, tmp_path_factory):
    d = tmp_path_factory.mktemp("daemon")
    sock = str(d / "d.sock")
    port = _free_port()
    proc = _serve(["-m", str(tiny_f32_gguf), "-md", str(DISTILLED), "-c", str(CTX), "-t", "1",
                   "--http", f"127.0.0.1:{port}", "--model-name", "tiny"], sock)
    yield {"sock": sock, "port": port, "proc": proc}
    if proc.poll() is None:
        try:
            Decoder.connect(sock).shutdown()
        except DFlashError:
            pass
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def local(tiny_f32_gguf):
    with Decoder(tiny_f32_gguf, DISTILLED, ctx=CTX, threads=1) as d:
        yield d


def _raw(sock: str, payload: bytes, n_terminal: int = 1, timeout: float = 30) -> list[dict]:
    """Send raw bytes; read events until `n_terminal` terminal events arrived."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(timeout)
    s.connect(sock)
    s.sendall(payload)
    f = s.makefile("rb")
    out, done = [], 0
    for line in f:
        ev = json.loads(line)
        out.append(ev)
        if ev["event"] in ("done", "error", "health", "shutdown"):
            done += 1
            if done == n_terminal:
                break
    s.close()
    return out


PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:"]


def test_socket_mode_0600(daemon):
    st = os.stat(daemon["sock"])
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600


def test_connect_equals_in_process(daemon, local):
    remote = Decoder.connect(daemon["sock"])
    for p in PROMPTS:
        a = local.generate(p, 24, ignore_eos=True)
        b = remote.generate(p, 24, ignore_eos=True)
        assert b.tokens == a.tokens and b.text == a.text
        assert b.stats.mode == "auto" and b.stats.generated_tokens == 24
        s = "".join(remote.stream(p, 24, ignore_eos=True, mode="chain"))
        assert s == local.generate(p, 24, ignore_eos=True, mode="chain").text


def test_two_clients_at_once(daemon, local):
    want = {p: local.generate(p, 48, ignore_eos=True).tokens for p in PROMPTS[:2]}
    got, events = {}, {}

    def run(p):
        r = Decoder.connect(daemon["sock"])
        got[p] = r.generate(p, 48, ignore_eos=True).tokens
        events[p] = [e["event"] for e in r.last_events]

    ts = [threading.Thread(target=run, args=(p,)) for p in PROMPTS[:2]]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert got == want
    # both were served by one decoder: at least one of them waited in the queue, and said so
    assert any("queued" in e for e in events.values()), events


def test_killed_client_frees_slot(daemon, local):
    code = (f"import socket,sys\ns=socket.socket(socket.AF_UNIX); s.connect({daemon['sock']!r})\n"
            "s.sendall(b'{\"prompt\": \"x\", \"max_new_tokens\": 100000, \"ignore_eos\": true, \"mode\": \"ar\"}\\n')\n"
            "f=s.makefile('rb')\nwhile b'token' not in f.readline(): pass\nprint('streaming', flush=True)\n"
            "import time; time.sleep(60)\n")
    client = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert client.stdout.readline().strip() == b"streaming"
    remote = Decoder.connect(daemon["sock"])
    assert remote.health()["queue"] == 1
    client.kill()
    client.wait()
    t0 = time.time()
    while remote.health()["queue"] and time.time() - t0 < 10:
        time.sleep(0.02)
    assert remote.health()["queue"] == 0, "the killed client's decode still holds the slot"
    assert remote.generate("def f(x):", 8).tokens == local.generate("def f(x):", 8).tokens


@pytest.mark.parametrize("payload,needle", [
    (b"{not json\n", "malformed JSON"),
    (b"[1, 2]\n", "must be a JSON object"),
    (b'{"op": "frobnicate"}\n', "unknown op 'frobnicate'"),
    (b'{"prompt": "x", "max_new_tokens": -5}\n', "'max_new_tokens' must be an integer in 0.."),
    (b'{"prompt_ids": [1, 2, 3], "max_new_tokens": 4, "mode": "beam"}\n', "'mode' must be one of"),
    (b'{"prompt": "x", "temperature": -1}\n', "'temperature' must be a number >= 0"),
    (b'{"prompt": "x", "prompt_ids": [1]}\n', "exactly one of"),
    (b'{"prompt": "x", "max_tokens": 3}\n', "unknown request field 'max_tokens'"),
    (b'{"prompt": "\xff\xfe x"}\n', "not valid UTF-8"),
    (json.dumps({"prompt_ids": [5] * (CTX + 10), "max_new_tokens": 4}).encode() + b"\n",
     f"does not fit the context length {CTX}"),
    (json.dumps({"prompt_ids": [1, 999999]}).encode() + b"\n", "outside the vocabulary"),
    (b'{"prompt": "' + b"a" * (4 << 20) + b'"}\n', "longer than 4194304 bytes"),
])
def test_bad_requests_get_error_and_daemon_keeps_serving(daemon, local, payload, needle):
    evs = _raw(daemon["sock"], payload + b'{"op": "health"}\n', n_terminal=2)
    errs = [e for e in evs if e["event"] == "error"]
    assert len(errs) == 1 and needle in errs[0]["message"], evs
    assert evs[-1]["event"] == "health" and evs[-1]["status"] == "ok"
    assert Decoder.connect(daemon["sock"]).generate([1, 2, 3], 4).tokens == local.generate([1, 2, 3], 4).tokens


def test_stop_strings_and_ids(daemon, local):
    full = local.generate("def fibonacci(n):", 40, ignore_eos=True, mode="ar")
    cut = full.text[5:9]
    evs = _raw(daemon["sock"], json.dumps({"prompt": "def fibonacci(n):", "max_new_tokens": 40,
                                           "ignore_eos": True, "stop": [cut], "id": "r1", "mode": "ar"}).encode()
               + b"\n")
    done = evs[-1]
    assert done["event"] == "done" and done["id"] == "r1"
    assert done["text"] == full.text[:full.text.index(cut)] and done["stats"]["stop_reason"] == "stop"
    assert "".join(e["text"] for e in evs if e["event"] == "token") == done["text"]


def test_second_daemon_refused_and_stale_socket_replaced(daemon, tiny_f32_gguf, tmp_path):
    r = subprocess.run([sys.executable, "-m", "dflash27b.cli", "serve", "--socket", daemon["sock"],
                        "-m", str(tiny_f32_gguf)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "already serving" in r.stderr
    assert Decoder.connect(daemon["sock"]).health()["status"] == "ok"
    # a socket file nobody listens on (a daemon that was killed) is replaced
    stale = str(tmp_path / "stale.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(stale)
    s.close()
    proc = _serve(["-m", str(tiny_f32_gguf), "-t", "1", "-c", "64"], stale)
    try:
        assert Decoder.connect(stale).generate([1, 2], 2).stats.generated_tokens == 2
    finally:
        Decoder.connect(stale).shutdown()
        proc.wait(20)
    assert not os.path.exists(stale)
    # any other file at the path is never touched
    plain = tmp_path / "not-a-socket"
    plain.write_text("keep me")
    r = subprocess.run([sys.executable, "-m", "dflash27b.cli", "serve", "--socket", str(plain),
                        "-m", str(tiny_f32_gguf)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "not a socket" in r.stderr and plain.read_text() == "keep me"


def test_connect_without_daemon_is_clear(tmp_path):
    with pytest.raises(DFlashError, match="no daemon socket"):
        Decoder.connect(tmp_path / "none.sock")


def test_cli_generate_socket_matches_in_process(daemon, tiny_f32_gguf):
    args = ["--prompt-ids", "1,2,3", "-n", "16", "--json", "--ignore-eos"]
    base = [sys.executable, "-m", "dflash27b.cli", "generate"]
    a = json.loads(subprocess.run(base + ["-m", str(tiny_f32_gguf), "-md", str(DISTILLED), "-t", "1", "-c",
                                          str(CTX)] + args, capture_output=True, text=True, check=True).stdout)
    b = json.loads(subprocess.run(base + ["--socket", daemon["sock"]] + args, capture_output=True, text=True,
                                  check=True).stdout)
    assert a["tokens"] == b["tokens"] and a["text"] == b["text"]


def test_openai_client_http(daemon, local):
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{daemon['port']}/v1", api_key="unused")
    assert [m.id for m in c.models.list().data] == ["tiny"]
    want = local.generate("def fibonacci(n):", 20, ignore_eos=True)
    r = c.completions.create(model="tiny", prompt="def fibonacci(n):", max_tokens=20, temperature=0,
                             extra_body={"ignore_eos": True})
    assert r.choices[0].text == want.text and r.usage.completion_tokens == 20
    pieces = [ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt="def fibonacci(n):", max_tokens=20, temperature=0, stream=True,
        extra_body={"ignore_eos": True})]
    assert "".join(pieces) == want.text
    msgs = [{"role": "user", "content": "Write a stack class."}]
    # the template opens a thinking block: an unclosed one is all reasoning_content
    want_chat = local.generate(msgs, 16, chat=True, ignore_eos=True, cache=False)
    assert want_chat.tokens == local.generate(local.chat_prompt(msgs), 16, ignore_eos=True, cache=False).tokens
    want_msg = want_chat.message
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == want_msg["content"] and r.choices[0].finish_reason == "length"
    assert r.choices[0].message.reasoning_content == want_msg.get("reasoning_content")
    chunks = list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want_msg["content"]
    assert "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or "" for ch in chunks) == \
        (want_msg.get("reasoning_content") or "")
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="'max_tokens' must be an integer"):
        c.completions.create(model="tiny", prompt="x", max_tokens=-1)
    # the next turn of that chat reuses the prefix cache, and says so in usage (llama-server's cache_prompt
    # turns it off for one request); the answer is the cold decode's either way
    turn2 = msgs + [{"role": "assistant", "content": want_chat.text}, {"role": "user", "content": "Now a queue."}]
    want2 = local.generate(turn2, 12, chat=True, ignore_eos=True, cache=False).message
    r2 = c.chat.completions.create(model="tiny", messages=turn2, max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert r2.choices[0].message.model_dump(exclude_none=True) == want2
    # (Qwen3.5's template drops an earlier turn's thinking: the hit is the checkpoint where turn 1's history
    # ended, before its generation prompt)
    assert r2.usage.prompt_tokens_details.cached_tokens > 0
    r3 = c.chat.completions.create(model="tiny", messages=turn2, max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True, "cache_prompt": False})
    assert r3.choices[0].message.model_dump(exclude_none=True) == want2
    assert r3.usage.prompt_tokens_details.cached_tokens == 0
    with pytest.raises(openai.BadRequestError, match="cache_prompt"):
        c.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"cache_prompt": "yes"})


def test_resident_memory_flat_over_500_requests(daemon):
    remote = Decoder.connect(daemon["sock"])
    modes = ["ar", "chain", "ddtree"]
    rss = {}
    for i in range(500):
        remote.generate([1 + i % 50, 2, 3], 4, ignore_eos=True, mode=modes[i % 3])
        if i in (49, 499):
            rss[i] = remote.health()["rss_bytes"]
    growth = rss[499] / rss[49] - 1
    print(f"resident memory after 50 requests {rss[49] / 1e6:.1f} MB, after 500 {rss[499] / 1e6:.1f} MB "
          f"({growth * 100:+.2f}%)")
    assert growth < 0.05


def test_prefill_progress_and_cancel(tiny_f32_gguf):
    with Decoder(tiny_f32_gguf, DISTILLED, ctx=CTX, threads=1, batch=32) as d:
        ids = [(3 * i) % 500 + 1 for i in range(100)]
        seen = []
        want = d.generate(ids, 8, on_prefill=lambda done, total: seen.append((done, total))).tokens
        assert seen == [(32, 100), (64, 100), (96, 100), (100, 100)]
        with pytest.raises(DFlashError, match="prefill cancelled after 64 of 100 prompt tokens"):
            d.generate(ids, 8, on_prefill=lambda done, total: done >= 64)
        assert d.generate(ids, 8).tokens == want  # nothing left behind by the cancelled prefill


def test_fire_and_forget_shutdown_stops_the_daemon(tiny_f32_gguf, tmp_path):
    """`printf '{"op": "shutdown"}\\n' | nc -U sock`: the client closes right after sending; the daemon still
    stops (only a generate request is cancelled by its client's disconnect)."""
    sock = str(tmp_path / "ff.sock")
    proc = _serve(["-m", str(tiny_f32_gguf), "-t", "1", "-c", "64"], sock)
    try:
        s = socket.socket(socket.AF_UNIX)
        s.connect(sock)
        s.sendall(b'{"op": "shutdown"}\n')
        s.close()
        assert proc.wait(20) == 0
        assert not os.path.exists(sock)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_openai_fields_honoured_or_refused(daemon, local):
    """Every OpenAI field is honoured, a no-op where it cannot change the answer, or a 400 naming it."""
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{daemon['port']}/v1", api_key="unused")
    msgs = [{"role": "user", "content": "Write a stack class."}]
    want = local.generate(msgs, 8, chat=True, ignore_eos=True, cache=False).message   # (thinking: reasoning)
    base = dict(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    # no-ops: they cannot change the answer
    r = c.chat.completions.create(**base, user="u1", n=1, logprobs=False, frequency_penalty=0, presence_penalty=0,
                                  response_format={"type": "text"}, tools=None,
                                  extra_body={"ignore_eos": True, "logit_bias": {}, "metadata": {"k": "v"}})
    assert r.choices[0].message.model_dump(exclude_none=True) == want
    # a logit bias: honoured, the in-process reply with the same bias
    banned = local.generate(msgs, 8, chat=True, ignore_eos=True, cache=False).tokens[:2]
    biased = local.generate(msgs, 8, chat=True, ignore_eos=True, cache=False,
                            logit_bias={t: -100 for t in banned}).message
    r = c.chat.completions.create(**base, logit_bias={str(t): -100 for t in banned}, extra_body={"ignore_eos": True})
    assert r.choices[0].message.model_dump(exclude_none=True) == biased != want
    two = c.chat.completions.create(**base, n=2, extra_body={"ignore_eos": True})   # n choices: greedy, equal
    assert [ch.index for ch in two.choices] == [0, 1]
    assert all(ch.message.model_dump(exclude_none=True) == want for ch in two.choices)
    # JSON mode and schemas: honoured, the in-process constrained decode's reply
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    for rf, js in (({"type": "json_object"}, {"type": "object"}),
                   ({"type": "json_schema", "json_schema": {"name": "count", "schema": schema, "strict": True}},
                    schema)):
        want_js = local.generate(msgs, 24, chat=True, json_schema=js, cache=False).message
        r = c.chat.completions.create(**{**base, "max_tokens": 24}, response_format=rf)
        assert r.choices[0].message.model_dump(exclude_none=True) == want_js
        assert isinstance(json.loads(want_js["content"]), dict) if r.choices[0].finish_reason == "stop" else True
    for bad, why in (({"type": "xml"}, "response_format"), ({"type": "json_schema", "json_schema": {"schema": {}}},
                                                             "json_schema.name"),
                     ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}},
                      "json_schema")):
        with pytest.raises(openai.BadRequestError, match=why):
            c.chat.completions.create(**base, response_format=bad)
    refused = {"top_logprobs": dict(top_logprobs=2),
               "tools": dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]),
               "logit_bias": dict(logit_bias={"5": 101}), "frobnicate": dict(extra_body={"frobnicate": 1}),
               "n": dict(n=65)}
    for field, kw in refused.items():
        with pytest.raises(openai.BadRequestError, match=field.split("=")[0]):
            c.chat.completions.create(**base, **kw)
    # penalties: honoured, the same tokens as in-process with the same penalties
    loop = "import os\nimport sys\nimport "
    want_pen = local.generate(loop, 24, ignore_eos=True, frequency_penalty=1.0, presence_penalty=0.2,
                              cache=False).text
    r = c.completions.create(model="tiny", prompt=loop, max_tokens=24, temperature=0, frequency_penalty=1.0,
                             presence_penalty=0.2, extra_body={"ignore_eos": True})
    assert r.choices[0].text == want_pen  # (tests/test_penalties.py: a penalty breaks a loop, speculative == AR)
    # stream_options.include_usage: the last chunk carries the usage
    chunks = list(c.chat.completions.create(**base, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want["content"]
    assert "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or "" for ch in chunks if ch.choices) \
        == want.get("reasoning_content", "")


def test_tokenize_detokenize_metrics(daemon, local):
    import httpx
    url = f"http://127.0.0.1:{daemon['port']}"
    ids = httpx.post(url + "/tokenize", json={"content": "def f(x):\n    return x"}).json()["tokens"]
    assert ids == local.tokenize("def f(x):\n    return x")
    assert httpx.post(url + "/detokenize", json={"tokens": ids}).json()["content"] == "def f(x):\n    return x"
    pieces = httpx.post(url + "/tokenize", json={"content": "def f", "with_pieces": True}).json()["tokens"]
    assert "".join(p["piece"] for p in pieces) == "def f"
    bad = httpx.post(url + "/detokenize", json={"tokens": [-1]})
    assert bad.status_code == 400 and "tokens" in bad.json()["error"]["message"]
    assert httpx.post(url + "/tokenize", json={"text": "x"}).status_code == 400
    m = httpx.get(url + "/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    vals = {ln.split()[0]: float(ln.split()[1]) for ln in m.text.splitlines() if ln and not ln.startswith("#")}
    assert vals["dflash27b_requests_total"] >= 1 and vals["dflash27b_tokens_predicted_total"] >= 1
    assert "dflash27b_prefix_cache_bytes" in vals and "dflash27b_queue_length" in vals



@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_openai_logprobs_equal_the_target_log_softmax(daemon, local, mode):
    """logprobs / top_logprobs (chat) and logprobs (completions), streamed or not: the target's log-softmax of
    its raw logits at each generated position, within 2e-3 of Decoder.logits (speculative modes take them from
    the verify rows of the accepted tokens)."""
    import numpy as np
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{daemon['port']}/v1", api_key="unused")
    prompt = "def fibonacci(n):"
    extra = {"ignore_eos": True, "mode": mode}
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=3, extra_body=extra)
    ids = local.tokenize(prompt)
    gen = local.generate(ids, 12, ignore_eos=True, mode=mode, cache=False).tokens
    rows = local.logits(ids + gen)[len(ids) - 1:len(ids) - 1 + len(gen)].astype(np.float64)
    ref = rows - rows.max(-1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(-1, keepdims=True))
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 12 and "".join(lp.tokens) == r.choices[0].text
    assert np.abs(np.array(lp.token_logprobs) - ref[np.arange(12), gen]).max() < 2e-3
    top_ids = np.argsort(-ref, axis=-1, kind="stable")[:, :3]
    for k in range(12):
        want = [ref[k, t] for t in top_ids[k]]
        assert np.allclose(sorted(lp.top_logprobs[k].values(), reverse=True), want, atol=2e-3)
    msgs = [{"role": "user", "content": "Write a stack class."}]
    cids = local.tokenize(local.chat_prompt(msgs))
    cgen = local.generate(cids, 10, ignore_eos=True, mode=mode, cache=False).tokens
    crows = local.logits(cids + cgen)[len(cids) - 1:len(cids) - 1 + len(cgen)].astype(np.float64)
    cref = crows - crows.max(-1, keepdims=True)
    cref -= np.log(np.exp(cref).sum(-1, keepdims=True))
    for stream in (False, True):
        kw = dict(model="tiny", messages=msgs, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2,
                  extra_body=extra)
        if stream:
            content = [e for ch in c.chat.completions.create(**kw, stream=True) if ch.choices and ch.choices[0].logprobs
                       for e in ch.choices[0].logprobs.content]
        else:
            content = c.chat.completions.create(**kw).choices[0].logprobs.content
        assert len(content) == 10
        got = np.array([e.logprob for e in content])
        assert np.abs(got - cref[np.arange(10), cgen]).max() < 2e-3, stream
        assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in content)
        assert all(e.bytes == list(e.token.encode()) for e in content)


def test_reasoning_content_and_chat_template_kwargs(daemon, local):
    """A thinking template's <think> block comes back as reasoning_content, the rest as content, whole and
    streamed (the deltas assemble to the same split); chat_template_kwargs reach the template
    (enable_thinking: false writes the empty block into the prompt); a constraint shapes the whole reply."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("llguidance")
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{daemon['port']}/v1", api_key="unused")
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    shaped = {"grammar": 'root ::= "adding two and two\\n</think>\\n\\n" [0-9]'}   # the prompt opened <think>
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=40, temperature=0, extra_body=shaped)
    m = r.choices[0].message
    assert m.reasoning_content == "adding two and two" and m.content.isdigit() and len(m.content) == 1
    chunks = list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=40, temperature=0, stream=True,
                                            extra_body=shaped))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == m.reasoning_content
    assert "".join(d.content or "" for d in deltas) == m.content
    # enable_thinking false: the template closes an empty block in the prompt (more prompt tokens); no reasoning
    on = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0)
    off = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0,
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    assert not getattr(off.choices[0].message, "reasoning_content", None)
    want = local.generate(local.chat_prompt(msgs, enable_thinking=False), 4, cache=False).text
    assert off.choices[0].message.content == want
    for bad in ({"messages": 1}, "x", {"a b": 1}):
        with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
            c.chat.completions.create(model="tiny", messages=msgs, max_tokens=4,
                                      extra_body={"chat_template_kwargs": bad})
