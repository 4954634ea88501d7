"""The engine against transformers' own Qwen3.5 (float32, CPU) on a tiny random model.

Acceptance: logits at every prompt position within 1e-3 (max abs) with F32 KV,
and identical greedy 64-token continuations, for prompts of 1, 17 and 300 tokens.
"""
import numpy as np
import pytest

from dflash27b import Decoder

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.oracle

LOGIT_TOL = 1e-3


@pytest.fixture(scope="module")
def hf_model(tiny_hf_dir):
    from transformers import Qwen3_5ForCausalLM
    return Qwen3_5ForCausalLM.from_pretrained(tiny_hf_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def dec(tiny_f32_gguf):
    with Decoder(tiny_f32_gguf, kv_type="f32", ctx=1024, threads=2) as d:
        yield d


def _prompt(n, seed):
    return np.random.default_rng(seed).integers(0, 2000, size=n).tolist()


@pytest.mark.parametrize("n", [1, 17, 300])
def test_logits_match_transformers(hf_model, dec, n):
    ids = _prompt(n, n)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].numpy()
    ours = dec.logits(ids)
    err = np.abs(ours - ref).max()
    print(f"prompt {n}: max |logit diff| = {err:.3g}")
    assert ours.shape == ref.shape
    assert err < LOGIT_TOL


@pytest.mark.parametrize("n", [1, 17, 300])
def test_greedy_continuation_matches_transformers(hf_model, dec, n):
    ids = _prompt(n, 100 + n)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False, eos_token_id=None,
                                pad_token_id=0, min_new_tokens=64)
    ref = out[0, n:].tolist()
    ours = dec.generate(ids, 64, ignore_eos=True).tokens
    assert ours == ref
