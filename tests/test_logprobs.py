"""Log-probabilities of emitted tokens: the target's log-softmax of its raw logits at each generated position,
in every mode (speculative modes read them from the verify rows of the accepted path), greedy or sampled
(before temperature and filters); asking for them changes no token."""
from __future__ import annotations

import numpy as np
import pytest

from dflash27b import Decoder, DFlashError


@pytest.fixture(scope="module")
def dec(pair):
    with Decoder(pair[0], pair[1], device="cpu", threads=2, ctx=512) as d:
        yield d


@pytest.mark.parametrize("mode", ["ar", "chain", "ddtree", "auto"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 3}], ids=["greedy", "seeded"])
def test_logprobs_are_the_target_log_softmax(dec, mode, sampling):
    ids = dec.tokenize("import os\n\n\ndef walk(path):\n")
    kw = dict(ignore_eos=True, mode=mode, **sampling)
    plain = dec.generate(ids, 24, **kw)
    r = dec.generate(ids, 24, logprobs=4, **kw)
    assert r.tokens == plain.tokens and plain.logprobs is None
    rows = dec.logits(ids + r.tokens)[len(ids) - 1:len(ids) - 1 + len(r.tokens)].astype(np.float64)
    ref = rows - rows.max(-1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(-1, keepdims=True))
    assert [e["token"] for e in r.logprobs] == r.tokens
    assert max(abs(e["logprob"] - ref[i, t]) for i, (e, t) in enumerate(zip(r.logprobs, r.tokens))) < 1e-4
    for i, e in enumerate(r.logprobs):
        want = np.argsort(-ref[i], kind="stable")[:4]
        assert [t for t, _ in e["top"]] == want.tolist()
        assert np.allclose([p for _, p in e["top"]], ref[i, want], atol=1e-4)


def test_bad_logprobs_and_eos(dec):
    with pytest.raises(DFlashError, match="logprobs must be an integer in 0..20"):
        dec.generate("x", 2, logprobs=21)
    r = dec.generate("def f(x):", 0, logprobs=2)
    assert r.tokens == [] and r.logprobs == []
    r = dec.generate("def f(x):", 6, logprobs=0)
    assert len(r.logprobs) == len(r.tokens) and all(e["top"] == [] for e in r.logprobs)
