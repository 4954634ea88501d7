"""Quantised KV caches against F32 KV on the tiny transformers-built model:
greedy agreement over 64 tokens (Q8_0 must agree fully; Q4_0's agreement is
measured and bounded below) and teacher-forced logit drift."""
import numpy as np
import pytest

from dflash27b import Decoder

PROMPTS = [(1, 5), (2, 17), (3, 100)]


def _first_divergence(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.fixture(scope="module")
def runs(tiny_f32_gguf):
    out = {}
    for kv in ("f32", "f16", "q8_0", "q4_0"):
        with Decoder(tiny_f32_gguf, kv_type=kv, ctx=256, threads=2) as d:
            prompts = [np.random.default_rng(s).integers(0, 2000, size=n).tolist() for s, n in PROMPTS]
            out[kv] = {"gen": [d.generate(p, 64, ignore_eos=True).tokens for p in prompts],
                       "logits": d.logits(prompts[2])}
    return out


@pytest.mark.parametrize("kv,min_agree,max_logit_drift", [("f16", 64, 0.05), ("q8_0", 64, 0.1), ("q4_0", 24, 0.6)])
def test_quantized_kv_greedy_agreement(runs, kv, min_agree, max_logit_drift):
    agree = [_first_divergence(a, b) for a, b in zip(runs["f32"]["gen"], runs[kv]["gen"])]
    drift = float(np.abs(runs[kv]["logits"] - runs["f32"]["logits"]).max())
    print(f"KV {kv}: greedy tokens equal to F32 KV before first divergence: {agree}/64; "
          f"teacher-forced max |logit diff| {drift:.3g}")
    assert min(agree) >= min_agree
    assert drift < max_logit_drift
