"""Structured output: a JSON schema, a GBNF / Lark grammar or a regex, compiled by llguidance over the model's
vocabulary, constraining every decode mode exactly (the core's side: csrc/spec/constraint.h).

Why llguidance (over xgrammar): it takes the model's own byte-level vocabulary as a plain token list (no HF
tokenizer object needed: ours comes from the GGUF), compiles JSON schemas, Lark and GBNF grammars and
regexes, rolls a matcher back by any number of tokens (a draft tree is walked depth first with consume /
rollback, no re-parse), and its wheel is one abi3 library with no Python dependencies (~10 MB).

The core asks, once a step before the target verifies, for the allowed next tokens of every node of the
draft (node 0 = the last decided token); `masks` walks the tree with the one matcher, consuming a node's
path and rolling back, and leaves zeros under a node its parent forbids.  `commit` follows the decided tokens.
Grammars are compiled once per (kind, text) and cached; a matcher is cheap to make from the compiled form.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from ._lib import DFlashError


class ConstraintError(DFlashError):
    """A schema or grammar that cannot be compiled or is not supported: the message names the problem."""


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # an optional extra: the core runs without it
        raise ConstraintError("structured output needs the llguidance package: pip install 'dflash27b[grammar]'") from e
    return llguidance


class _Vocab:
    """What llguidance.TokenizerWrapper reads: the token byte strings, EOS, special ids, and an encoder."""

    def __init__(self, tok, eos_ids):
        self.tokens = [tok.token_bytes(i) for i in range(tok.vocab_size)]
        self.eos_token_id = min(eos_ids) if eos_ids else (tok.eos_id if tok.eos_id is not None else 0)
        self.bos_token_id = tok.bos_id
        self.special_token_ids = sorted(tok._special_ids)
        self._tok = tok

    def __call__(self, s):
        if isinstance(s, bytes):
            s = s.decode("utf-8", errors="replace")
        return self._tok.encode(s, parse_special=False, add_bos=False)


# The JSON a schema admits is laid out as json.dumps writes it ("a": 1, "b": 2): no free whitespace, which a
# model can otherwise spend its whole budget on (JSON allows any run of it between tokens).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_TOKENIZERS: dict[int, Any] = {}
_GRAMMARS: "OrderedDict[tuple, str]" = OrderedDict()
_LOCK = threading.Lock()


def ll_tokenizer(tok, eos_ids):
    """The llguidance tokenizer of a dflash27b Tokenizer (made once per tokenizer)."""
    llg = _llguidance()
    with _LOCK:
        t = _TOKENIZERS.get(id(tok))
        if t is None:
            t = llg.LLTokenizer(llg.TokenizerWrapper(_Vocab(tok, eos_ids)), n_vocab=tok.vocab_size,
                                eos_token=sorted(eos_ids) or None)
            _TOKENIZERS[id(tok)] = t
        return t


def _summary(msg: str, default: str) -> str:
    """llguidance's message as one line: its first line, or for a regex its pattern and the reason (the regex
    crate draws a caret under the pattern on lines of their own); never the parser state or the grammar."""
    msg = re.split(r"<state>|<non-verbose/>|<grammar>", msg)[0].strip()
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
    if not lines:
        return default
    if "regex parse error:" in lines[0] and len(lines) >= 2:
        why = next((ln[len("error:"):].strip() for ln in lines if ln.startswith("error:")), "")
        head = lines[0][: lines[0].index("regex parse error:")].rstrip(" :")
        if "invalid regex" not in head:   # (a grammar's message names the regex itself)
            head = (f"{head}: " if head else "") + f"invalid regex /{lines[1]}/"
        return head + (f": {why}" if why else "")
    return lines[0][:400]


# Bounds on what one request's grammar may cost while the slots wait: llguidance's lexer builds its states
# lazily, at the masks, inside the shared decode step.  Its default fuel let a pattern such as (a{1000}){1000}
# spend about a second on one mask (measured, 248K-token vocabulary); at this fuel that mask takes about
# 50 ms and the pattern is refused as too complex.  verbose_errors off: a refusal names the problem, without
# the parser's state or the whole grammar.
INITIAL_LEXER_FUEL = 100_000


def limits():
    llg = _llguidance()
    return llg.LLParserLimits(initial_lexer_fuel=INITIAL_LEXER_FUEL, verbose_errors=False)


def _after_think(grammar: str) -> str:
    """`grammar` as the answer after a thinking block the prompt opened: free text up to the first </think>,
    the blank line, then the grammar (nested: llguidance's @name reference to it)."""
    inner = json.loads(grammar)["grammars"] if grammar.lstrip().startswith("{") else [{"lark_grammar": grammar}]
    inner = [{**inner[0], "name": "answer_grammar"}, *inner[1:]]
    top = ('%llguidance {}\nstart: think "\\n\\n" answer\n'
           'think[suffix="</think>"]: /(?s:.*)/\nanswer: @answer_grammar\n')
    return json.dumps({"grammars": [{"lark_grammar": top}, *inner]})


def compile_grammar(json_schema: Any = None, grammar: str | None = None, lark: str | None = None,
                    regex: str | None = None, after_think: bool = False) -> str:
    """The llguidance grammar for exactly one of: a JSON schema (dict or JSON text; True / {} / "json_object" =
    any JSON object), a GBNF grammar, a Lark grammar, a regex.  Cached per input; errors name the problem.
    after_think: the reply starts inside a thinking block the prompt opened (Qwen3.5's generation prompt ends
    with <think>): free text up to the first </think>, then the blank line, then what the constraint admits."""
    given = [k for k, v in (("json_schema", json_schema), ("grammar", grammar), ("lark", lark), ("regex", regex))
             if v is not None]
    if len(given) != 1:
        raise ConstraintError(f"give one constraint (json_schema, grammar, lark or regex), got {given or 'none'}")
    kind = given[0]
    if kind == "json_schema":
        schema = json_schema
        if isinstance(schema, str) and schema.strip() != "json_object":
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ConstraintError(f"json_schema is not valid JSON: {e}") from None
        if schema is True or schema == "json_object" or schema == {}:
            schema = {"type": "object"}
        if not isinstance(schema, dict):
            raise ConstraintError(f"json_schema must be a JSON object (a schema), got {type(schema).__name__}")
        text = json.dumps(schema, sort_keys=True)
    else:
        text = locals()[kind]
        if not isinstance(text, str) or not text.strip():
            raise ConstraintError(f"{kind} must be a non-empty string")
    key = (kind, text, after_think)
    with _LOCK:
        if key in _GRAMMARS:
            _GRAMMARS.move_to_end(key)
            return _GRAMMARS[key]
    llg = _llguidance()
    try:
        if kind == "json_schema":
            g = llg.LLMatcher.grammar_from_json_schema(text, defaults=JSON_LAYOUT)
        elif kind == "grammar":
            g = llg.grammar_from("gbnf", text)
        elif kind == "lark":
            g = llg.LLMatcher.grammar_from_lark(text)
        else:
            g = llg.LLMatcher.grammar_from_regex(text)
        if after_think:
            g = _after_think(g)
    except Exception as e:  # noqa: BLE001 - llguidance raises ValueError / RuntimeError with the reason
        raise ConstraintError(f"{kind}: {_summary(str(e), type(e).__name__)}") from None
    is_error, msgs = llg.LLMatcher.validate_grammar_with_warnings(g, limits=limits())
    if is_error:
        raise ConstraintError(f"{kind}: {_summary(msgs[0] if msgs else '', 'invalid')}")
    with _LOCK:
        _GRAMMARS[key] = g
        while len(_GRAMMARS) > 64:
            _GRAMMARS.popitem(last=False)
    return g


class TokenConstraint:
    """One request's matcher, with the two callbacks the core calls (dfl_context_set_constraint)."""

    def __init__(self, tok, eos_ids, grammar: str, n_vocab: int):
        llg = _llguidance()
        self.matcher = llg.LLMatcher(ll_tokenizer(tok, eos_ids), grammar, log_level=0, limits=limits())
        if self.matcher.is_error():
            raise ConstraintError(_summary(self.matcher.get_error(), "the grammar cannot be used"))
        self.words = (n_vocab + 31) // 32
        self.eos_ids = sorted(eos_ids)
        self._eos = frozenset(self.eos_ids)
        self.error: BaseException | None = None
        self.mask_calls = 0

    def _refusal(self, what: str) -> ConstraintError:
        """The error for a token the matcher would not take: a grammar past the lexer's limits (the usual
        cause: a pattern whose automaton explodes) is the request's problem, and says so."""
        why = _summary(self.matcher.get_error(), "matcher error")
        if "too many" in why or "fuel" in why or "limit" in why:
            return ConstraintError(f"the constraint is too complex to follow ({why}): simplify its patterns")
        return ConstraintError(f"{what} ({why})")

    def _mask(self) -> np.ndarray:
        m = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint32)
        if m.size < self.words:
            m = np.concatenate([m, np.zeros(self.words - m.size, np.uint32)])
        m = m[: self.words]
        if not self.matcher.is_accepting() and not self.matcher.is_stopped():
            # an end of generation only where the grammar is complete (a lazy rule such as the thinking
            # block's would otherwise let the reply end before its answer)
            m = m.copy()
            for e in self.eos_ids:
                if e >> 5 < m.size:
                    m[e >> 5] &= ~np.uint32(1 << (e & 31))
        return m

    def masks(self, n: int, tokens, parents, out: np.ndarray, keep: int | None = None) -> None:
        """out [n, words]: node 0's mask is the matcher's now; node i's after consuming its path.  keep: the
        caller keeps the first `keep` allowed nodes (their parents allowed too) and reads no mask after them, so
        the walk stops there: a pruned tree is drafted past its cap, and each mask costs a matcher walk."""
        self.mask_calls += 1
        out[0] = self._mask()
        depth = [0] * n
        path: list[int] = []  # nodes consumed beyond node 0, root first
        alive = [True] + [False] * (n - 1)
        kept = 0
        for i in range(1, n):
            if keep is not None and kept >= keep:
                break
            p = int(parents[i])
            t = int(tokens[i])
            if not alive[p] or not (out[p, t >> 5] >> np.uint32(t & 31)) & np.uint32(1):
                out[i] = 0   # forbidden: nothing below it either
                continue
            if t in self._eos:
                # an allowed end of generation: a leaf (the reply ends there).  Not consumed: a matcher that
                # stopped on it does not roll it back like other tokens
                out[i] = 0
                alive[i] = True
                depth[i] = depth[p] + 1
                kept += 1
                continue
            # back up to the parent, then consume this node's token
            d = depth[p]
            while len(path) > d:
                path.pop()
                self.matcher.rollback(1)
            if d and path[-1] != p:  # the parent is off the current path: rebuild it from node 0
                self.matcher.rollback(len(path))
                chain = []
                q = p
                while q:
                    chain.append(q)
                    q = int(parents[q])
                path = []
                for q in reversed(chain):
                    if not self.matcher.consume_token(int(tokens[q])):
                        raise self._refusal(f"matcher refused token {int(tokens[q])} on a path it allowed")
                    path.append(q)
            if not self.matcher.consume_token(t):
                raise self._refusal(f"matcher refused token {t} its mask allowed")
            path.append(i)
            depth[i] = d + 1
            alive[i] = True
            kept += 1
            out[i] = self._mask()
        if path:
            self.matcher.rollback(len(path))

    def commit(self, tokens) -> None:
        for t in tokens:
            if not self.matcher.consume_token(int(t)):
                raise self._refusal(f"the decided token {int(t)} breaks the constraint")

    def forced(self, cap: int) -> list[int]:
        """The tokens the grammar forces next (each the only one allowed there), at most cap."""
        return [int(t) for t in self.matcher.compute_ff_tokens()[:cap]]

    def done(self) -> bool:
        """The reply is complete under the grammar (only an end of generation may follow)."""
        return self.matcher.is_stopped() or self.matcher.is_accepting()
