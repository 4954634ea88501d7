"""Structured output (python/dflash27b/constraint.py over csrc/spec/constraint.h): a reply constrained by a JSON
schema or a GBNF grammar is the constrained AR reply token for token in every mode (chain, DDTree, auto),
greedy and seeded, and every JSON reply parses and validates (jsonschema, an independent validator).  The
drafter is the bundled one, trained on Python: it drafts Python, the constraint forbids most of it, so draft
branches get pruned and the verify still has to pick among the allowed tokens only.  Also: pruning changes
no token, bad constraints are refused with one line naming the problem, and the decoder keeps serving."""
from __future__ import annotations

import json
import re

import pytest

from dflash27b import Decoder, DFlashError

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

MODES = [("chain", {}), ("ddtree", {"budget": 22}), ("auto", {})]
SAMPLING = [{}, {"temperature": 0.9, "seed": 11}]

OBJ = {"type": "object"}
SCHEMAS = {
    "any object": {},
    "flat": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
             "required": ["a", "b"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer"}, "name": {"type": "string", "maxLength": 10}}, "required": ["id", "name"],
        "additionalProperties": False}}, "required": ["user"], "additionalProperties": False},
    "array bounds": {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"},
                                                              "minItems": 2, "maxItems": 4}},
                     "required": ["xs"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
             "additionalProperties": False},
    "const": {"type": "object", "properties": {"v": {"const": 3}}, "required": ["v"], "additionalProperties": False},
    "anyOf": {"type": "object", "properties": {"x": {"anyOf": [{"type": "integer"}, {"type": "string",
                                                                                       "maxLength": 6}]}},
              "required": ["x"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}},
                "required": ["code"], "additionalProperties": False},
    "date format": {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}, "required": ["d"],
                    "additionalProperties": False},
    "number bounds": {"type": "object", "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1}},
                      "required": ["p"], "additionalProperties": False},
    "integer bounds": {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 5}},
                       "required": ["n"], "additionalProperties": False},
    "optional keys": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
                      "required": ["a"], "additionalProperties": False},
    "boolean and null": {"type": "object", "properties": {"ok": {"type": "boolean"}, "none": {"type": "null"}},
                         "required": ["ok", "none"], "additionalProperties": False},
    "array of objects": {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"k": {"type": "string", "maxLength": 4}, "v": {"type": "integer"}},
        "required": ["k", "v"], "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False},
    "top-level array": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    "string length": {"type": "object", "properties": {"s": {"type": "string", "minLength": 3, "maxLength": 5}},
                      "required": ["s"], "additionalProperties": False},
    "enum of numbers": {"type": "object", "properties": {"k": {"enum": [1, 2, 3.5]}}, "required": ["k"],
                        "additionalProperties": False},
    "defs and ref": {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                                      "required": ["x", "y"], "additionalProperties": False}},
                     "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
                     "required": ["a", "b"], "additionalProperties": False},
    "tool call": {"type": "object", "properties": {"name": {"enum": ["get_weather", "search"]}, "arguments": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {
            "type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False},
    "oneOf-ish union of objects": {"anyOf": [
        {"type": "object", "properties": {"kind": {"const": "a"}, "n": {"type": "integer"}}, "required": ["kind", "n"],
         "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "b"}, "s": {"type": "string", "maxLength": 5}},
         "required": ["kind", "s"], "additionalProperties": False}]},
}

GRAMMARS = {
    "yes/no": ('root ::= "yes" | "no"', r"(yes|no)"),
    "arithmetic": ('root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]+ | "(" expr ")"',
                   r"[0-9+\-()]+"),
    "python call": ('root ::= name "(" args? ")"\nname ::= [a-z_] [a-z_0-9]{0,7}\n'
                    'args ::= arg ("," " "? arg){0,2}\narg ::= [0-9]{1,3} | name', r"[a-z_][a-z_0-9]*\(.*\)"),
}

N_NEW = 48


@pytest.fixture(scope="module")
def dec():
    with Decoder(threads=2) as d:
        yield d


@pytest.fixture(scope="module")
def fixture_pair(tiny_f32_gguf):
    """The tests' tiny pair (tests/tiny_hf.py converted to F32, its distilled drafter): another vocabulary,
    another drafter."""
    from pathlib import Path
    distilled = Path(__file__).resolve().parent / "fixtures" / "tiny_draft_distilled"
    with Decoder(tiny_f32_gguf, distilled, threads=2, ctx=512) as d:
        yield d


def _schema_id(s):
    return s.replace(" ", "-")


@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "seeded"])
@pytest.mark.parametrize("name", sorted(SCHEMAS), ids=_schema_id)
def test_json_schema_every_mode_equals_constrained_ar(dec, name, sampling):
    schema = SCHEMAS[name]
    ar = dec.generate("def parse(text):\n", N_NEW, mode="ar", json_schema=schema, **sampling)
    if ar.stats.stop_reason == "eos":  # complete: it parses and validates
        jsonschema.validate(json.loads(ar.text), schema or OBJ)
    else:  # cut at max_new_tokens: still a prefix the grammar accepts
        assert ar.stats.generated_tokens == N_NEW
    for mode, kw in MODES:
        r = dec.generate("def parse(text):\n", N_NEW, mode=mode, json_schema=schema, **kw, **sampling)
        assert r.tokens == ar.tokens, (name, mode)


