"""A logit bias (OpenAI's logit_bias, llama.cpp's --logit-bias): added to a token's logit before the penalties
and the sampler at every position, so speculative output equals AR output with the same bias, greedy and
seeded; AR is checked against numpy on the raw logits (the bias, then the penalties, then the argmax)."""
from __future__ import annotations

import numpy as np
import pytest

from dflash27b import Decoder, DFlashError
from dflash27b.params import GenParams

from test_penalties import _penalize

PROMPT = "import os\nimport sys\nimport "


@pytest.fixture(scope="module")
def dec(pair):
    with Decoder(pair[0], pair[1], device="cpu", threads=2, ctx=512) as d:
        yield d


def _biased_greedy(dec, ids: list[int], n: int, bias: dict[int, float], **pen) -> list[int]:
    seq = list(ids)
    for _ in range(n):
        row = dec.logits(seq)[-1].astype(np.float32)
        for t, b in bias.items():
            row[t] += np.float32(b)
        if pen:
            row = _penalize(row, seq, **pen)
        seq.append(int(np.argmax(row)))
    return seq[len(ids):]


def test_ar_with_a_bias_matches_numpy(dec):
    ids = dec.tokenize(PROMPT)
    plain = dec.generate(ids, 10, ignore_eos=True, mode="ar").tokens
    bias = {plain[1]: -7.5, plain[4]: -100.0, 3: 4.0}
    got = dec.generate(ids, 10, ignore_eos=True, mode="ar", logit_bias=bias).tokens
    assert got == _biased_greedy(dec, ids, 10, bias) and got != plain
    assert plain[4] not in got   # -100: all but banned
    # before the penalties, as llama.cpp's sampler chain
    pen = dict(repeat_penalty=1.3, frequency_penalty=0.5, repeat_last_n=16)
    got = dec.generate(ids, 10, ignore_eos=True, mode="ar", logit_bias=bias, **pen).tokens
    assert got == _biased_greedy(dec, ids, 10, bias, **pen)


def test_plus_100_forces_a_token(dec):
    got = dec.generate(PROMPT, 6, ignore_eos=True, mode="auto", logit_bias={"17": 100}).tokens
    assert got == [17] * 6


@pytest.mark.parametrize("sampling", [{}, dict(temperature=0.9, seed=5)], ids=["greedy", "seeded"])
def test_every_mode_equals_ar_with_the_bias(dec, sampling):
    ids = dec.tokenize("def fibonacci(n):\n")
    plain = dec.generate(ids, 32, ignore_eos=True, mode="ar", **sampling).tokens
    bias = {plain[2]: -100.0, plain[6]: -2.0, plain[9]: 3.0}
    ar = dec.generate(ids, 32, ignore_eos=True, mode="ar", logit_bias=bias, **sampling)
    assert ar.tokens != plain
    for mode in ("chain", "ddtree", "auto"):
        assert dec.generate(ids, 32, ignore_eos=True, mode=mode, logit_bias=bias, **sampling).tokens == ar.tokens, mode


def test_log_probabilities_stay_the_raw_logits(dec):
    ids = dec.tokenize(PROMPT)
    plain = dec.generate(ids, 4, ignore_eos=True, mode="ar", logprobs=0)
    biased = dec.generate(ids, 4, ignore_eos=True, mode="ar", logprobs=0, logit_bias={plain.tokens[0]: 1.0})
    assert biased.tokens[0] == plain.tokens[0] and biased.logprobs[0]["logprob"] == plain.logprobs[0]["logprob"]


@pytest.mark.parametrize("v, ok", [
    ({"15": 1.5, 7: -100}, {7: -100.0, 15: 1.5}),
    ('{"15": 2}', {15: 2.0}),
    ("15+1.5,7-100", {7: -100.0, 15: 1.5}),
    ({}, None),
])
def test_spellings(v, ok):
    assert GenParams(logit_bias=v).logit_bias == ok


@pytest.mark.parametrize("v, needle", [
    ({"15": 101}, "bad bias 101"), ({"x": 1}, "bad token id 'x'"), ({-1: 1}, "bad token id -1"),
    ({"\u00b2": 1}, "bad token id"), ({"\u0661\u0665": 1}, "bad token id"),   # digits, but not ASCII ones
    ("15+1,15-2", "ID+BIAS"), ("15*2", "ID+BIAS"), ([1, 2], "token id: bias"), ({"1": float("nan")}, "bad bias"),
])
def test_bad_biases_are_refused_by_name(v, needle):
    with pytest.raises(DFlashError, match="logit_bias") as e:
        GenParams(logit_bias=v)
    assert needle in str(e.value)


def test_a_token_outside_the_vocabulary_is_refused(dec):
    with pytest.raises(DFlashError, match=r"logit_bias token id 99999 is outside the vocabulary"):
        dec.generate(PROMPT, 4, logit_bias={99999: 1.0})
    assert dec.generate(PROMPT, 4, mode="ar").tokens   # the decoder goes on
