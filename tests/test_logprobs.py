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


def test_prompt_logprobs_are_the_log_softmax_and_the_decode_goes_on_from_them(dec):
    """prompt_logprobs: each prompt token's log-softmax given the ones before it (the first: None), k
    alternatives best first (lower id on ties), 64 rows a chunk; the same values as a reply's own logprobs for
    its tokens.  With keep, the context holds the prompt but its last token and a decode goes on from there
    (held=): the same tokens as a decode of the whole prompt, in every mode, its prefill one token."""
    ids = dec.tokenize("def fibonacci(n):\n" + "    x = x + 1\n" * 30)   # > 64 tokens: two chunks
    assert len(ids) > 70
    pl = dec.prompt_logprobs(ids, 3)
    assert pl[0] == {"token": ids[0], "logprob": None, "top": None} and len(pl) == len(ids)
    rows = dec.logits(ids).astype(np.float64)[:-1]
    ref = rows - rows.max(-1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(-1, keepdims=True))
    assert max(abs(e["logprob"] - ref[i, e["token"]]) for i, e in enumerate(pl[1:])) < 1e-9
    for i, e in enumerate(pl[1:]):
        want = sorted(range(rows.shape[1]), key=lambda t: (-rows[i, t], t))[:3]
        assert [t for t, _ in e["top"]] == want
    r = dec.generate(ids, 6, ignore_eos=True, mode="ar", logprobs=0, cache=False)
    tail = dec.prompt_logprobs(ids + r.tokens, 0)[len(ids):]
    assert [round(e["logprob"], 5) for e in tail] == [round(e["logprob"], 5) for e in r.logprobs]
    for mode in ("ar", "ddtree", "auto"):
        kw = dict(mode=mode, ignore_eos=True, cache=False, temperature=0.7, seed=4)
        want = dec.generate(ids, 16, **kw).tokens
        dec.prompt_logprobs(ids, 1, keep=True)
        assert dec.context.n_past == len(ids) - 1
        got = [t for ts in dec.stream_ids(ids, 16, held=len(ids) - 1, **kw) for t in ts]
        assert got == want, mode
        assert dec.last_stats().cached_tokens == 0
    with pytest.raises(DFlashError, match="the context holds"):
        list(dec.stream_ids(ids, 2, held=5, cache=False))
