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


def test_logits_match_transformers_0p8b_like_layout(tmp_path_factory):
    """The 0.8B layout features: tied embeddings, nk == nv (no V-head reorder), head_dim 256 with 64
    rotary dims and M-RoPE sections [11, 11, 10]."""
    from transformers import Qwen3_5ForCausalLM

    from dflash27b.tools.convert import convert_hf_to_gguf
    from tiny_hf import make_tiny_hf
    d = make_tiny_hf(tmp_path_factory.mktemp("hf08"), seed=1, tie_word_embeddings=True, linear_num_key_heads=4,
                     linear_num_value_heads=4, head_dim=256, num_hidden_layers=4,
                     rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                          mrope_section=[11, 11, 10], mrope_interleaved=True))
    gguf = convert_hf_to_gguf(d, d / "m.gguf", "f32")
    hf = Qwen3_5ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = _prompt(40, 5)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    with Decoder(gguf, kv_type="f32", ctx=64, threads=2) as dec:
        err = np.abs(dec.logits(ids) - ref).max()
    print(f"0.8B-like layout: max |logit diff| = {err:.3g}")
    assert err < LOGIT_TOL
