"""Drafter forward against z-lab's `dflash` package (the oracle): same features, same block, same logits.

The tiny transformers Qwen3.5 target supplies the embedding and lm_head on both sides (its GGUF conversion
for dflash27b); the drafter is a tiny random z-lab-format checkpoint in F32.  Two draft calls per case
check the draft KV cache: the second call sees context K/V computed by the first and only projects the new
features.
"""
from __future__ import annotations

import numpy as np
import pytest

from tiny_draft import make_tiny_draft

pytestmark = pytest.mark.oracle

torch = pytest.importorskip("torch")
zl = pytest.importorskip("dflash.model")


def zlab_draft_logits(draft_dir, target_hf, calls):
    """calls: [(features [C, F], block ids [B], first position of the features)] -> logits per call."""
    model = zl.DFlashDraftModel.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
    cache = zl._make_cache(model.config)
    head = zl._output_head(target_hf)
    out = []
    with torch.inference_mode():
        for feats, block, p0 in calls:
            f = torch.from_numpy(feats)[None]
            b = torch.tensor(block)[None]
            start = p0 + f.shape[1]
            pos = torch.arange(p0, start + len(block))[None]
            h = model(target_hidden=f, noise_embedding=zl._raw_input_embeddings(target_hf, b), position_ids=pos,
                      past_key_values=cache, use_cache=True)
            zl._crop_to(cache, start)
            out.append(model.compute_logits(h[:, 1:], head)[0].numpy())
    return out


@pytest.fixture(scope="module")
def target_pair(tiny_hf_dir, tiny_f32_gguf):
    from transformers import AutoModelForCausalLM

    from dflash27b import _handles
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_hf_dir), dtype=torch.float32).eval()
    return hf, _handles.Model(str(tiny_f32_gguf))


CASES = {
    "full": dict(n_layers=2, block_size=8),
    "sliding": dict(n_layers=3, block_size=8, layer_types=["sliding_attention", "full_attention",
                                                           "sliding_attention"],
                    sliding_window=6, use_sliding_window=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_draft_logits_match_zlab(case, target_pair, tmp_path):
    from dflash27b import _handles
    hf, target = target_pair
    d = make_tiny_draft(tmp_path / case, dtype="f32", seed=3, **CASES[case])
    draft = _handles.Draft(str(d), target)
    B, mask = draft.info["block_size"], draft.info["mask_token_id"]
    width = draft.info["hidden"] * draft.info["n_target_layers"]
    rng = np.random.default_rng(1)
    # 20 prompt features (longer than the sliding window), then a step that committed 5 tokens.
    f1 = rng.standard_normal((20, width)).astype(np.float32)
    f2 = rng.standard_normal((5, width)).astype(np.float32)
    b1 = [17] + [mask] * (B - 1)
    b2 = [901] + [mask] * (B - 1)
    want = zlab_draft_logits(d, hf, [(f1, b1, 0), (f2, b2, 20)])

    dr = _handles.Drafter(draft, target, ring_capacity=4096, n_threads=2)
    dr.push_features(f1)
    got1 = dr.propose(b1)
    dr.push_features(f2)
    got2 = dr.propose(b2)
    assert got1.shape == want[0].shape == (B - 1, 2048)
    for g, w in ((got1, want[0]), (got2, want[1])):
        assert np.abs(g - w).max() < 1e-3, np.abs(g - w).max()
        assert (g.argmax(-1) == w.argmax(-1)).all()
