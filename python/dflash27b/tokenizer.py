"""Byte-level BPE tokenizer rebuilt from a qwen35 GGUF's `tokenizer.*` metadata.

Why: the engine reads only the GGUF, so prompts must be encoded from what the file carries (tokens, merges,
token types, special ids, chat template). Encoding uses the `tokenizers` library (Rust BPE) with the same
pipeline llama.cpp applies to `tokenizer.ggml.pre = qwen35`: specials split out by exact match, the qwen35
regex split ("isolated"), GPT-2 byte mapping, ranked merges. There is deliberately no NFC normaliser
(llama.cpp has none; HF's tokenizer.json does, so the two differ only on non-NFC input).

Metadata comes from the core's GGUF reader (`read_gguf_metadata`, the one the model loader validates with).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ._lib import DFlashError
from .gguf_meta import read_gguf_metadata  # noqa: F401  (re-exported: the tokenizer's source)
from .params import is_int

QWEN35_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5
EOG_NAMES = ("<|endoftext|>", "<|im_end|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# ----------------------------------------------------------------------------------------------------------
# ----------------------------------------------------------------------------------------------------------
# byte <-> unicode table of GPT-2 byte-level BPE

def byte_to_unicode() -> dict[int, str]:
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    table = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


_U2B = {u: b for b, u in byte_to_unicode().items()}


def _build_hf_tokenizer(tokens: list[str], merges: Iterable[str], types: list[int], regex: str):
    from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    pairs = []
    for m in merges:
        k = m.find(" ", 1)
        pairs.append((m[:k], m[k + 1:]))
    tok = HFTokenizer(BPE(vocab=vocab, merges=pairs, dropout=None, unk_token=None, fuse_unk=False,
                          byte_fallback=False, ignore_merges=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == TOKEN_CONTROL]
    user = [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types)
            if t == TOKEN_USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    return tok


class TokenizerError(DFlashError):
    """The GGUF's tokenizer metadata cannot be used: the message names the key."""


class ChatTemplateError(DFlashError):
    """The GGUF's chat template is not a Jinja template (the model still decodes raw prompts)."""


def check_tokenizer_metadata(meta: Mapping[str, Any]) -> None:
    """Each tokenizer key a Tokenizer reads, checked for its type, length and range (TokenizerError naming
    it): a file that breaks one would otherwise fail later with Python's own errors, or not at all."""
    def bad(key, why):
        raise TokenizerError(f"invalid tokenizer metadata: {key} {why}")
    model = meta.get("tokenizer.ggml.model", "gpt2")
    if model != "gpt2":
        bad("tokenizer.ggml.model", f"is {model!r}: only byte-level BPE ('gpt2') is supported")
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None:
        bad("tokenizer.ggml.tokens", "is missing")
    if not isinstance(tokens, (list, tuple)) or not tokens or not all(isinstance(t, str) for t in tokens):
        bad("tokenizer.ggml.tokens", "must be a non-empty list of strings")
    n = len(tokens)
    types = meta.get("tokenizer.ggml.token_type")
    if types is not None and (not isinstance(types, (list, tuple)) or len(types) != n
                              or not all(is_int(t) for t in types)):
        bad("tokenizer.ggml.token_type", f"must be a list of {n} integers, one per token")
    merges = meta.get("tokenizer.ggml.merges")
    if merges is not None and (not isinstance(merges, (list, tuple))
                               or not all(isinstance(m, str) and m.find(" ", 1) > 0 for m in merges)):
        bad("tokenizer.ggml.merges", "must be a list of strings 'LEFT RIGHT'")
    for key in ("eos_token_id", "bos_token_id", "padding_token_id"):
        v = meta.get(f"tokenizer.ggml.{key}")
        if v is not None and not (is_int(v) and 0 <= v < n):
            bad(f"tokenizer.ggml.{key}", f"must be a token id in 0..{n - 1} (got {v!r})")
    if not isinstance(meta.get("tokenizer.ggml.add_bos_token", False), bool):
        bad("tokenizer.ggml.add_bos_token", "must be true or false")
    if not isinstance(meta.get("tokenizer.ggml.pre", "qwen35"), str):
        bad("tokenizer.ggml.pre", "must be a string")
    template = meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        bad("tokenizer.chat_template", "must be a string")


