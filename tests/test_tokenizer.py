"""dflash27b.tokenizer against the HF `tokenizers` pipeline of the tiny checkpoint's tokenizer.json.

The GGUF here is vocab-only (tokenizer keys written by the converter's tokenizer reader), so no model or
torch is needed. Inputs are NFC (the HF file has an NFC normaliser, the GGUF pipeline deliberately none).
"""

from __future__ import annotations

import time

import pytest
import tokenizers

from dflash27b.tokenizer import StreamDecoder, Tokenizer, read_gguf_metadata
from dflash27b.tools.convert import read_tokenizer
from dflash27b.tools.layout import add_tokenizer_kv, write_gguf
from dflash27b.tools.synth import synth_tokenizer
from tiny_hf import CHAT_TEMPLATE, write_tokenizer_files

TEXTS = [
    "Hello world",
    "Hello  world!\n\n\tdef f(x):  return x**2  # comment",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n\n",
    "I'm sure they'll say WE'VE done it, DON'T they? It's 'quoted'.",
    "numbers 1234567890 3.14159 1e-6 0x7fff -42",
    "ünïcödé façade naïve Ωmega Ελληνικά русский текст",
    "日本語のテキストと中文字符，한국어 문장입니다。",
    "emoji 🤖🚀👍🏽 and flags 🇫🇷 and zwj 👩‍💻",
    "   leading spaces and trailing spaces   ",
    "tabs\t\tand\r\nCRLF\r\n\r\nlines\n \n  \n",
    "mixed<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|endoftext|>text after",
    "symbols ~!@#$%^&*()_+{}|:\"<>?`-=[]\\;',./ …—–«»",
    "",
    " ",
    "\n",
    "a",
    "x" * 300,
    "ॐ नमः शिवाय हिन्दी देवनागरी",
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(d, 2048)
    meta = read_tokenizer(d, 2048)
    path = d / "vocab.gguf"
    write_gguf(path, lambda w: add_tokenizer_kv(w, meta), [])
    return d, path


@pytest.fixture(scope="module")
def tok(files):
    return Tokenizer.from_gguf(files[1])


@pytest.fixture(scope="module")
def hf(files):
    return tokenizers.Tokenizer.from_file(str(files[0] / "tokenizer.json"))


def test_metadata(tok):
    assert tok.vocab_size == 2048
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.eos_id == tok.token_to_id("<|im_end|>")
    assert tok.eos_ids == {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")}
    assert tok.pad_id == tok.token_to_id("<|endoftext|>")
    assert not tok.add_bos


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_hf(tok, hf, text):
    assert tok.encode(text) == hf.encode(text, add_special_tokens=False).ids


def test_parse_special_off(tok, hf):
    text = "a<|im_end|>b"
    on, off = tok.encode(text), tok.encode(text, parse_special=False)
    assert tok.token_to_id("<|im_end|>") in on
    assert tok.token_to_id("<|im_end|>") not in off
    hf.encode_special_tokens = True
    try:
        assert off == hf.encode(text, add_special_tokens=False).ids
    finally:
        hf.encode_special_tokens = False
    assert tok.encode(text) == on                                 # the flag does not stick


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip(tok, hf, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=False)


def test_decode_skip_special(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(ids, skip_special=True) == "user\nhi"


@pytest.mark.parametrize("text", [t for t in TEXTS if any(ord(c) > 127 for c in t)])
def test_stream_decoder(tok, text):
    ids = tok.encode(text)
    sd = StreamDecoder(tok)
    pieces = [sd.push(i) for i in ids]
    assert "".join(pieces) + sd.flush() == text
    assert all("\ufffd" not in p for p in pieces)


def test_stream_decoder_split_char(tok):
    ch = "🤖".encode("utf-8")
    byte_ids = [tok.token_to_id(_b2u(b)) for b in ch]
    sd = tok.stream_decoder()
    assert [sd.push(i) for i in byte_ids] == ["", "", "", "🤖"]
    sd.push(byte_ids[0])
    assert sd.flush() == "\ufffd"                                  # incomplete tail is surfaced on flush


def _b2u(b: int) -> str:
    from dflash27b.tokenizer import byte_to_unicode
    return byte_to_unicode()[b]


def test_user_defined_token(files):
    meta = dict(read_gguf_metadata(files[1]))
    meta["tokenizer.ggml.tokens"] = list(meta["tokenizer.ggml.tokens"]) + ["<think>"]
    meta["tokenizer.ggml.token_type"] = list(meta["tokenizer.ggml.token_type"]) + [4]
    t = Tokenizer(meta)
    tid = t.token_to_id("<think>")
    assert tid == 2048
    assert tid in t.encode("a<think>b", parse_special=False)       # user-defined tokens always match
    assert t.decode(t.encode("a<think>b")) == "a<think>b"
    assert tid not in t.eos_ids


def test_chat_template(tok):
    """The models made here carry Qwen3.5's chat conventions (tools/hf_files.py): the generation prompt opens a
    thinking block, tools are listed as JSON in a system block, tool calls are written in Qwen's XML form."""
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo 世界"}]
    s = tok.apply_chat_template(msgs)
    assert s == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhéllo 世界<|im_end|>\n"
                 "<|im_start|>assistant\n<think>\n")
    tools = [{"type": "function", "function": {"name": "f", "description": "ü"}}]
    s2 = tok.apply_chat_template(msgs, add_generation_prompt=True, enable_thinking=False, tools=tools)
    assert s2.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
                         '{"type": "function", "function": {"name": "f", "description": "ü"}}\n</tools>')
    assert "\n\nbe brief<|im_end|>\n" in s2
    assert s2.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    with pytest.raises(Exception, match="unknown role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])
    ids = tok.encode(s)
    assert ids[0] == tok.token_to_id("<|im_start|>") and ids[-1] != tok.token_to_id("<|im_end|>")


def test_chat_template_matches_transformers(files, tok):
    transformers = pytest.importorskip("transformers")
    hft = transformers.AutoTokenizer.from_pretrained(str(files[0]))
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "more ü"}]
    calls = [{"role": "assistant", "content": "checking", "reasoning_content": "need it", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "t", "arguments": {"a": "x y", "n": [1, 2]}}},
        {"id": "2", "type": "function", "function": {"name": "t", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "1", "content": "r1"}, {"role": "tool", "tool_call_id": "2", "content": "r2"}]
    tools = [{"type": "function", "function": {"name": "t", "parameters": {"type": "object", "x": [1, 2]}}}]
    for m, kw in ((msgs, {}), (msgs, {"enable_thinking": False}), (msgs, {"tools": tools}),
                  (msgs + calls, {"tools": tools}), (msgs + calls, {"tools": tools, "enable_thinking": False})):
        ref = hft.apply_chat_template(m, tokenize=False, add_generation_prompt=True, **kw)
        assert tok.apply_chat_template(m, add_generation_prompt=True, **kw) == ref


def test_chatml_fallback(files):
    meta = dict(read_gguf_metadata(files[1]))
    del meta["tokenizer.chat_template"]
    t = Tokenizer(meta)
    assert t.chat_template is None
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == \
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    assert t.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False) == \
        "<|im_start|>user\nx<|im_end|>\n"


def test_qwen2_pre_variant(files):
    meta = dict(read_gguf_metadata(files[1]))
    meta["tokenizer.ggml.pre"] = "qwen2"
    t = Tokenizer(meta)
    assert t.decode(t.encode("naïve café")) == "naïve café"


def test_large_vocab_loads_fast(tmp_path):
    meta = synth_tokenizer(248320)
    path = tmp_path / "big.gguf"
    write_gguf(path, lambda w: add_tokenizer_kv(w, meta), [])
    t0 = time.perf_counter()
    t = Tokenizer.from_gguf(path)
    dt = time.perf_counter() - t0
    assert t.vocab_size == 248320
    assert t.encode("hello world") and t.decode(t.encode("hello world")) == "hello world"
    assert dt < 3.0, f"loading a 248K vocab took {dt:.2f}s"
