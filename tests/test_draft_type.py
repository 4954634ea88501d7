"""--draft-type: the drafter's matrices converted at load (BF16 or Q8_0), for memory.

The drafter only proposes, so whatever its weight type the output is the target's own (== AR); what moves
is its memory (Q8_0: 34 bytes per 32 values instead of 64) and, slightly, its acceptance.  The memory plan
predicts the converted size from the config before anything is loaded.
"""
from __future__ import annotations

import numpy as np
import pytest

from dflash27b import Decoder, DFlashError, _handles
from dflash27b.memory_plan import drafter_weight_bytes
from dflash27b._lib import last_error, load


@pytest.mark.parametrize("draft_type", ["q8_0", "bf16"])
def test_converted_drafter_is_lossless_and_planned(pair, draft_type):
    t, d = pair
    m = _handles.Model(str(t))
    try:
        stored = _handles.Draft(str(d), m).info
        conv = _handles.Draft(str(d), m, draft_type).info
    finally:
        m.close()
    assert conv["weight_bytes"] == drafter_weight_bytes(stored, draft_type)
    if draft_type == "q8_0":
        assert conv["weight_bytes"] < 0.55 * stored["weight_bytes"]
    with Decoder(t, d, device="cpu", threads=2, draft_type=draft_type) as dec:
        ids = dec.tokenize("def fibonacci(n):\n")
        ar = dec.generate(ids, 48, ignore_eos=True, mode="ar").tokens
        for mode in ("chain", "ddtree"):
            r = dec.generate(ids, 48, ignore_eos=True, mode=mode)
            assert r.tokens == ar, mode
            assert r.stats.mean_accept > 1.5
        sampled = dict(ignore_eos=True, temperature=0.8, seed=3)
        assert dec.generate(ids, 32, mode="ddtree", **sampled).tokens == dec.generate(ids, 32, mode="ar", **sampled).tokens
        assert dec.memory_plan["drafter"] == conv["weight_bytes"]


def test_q8_0_drafter_proposes_nearly_what_the_stored_one_does(pair):
    """The same block's logits from the stored and the Q8_0 drafter agree within Q8_0's rounding."""
    t, d = pair
    m = _handles.Model(str(t))
    try:
        out = {}
        for wt in (None, "q8_0"):
            dr = _handles.Draft(str(d), m, wt)
            r = _handles.Drafter(dr, m, ring_capacity=64, n_threads=2)
            rng = np.random.default_rng(0)
            feats = rng.standard_normal((8, dr.info["n_target_layers"] * dr.info["hidden"])).astype(np.float32)
            r.push_features(feats, 0)
            out[wt] = r.propose([5] + [dr.info["mask_token_id"]] * 7)
            r.close()
            dr.close()
    finally:
        m.close()
    a, b = out[None], out["q8_0"]
    assert np.abs(a - b).max() < 0.05 * np.abs(a).max()
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.85


def test_unsupported_drafter_types_are_refused(pair):
    t, d = pair
    with pytest.raises(DFlashError, match="choose bf16 or q8_0"):
        _handles.Draft(str(d), None, "q4_0")
    ffi, lib = load()
    assert lib.dfl_draft_load_as(str(d).encode(), ffi.NULL, 2) == ffi.NULL  # Q4_0
    assert "converted to BF16 or Q8_0" in last_error()
    with pytest.raises(DFlashError, match="choose bf16 or q8_0"):
        Decoder(t, d, device="cpu", threads=2, draft_type="q4_k")