class Tokenizer:
    """Encode/decode for a GGUF byte-level BPE vocab (`tokenizer.ggml.model == "gpt2"`)."""

    def __init__(self, meta: Mapping[str, Any]):
        check_tokenizer_metadata(meta)
        self.tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        n = len(self.tokens)
        types = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * n)
        self.token_types: list[int] = types
        self.pre = meta.get("tokenizer.ggml.pre", "qwen35")
        regex = QWEN2_REGEX if self.pre == "qwen2" else QWEN35_REGEX
        try:
            self._tok = _build_hf_tokenizer(self.tokens, meta.get("tokenizer.ggml.merges") or [], types, regex)
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises plain Exceptions
            why = "".join(ch if ch.isprintable() else "?" for ch in str(e))[:300]
            raise TokenizerError(f"invalid tokenizer metadata: the vocabulary and merges do not make a BPE "
                                 f"tokenizer ({why})") from None
        self.eos_id: int | None = meta.get("tokenizer.ggml.eos_token_id")
        self.bos_id: int | None = meta.get("tokenizer.ggml.bos_token_id")
        self.pad_id: int | None = meta.get("tokenizer.ggml.padding_token_id")
        self.add_bos: bool = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and self.bos_id is not None
        self.chat_template: str | None = meta.get("tokenizer.chat_template") or None
        self._special_ids = frozenset(i for i, t in enumerate(types) if t == TOKEN_CONTROL)
        eos = {self.eos_id} if self.eos_id is not None else set()
        by_name = {t: i for i, t in enumerate(self.tokens) if types[i] in (TOKEN_CONTROL, TOKEN_USER_DEFINED)}
        eos |= {by_name[s] for s in EOG_NAMES if s in by_name and types[by_name[s]] == TOKEN_CONTROL}
        self.eos_ids: frozenset[int] = frozenset(eos)
        self._added_ids = frozenset(by_name.values())
        self._bytes_cache: dict[int, bytes] = {}
        self._lock = threading.Lock()              # encode toggles a flag on the shared Rust tokenizer

    @classmethod
    def from_gguf(cls, path: str | Path) -> "Tokenizer":
        """The tokenizer a GGUF carries; TokenizerError naming the file and the key where it cannot be used."""
        meta = read_gguf_metadata(path)
        try:
            return cls(meta)
        except TokenizerError as e:
            raise TokenizerError(f"{path}: {e}") from None

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    # -- encode / decode ---------------------------------------------------------------------------------
    def encode(self, text: str, parse_special: bool = True, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`. With parse_special=False, control tokens written in the text are plain text."""
        with self._lock:
            self._tok.encode_special_tokens = not parse_special
            ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def token_bytes(self, tid: int) -> bytes:
        """Raw bytes of one token (added tokens are stored as text, others byte-mapped)."""
        b = self._bytes_cache.get(tid)
        if b is None:
            t = self.tokens[tid]
            if tid in self._added_ids or any(c not in _U2B for c in t):
                b = t.encode("utf-8")
            else:
                b = bytes(_U2B[c] for c in t)
            self._bytes_cache[tid] = b
        return b

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        ids = [int(i) for i in ids]
        if skip_special:
            ids = [i for i in ids if i not in self._special_ids]
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", "replace")

    def stream_decoder(self, skip_special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special)

    # -- chat template ---------------------------------------------------------------------------------
    # Names a template reads that are not the caller's variables: the render's own arguments and the
    # environment's functions (Jinja's defaults and ours).  A variable by one of these names would replace them.
    TEMPLATE_NAMES = frozenset({"messages", "add_generation_prompt", "tools", "raise_exception", "strftime_now",
                                "range", "dict", "lipsum", "cycler", "joiner", "namespace"})

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render `messages` with the file's Jinja template (ChatML if the file has none), like HF does."""
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg: str):
            raise jinja2.exceptions.TemplateError(msg)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        def strftime_now(fmt: str) -> str:
            import datetime
            return datetime.datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        try:
            tmpl = env.from_string(self.chat_template or CHATML_TEMPLATE)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"the GGUF's chat template (tokenizer.chat_template) is not valid Jinja: "
                                    f"{e.message} (line {e.lineno}); raw prompts still work") from None
        ctx = dict(bos_token=self._name(self.bos_id), eos_token=self._name(self.eos_id),
                   pad_token=self._name(self.pad_id))
        ctx.update(kwargs)
        return tmpl.render(messages=messages, add_generation_prompt=add_generation_prompt, **ctx)

    def _name(self, tid: int | None) -> str:
        return self.tokens[tid] if tid is not None and 0 <= tid < len(self.tokens) else ""


class StreamDecoder:
    """Incremental detokeniser: `push(id)` returns only newly completed text; incomplete UTF-8 is held back."""

    def __init__(self, tok: Tokenizer, skip_special: bool = False):
        self._tok = tok
        self._skip = skip_special
        self._pending = b""

    def push(self, token_id: int) -> str:
        if self._skip and token_id in self._tok._special_ids:
            return ""
        buf = self._pending + self._tok.token_bytes(int(token_id))
        cut = _complete_prefix_len(buf)
        self._pending = buf[cut:]
        return buf[:cut].decode("utf-8", "replace")

    def flush(self) -> str:
        out, self._pending = self._pending.decode("utf-8", "replace"), b""
        return out


def _complete_prefix_len(buf: bytes) -> int:
    """Length of `buf` without a trailing, still-incomplete UTF-8 sequence (at most 3 bytes held back)."""
    n = len(buf)
    for back in range(1, min(4, n) + 1):
        c = buf[n - back]
        if c & 0xC0 == 0x80:          # continuation byte: keep looking for the lead byte
            continue
        need = 2 if c & 0xE0 == 0xC0 else 3 if c & 0xF0 == 0xE0 else 4 if c & 0xF8 == 0xF0 else 1
        return n - back if need > back else n
    return n
