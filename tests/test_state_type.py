"""--state-type f32|bf16|f16: the delta-net recurrent state stored reduced, exact on its own terms.

The state is computed in f32 and rounded to its type after every token, alone or in a batch, in an AR step,
a prefill chunk or a tree verify, and commit's replay rounds after every node the same way; so with any
state type a token's result does not depend on the batch: speculative == AR, chunked prefill == token by
token, commit == a chain's state, all with `==`.  What changes is the model's own numbers, slightly
(bench/state_type.py measures greedy agreement and KL against F32).
"""
from __future__ import annotations

import numpy as np
import pytest
from spec_steps import commit_and_chain_states

from dflash27b import Decoder, DFlashError, _handles
from dflash27b._lib import TYPE_IDS, last_error, load

REDUCED = ["bf16", "f16"]


@pytest.fixture(scope="module", params=REDUCED)
def dec(request, pair):
    with Decoder(pair[0], pair[1], device="cpu", threads=2, ctx=1024, state_type=request.param) as d:
        yield d


def test_speculative_equals_ar(dec):
    ids = dec.tokenize("import os\n\n\ndef walk(path):\n    for root, dirs, files in os.walk(")
    ar = dec.generate(ids, 64, ignore_eos=True, mode="ar").tokens
    for mode, kw in (("chain", {}), ("ddtree", {"budget": 22}), ("ddtree", {"budget": 5}), ("auto", {})):
        r = dec.generate(ids, 64, ignore_eos=True, mode=mode, **kw)
        assert r.tokens == ar, (dec.state_type, mode, kw)
    sampled = dict(ignore_eos=True, temperature=0.9, seed=11)
    assert dec.generate(ids, 48, mode="ddtree", **sampled).tokens == dec.generate(ids, 48, mode="ar", **sampled).tokens


def test_chunked_prefill_equals_token_by_token(dec):
    ctx = dec.context
    ids = dec.tokenize("def fibonacci(n):\n    if n < 2:\n        return n\n")
    ctx.reset()
    whole, _ = ctx.forward(ids, logit_rows=list(range(len(ids))))
    s_whole = ctx.state()
    ctx.reset()
    rows = []
    for i in range(0, len(ids), 3):
        out, _ = ctx.forward(ids[i:i + 3], logit_rows=list(range(len(ids[i:i + 3]))))
        rows.append(out)
    assert np.array_equal(np.concatenate(rows), whole) and ctx.state() == s_whole


@pytest.mark.parametrize("path", [[0], [0, 2, 3], [0, 2, 3, 5, 6], [0, 1, 4, 7]])
def test_commit_rebuilds_the_sequential_state_bitwise(dec, path):
    got, chain = commit_and_chain_states(dec.context, path)
    assert got == chain


def test_reduced_state_is_half_the_bytes_and_moves_the_model_slightly(pair):
    sizes, logits = {}, {}
    for st in ("f32", "bf16", "f16"):
        with Decoder(pair[0], device="cpu", threads=2, ctx=256, state_type=st) as d:
            ids = d.tokenize("class Stack:\n    def __init__(self):\n        self.items = []\n")
            logits[st] = d.logits(ids)
            d.context.reset()
            d.context.forward(ids)
            sizes[st] = len(d.context.state())
            assert d.memory_plan["recurrent"] > 0
    m = _handles.Model(str(pair[0]))
    try:
        info = m.info
    finally:
        m.close()
    n_gdn = sum(1 for i in range(info["n_layer"]) if (i + 1) % 4)  # every 4th layer is attention
    rec = n_gdn * info["ssm_nv"] * info["ssm_dk"] * info["ssm_dv"]
    assert sizes["f32"] - sizes["bf16"] == 2 * rec and sizes["bf16"] == sizes["f16"]
    for st in REDUCED:
        diff = np.abs(logits[st] - logits["f32"]).max()
        assert 0 < diff < 0.05 * np.abs(logits["f32"]).max(), (st, diff)


def test_bad_state_types_are_refused(pair):
    with pytest.raises(DFlashError, match="unknown state_type 'q8_0'"):
        Decoder(pair[0], device="cpu", state_type="q8_0")
    ffi, lib = load()
    m = _handles.Model(str(pair[0]))
    try:
        with pytest.raises(DFlashError, match="unsupported recurrent state type Q8_0"):
            _handles.Context(m, 64, 8, 1, TYPE_IDS["f16"], 0, TYPE_IDS["q8_0"])
        out = ffi.new("dfl_memory_plan*")
        p = _handles.context_params(lib, ffi, 64, 8, 1, TYPE_IDS["f16"], 0, 2)
        assert lib.dfl_context_memory_plan(m.handle, p, 4, out) == -1
        assert "recurrent state type" in last_error()
    finally:
        m.close()
