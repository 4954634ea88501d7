"""GenParams (python/dflash27b/params.py): one typed, validated set of generation settings for the CLI, Decoder,
the daemon and the HTTP front; every dfl_gen_params member is filled from it (or resolved by the Decoder)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from dflash27b._lib import DFlashError, load
from dflash27b.params import GenParams, SettingError

ROOT = Path(__file__).resolve().parent.parent
RESOLVED_BY_DECODER = {"mode", "block_size", "n_eos", "eos_ids"}  # from the drafter and the tokenizer


def _c_members() -> set[str]:
    h = (ROOT / "include" / "dflash27b.h").read_text()
    end = h.index("} dfl_gen_params;")
    body = h[h.rindex("typedef struct {", 0, end) + len("typedef struct {"):end]
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    return {m for decl in body.split(";") if decl.strip() for m in re.findall(r"\**(\w+)\s*$", decl.strip())}


def test_every_c_member_comes_from_genparams():
    from_params = set(GenParams().with_(seed=1).c_fields())
    assert from_params | RESOLVED_BY_DECODER == _c_members()
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