@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "seeded"])
def test_every_schema_on_the_fixture_pair(fixture_pair, sampling):
    """The same 20 schemas on the tiny fixture pair: replies validate, every mode == constrained AR."""
    d = fixture_pair
    for name, schema in sorted(SCHEMAS.items()):
        ar = d.generate("def parse(text):\n", N_NEW, mode="ar", json_schema=schema, **sampling)
        if ar.stats.stop_reason == "eos":
            jsonschema.validate(json.loads(ar.text), schema or OBJ)
        for mode, kw in MODES:
            r = d.generate("def parse(text):\n", N_NEW, mode=mode, json_schema=schema, **kw, **sampling)
            assert r.tokens == ar.tokens, (name, mode)
    for name, (gbnf, shape) in sorted(GRAMMARS.items()):
        ar = d.generate("x = ", N_NEW, mode="ar", grammar=gbnf, **sampling)
        if ar.stats.stop_reason == "eos":
            assert re.fullmatch(shape, ar.text), ar.text
        for mode, kw in MODES:
            assert d.generate("x = ", N_NEW, mode=mode, grammar=gbnf, **kw, **sampling).tokens == ar.tokens


@pytest.mark.parametrize("name", sorted(GRAMMARS))
def test_gbnf_every_mode_equals_constrained_ar(dec, name):
    gbnf, shape = GRAMMARS[name]
    for sampling in SAMPLING:
        ar = dec.generate("x = ", N_NEW, mode="ar", grammar=gbnf, **sampling)
        if ar.stats.stop_reason == "eos":
            assert re.fullmatch(shape, ar.text), ar.text
        for mode, kw in MODES:
            assert dec.generate("x = ", N_NEW, mode=mode, grammar=gbnf, **kw, **sampling).tokens == ar.tokens, mode


def test_pruning_changes_no_token_and_drops_forbidden_branches(dec):
    schema = SCHEMAS["tool call"]
    on = dec.generate("def f(x):\n", 64, mode="ddtree", json_schema=schema)
    off = dec.generate("def f(x):\n", 64, mode="ddtree", json_schema=schema, grammar_prune=False)
    assert on.tokens == off.tokens
    assert sum(on.stats.pruned) > 0 and sum(off.stats.pruned) == 0
    # what a pruned node would have cost: the unpruned tree verifies more nodes for the same tokens
    assert sum(on.stats.tree_size) < sum(off.stats.tree_size)
    assert len(on.stats.mask_ms) == on.stats.steps


def test_forced_tokens_are_drafted_first(dec):
    """What the schema forces (keys, punctuation) is drafted before the drafter's guesses and cannot miss: a
    drafter trained on Python accepts several tokens a step under a JSON schema, and auto verifies the forced
    tokens with its AR steps; the tokens stay constrained AR's."""
    schema = SCHEMAS["tool call"]
    ar = dec.generate("def f(x):\n", 64, mode="ar", json_schema=schema)
    for mode in ("chain", "ddtree", "auto"):
        r = dec.generate("def f(x):\n", 64, mode=mode, json_schema=schema)
        assert r.tokens == ar.tokens
        assert r.stats.mean_accept > 2.0, (mode, r.stats.mean_accept)


@pytest.mark.parametrize("kw, message", [
    ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
    ({"json_schema": 7}, "json_schema must be"),
    ({"json_schema": {"type": "object", "properties": {"a": {"type": "frobnicate"}}}}, "json_schema"),
    ({"grammar": "root ::= [a-"}, "grammar: Failed to convert the grammar from GBNF"),
    ({"grammar": 'rot ::= "a"'}, "No 'root' rule found"),
    ({"grammar": "root ::= undefined_rule"}, "grammar"),
    ({"grammar": "   "}, "grammar"),
    ({"json_schema": {}, "grammar": 'root ::= "a"'}, "give one constraint"),
    ({"json_schema": {"type": "string", "pattern": "(unclosed"}}, "json_schema: invalid regex /(unclosed/: unclosed group"),
    ({"grammar": "root ::= [z-a]"}, "the start must be <= the end"),
])
def test_bad_constraints_are_refused_by_name_and_the_decoder_goes_on(dec, kw, message):
    with pytest.raises(DFlashError, match=re.escape(message)) as e:
        dec.generate("x", 8, mode="chain", **kw)
    assert "\n" not in str(e.value).strip()
    assert dec.generate("x", 4, mode="chain", json_schema={"enum": [1, 2]}).text in ("1", "2")


