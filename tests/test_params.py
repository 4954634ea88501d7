"""GenParams (python/dflash27b/params.py): one typed, validated set of generation settings for the CLI, Decoder,
the daemon and the HTTP front; every dfl_gen_params member is filled from it (or resolved by the Decoder)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from dflash27b._lib import DFlashError, load
from dflash27b.params import GenParams, SettingError

ROOT = Path(__file__).resolve().parent.parent
RESOLVED_BY_DECODER = {"mode", "block_size", "n_eos", "eos_ids"}  # from the drafter and the tokenizer
# GenParams.logit_bias, as two arrays the context handle fills (Context.begin)
ARRAYS = {"n_logit_bias", "logit_bias_ids", "logit_bias_values"}


def _c_members() -> set[str]:
    h = (ROOT / "include" / "dflash27b.h").read_text()
    end = h.index("} dfl_gen_params;")
    body = h[h.rindex("typedef struct {", 0, end) + len("typedef struct {"):end]
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    return {m for decl in body.split(";") if decl.strip() for m in re.findall(r"\**(\w+)\s*$", decl.strip())}


def test_every_c_member_comes_from_genparams():
    from_params = set(GenParams().with_(seed=1).c_fields())
    assert from_params | RESOLVED_BY_DECODER | ARRAYS == _c_members()
    ffi, lib = load()
    gp = ffi.new("dfl_gen_params*", lib.dfl_gen_default_params())
    for member, value in GenParams(seed=7, logprobs=3, temperature=0.5).c_fields().items():
        setattr(gp, member, value)  # every value fits its C type
    assert gp.seed == 7 and gp.n_logprobs == 3 and gp.tree_budget == 22


def test_defaults_match_the_core():
    ffi, lib = load()
    d = lib.dfl_gen_default_params()
    for member, value in GenParams(seed=d.seed).c_fields().items():
        assert getattr(d, member) == pytest.approx(value), member


def test_from_mapping_strict_aliases_and_errors():
    p = GenParams.from_mapping({"max_new_tokens": 5, "temperature": 1, "budget": 8})
    assert (p.max_new_tokens, p.temperature, p.budget) == (5, 1.0, 8) and isinstance(p.temperature, float)
    with pytest.warns(DeprecationWarning, match="'topk' is deprecated: use 'tree_topk'"):
        assert GenParams.from_mapping({"topk": 3}).tree_topk == 3
    with pytest.raises(DFlashError, match="unknown generation setting 'bogus'"):
        GenParams.from_mapping({"bogus": 1})
    assert GenParams.from_mapping({"bogus": 1, "top_k": 2}, strict=False).top_k == 2
    with pytest.raises(DFlashError, match="given twice"), pytest.warns(DeprecationWarning):
        GenParams.from_mapping({"topk": 1, "tree_topk": 2})
    cases = {"max_new_tokens": -1, "temperature": float("nan"), "top_p": 0, "min_p": 2, "top_k": 1.5,
             "chain_seed": 1, "ignore_eos": "yes", "mode": "beam", "logprobs": 21, "seed": -3, "repeat_penalty": 0,
             "repeat_last_n": -2, "block_size": 0, "budget": True}
    for name, bad in cases.items():
        with pytest.raises(SettingError) as e:
            GenParams.from_mapping({name: bad})
        assert e.value.name == name and str(e.value).startswith(f"{name} must be"), str(e.value)


def test_with_and_to_mapping_round_trip():
    p = GenParams(temperature=0.7, seed=3).with_(mode="ddtree", budget=16)
    assert GenParams.from_mapping(p.to_mapping()) == p
    assert p.to_mapping(only_changed=True) == {"mode": "ddtree", "budget": 16, "temperature": 0.7, "seed": 3}


# -- a setting added through GenParams alone on the Python side: typical_p (llama.cpp's typ_p) ----------------

@pytest.fixture(scope="module")
def pair():
    from dflash27b import Decoder
    with Decoder(threads=2) as d:  # the bundled tiny pair
        yield d


def test_typical_p_keeps_the_tokens_nearest_the_entropy(pair):
    """With typical_p tiny only the token whose surprise is closest to the entropy survives, so sampling
    is deterministic: each AR token is that token of the model's own distribution (numpy on its logits)."""
    r = pair.generate("def fibonacci(n):", 12, mode="ar", temperature=1.0, typical_p=1e-6, seed=5, ignore_eos=True)
    ids = list(r.prompt_tokens) + r.tokens
    lg = pair.logits(ids[:-1]).astype(np.float64)[len(r.prompt_tokens) - 1:]
    logp = lg - lg.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    ent = -(np.exp(logp) * logp).sum(-1, keepdims=True)
    want = np.argmin(np.abs(-logp - ent), axis=-1)
    assert r.tokens == want.tolist()
    assert r.tokens != pair.generate("def fibonacci(n):", 12, mode="ar", temperature=1.0, seed=5,
                                     ignore_eos=True).tokens  # it changed something


def test_typical_p_speculative_equals_ar_and_reaches_every_front(pair):
    kw = dict(temperature=0.8, typical_p=0.6, seed=11, ignore_eos=True)
    ar = pair.generate("def f(x):", 24, mode="ar", **kw).tokens
    assert pair.generate("def f(x):", 24, mode="ddtree", budget=8, **kw).tokens == ar
    assert pair.generate("def f(x):", 24, mode="chain", **kw).tokens == ar
    from dflash27b.http_api import to_engine
    from dflash27b.serve_protocol import RequestError, parse_generate
    assert parse_generate({"prompt": "x", "typical_p": 0.5})["params"].typical_p == 0.5
    (req,), _ = to_engine({"prompt": "x", "typical_p": 0.5, "max_tokens": 3}, chat=False)
    assert req["params"].typical_p == 0.5 and req["params"].max_new_tokens == 3
    with pytest.raises(RequestError, match="'typical_p' must be a number in \\(0, 1\\]"):
        parse_generate({"prompt": "x", "typical_p": 0})
