"""Repetition penalties (llama.cpp's repeat / frequency / presence over the last repeat_last_n tokens), lossless:
a verified tree node counts its own ancestors' tokens, so speculative output equals AR output with the same
penalties, greedy and seeded; AR itself is checked against a numpy re-implementation on the raw logits."""
from __future__ import annotations

import numpy as np
import pytest

from dflash27b import Decoder, DFlashError

PENALTIES = [dict(frequency_penalty=1.0), dict(repeat_penalty=1.3, repeat_last_n=16),
             dict(presence_penalty=0.8, frequency_penalty=-0.2, repeat_last_n=-1)]
LOOPING = "import os\nimport sys\nimport "


@pytest.fixture(scope="module")
def dec(pair):
    with Decoder(pair[0], pair[1], device="cpu", threads=2, ctx=512) as d:
        yield d


def _penalize(row: np.ndarray, seq: list[int], repeat_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
              repeat_last_n=64) -> np.ndarray:
    row = row.astype(np.float32).copy()
    win = seq if repeat_last_n < 0 else seq[len(seq) - min(len(seq), repeat_last_n):]
    for t, c in zip(*np.unique(np.array(win, dtype=np.int64), return_counts=True)):
        x = row[t]
        x = x / np.float32(repeat_penalty) if x > 0 else x * np.float32(repeat_penalty)
        row[t] = x - (np.float32(c) * np.float32(frequency_penalty) + np.float32(presence_penalty))
    return row


@pytest.mark.parametrize("pen", PENALTIES)
def test_ar_with_penalties_matches_numpy(dec, pen):
    ids = dec.tokenize(LOOPING)
    got = dec.generate(ids, 12, ignore_eos=True, mode="ar", **pen).tokens
    seq = list(ids)
    for _ in range(12):
        seq.append(int(np.argmax(_penalize(dec.logits(seq)[-1], seq, **pen))))
    assert got == seq[len(ids):]


@pytest.mark.parametrize("pen", PENALTIES)
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 9}], ids=["greedy", "seeded"])
def test_speculative_with_penalties_equals_ar(dec, pen, sampling):
    ids = dec.tokenize("def f(x):\n    return x\n\n\ndef g(x):\n")
    kw = dict(ignore_eos=True, **pen, **sampling)
    ar = dec.generate(ids, 64, mode="ar", **kw).tokens
    assert ar != dec.generate(ids, 64, mode="ar", ignore_eos=True, **sampling).tokens  # the penalty matters here
    for mode in ("chain", "ddtree", "auto"):
        assert dec.generate(ids, 64, mode=mode, **kw).tokens == ar, mode


def test_a_frequency_penalty_breaks_a_loop(dec):
    def repeats(t, n=4):
        grams = [tuple(t[i:i + n]) for i in range(len(t) - n + 1)]
        return len(grams) - len(set(grams))
    ids = dec.tokenize(LOOPING)
    plain = dec.generate(ids, 96, ignore_eos=True, mode="ddtree").tokens
    pen = dec.generate(ids, 96, ignore_eos=True, mode="ddtree", frequency_penalty=1.0).tokens
    assert repeats(plain) > 40 and repeats(pen) < 10


def test_bad_penalties_are_refused(dec):
    for kw, msg in ((dict(repeat_penalty=0), "repeat_penalty"), (dict(frequency_penalty=float("nan")), "frequency"),
                    (dict(repeat_last_n=-2), "repeat_last_n")):
        with pytest.raises(DFlashError, match=msg):
            dec.generate("x", 2, **kw)