def test_cli_takes_a_schema_file_or_a_grammar_and_refuses_bad_ones(dec, tmp_path):
    import subprocess
    import sys

    def run(*args):
        return subprocess.run([sys.executable, "-m", "dflash27b.cli", "generate", *args], capture_output=True,
                              text=True, timeout=120)
    schema = SCHEMAS["flat"]
    f = tmp_path / "schema.json"
    f.write_text(json.dumps(schema))
    r = run("def f(x):", "-n", "32", "--mode", "ddtree", "--json-schema", str(f), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["text"] == dec.generate("def f(x):", 32, mode="ar", json_schema=schema).text
    r = run("x = ", "-n", "8", "--grammar", 'root ::= "yes" | "no"')
    assert r.returncode == 0 and r.stdout.strip() in ("yes", "no"), r.stdout + r.stderr
    r = run("x", "-n", "4", "--json-schema", "{bad")
    assert r.returncode != 0 and "json_schema is not valid JSON" in r.stderr


def test_a_schema_applies_after_a_thinking_block_the_prompt_opened(dec):
    """Qwen3.5's generation prompt opens <think>: the schema shapes the answer after </think>, not the thinking
    (free text, which may hold '<' and '</thin'), and the reply cannot end before its answer; every mode still
    gives the constrained AR reply."""
    from dflash27b.constraint import TokenConstraint, compile_grammar
    schema = SCHEMAS["flat"]
    tok = dec.tokenizer
    g = compile_grammar(json_schema=schema, after_think=True)
    for text, complete in (('a < b </thin k</think>\n\n{"a": 2, "b": "x"}', True), ('{"a": 2, "b": "x"}', False)):
        c = TokenConstraint(tok, tok.eos_ids, g, tok.vocab_size)
        c.commit(tok.encode(text, parse_special=False))
        eos_allowed = any(int(c._mask()[e >> 5]) >> (e & 31) & 1 for e in tok.eos_ids)
        assert c.done() == complete and eos_allowed == complete, text
    prompt = dec.tokenize("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    ar = dec.generate(prompt, 40, mode="ar", json_schema=schema)
    assert "</think>" in ar.text or ar.stats.stop_reason == "length"
    for mode, kw in MODES:
        assert dec.generate(prompt, 40, mode=mode, json_schema=schema, **kw).tokens == ar.tokens


@pytest.mark.parametrize("kw, answer, wrapped", [
    ({"grammar": 'root ::= "yes" | "no"'}, "yes", True),
    ({"json_schema": {"enum": [1, 2]}}, "2", True),
    ({"grammar": 'root ::= "ok</think>\\n\\n" [0-9]'}, None, False),   # it writes </think> itself: the whole reply
])
def test_a_grammar_applies_after_the_thinking_block_unless_it_writes_one(dec, kw, answer, wrapped):
    """A GBNF grammar shapes the answer after a thinking block the prompt opened, as a schema does (it had
    shaped the thinking: the reply "yes" came back as reasoning_content with no content); a grammar that writes
    </think> itself shapes the whole reply."""
    from dflash27b.constraint import TokenConstraint
    from dflash27b.tool_calls import request_grammar
    from dflash27b.params import GenParams
    tok = dec.tokenizer
    g = request_grammar(GenParams(**kw), think_open=True)
    assert (g != request_grammar(GenParams(**kw), think_open=False)) == wrapped
    texts = [(f"some thought</think>\n\n{answer}", True), (answer, False)] if wrapped else [("ok</think>\n\n7", True)]
    for text, complete in texts:
        c = TokenConstraint(tok, tok.eos_ids, g, tok.vocab_size)
        ok = True
        try:
            c.commit(tok.encode(text, parse_special=False))
        except DFlashError:
            ok = False
        assert (ok and c.done()) == complete, text


def test_a_pattern_too_complex_to_follow_is_refused_in_one_line(dec):
    """(a{1000}){1000}: llguidance's lexer would spend about a second of the shared decode step building its
    automaton, then print its state and the whole grammar.  Under the fuel the server gives it, the request is
    refused saying why, in one line, and the decoder goes on."""
    schema = {"type": "string", "pattern": "^(a{1000}){1000}$"}
    with pytest.raises(DFlashError, match="too complex to follow") as e:
        dec.generate("x", 8, mode="ar", json_schema=schema)
    msg = str(e.value)
    assert "\n" not in msg and "<state>" not in msg and "<grammar>" not in msg and len(msg) < 300, msg
    assert dec.generate("x", 4, mode="chain", json_schema={"enum": [1, 2]}).text in ("1", "2")
