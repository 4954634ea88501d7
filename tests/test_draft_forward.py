"""Drafter forward against z-lab's `dflash` package (the oracle): same features, same block, same logits.

The tiny transformers Qwen3.5 target supplies the embedding and lm_head on both sides (its GGUF conversion
for dflash27b); the drafter is a tiny random z-lab-format checkpoint in F32.  Two draft calls per case
check the draft KV cache: the second call sees context K/V computed by the first and only projects the new
features.  Cases: full and sliding layers, every RoPE form a config can carry (transformers' own rotary
embedding computes z-lab's side), and the published configs of tests/fixtures/draft_configs.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from tiny_draft import FORMS, PUBLISHED, make_tiny_draft, published_config, with_overrides, write_draft

pytestmark = pytest.mark.oracle

torch = pytest.importorskip("torch")
zl = pytest.importorskip("dflash.model")
from zlab_ref import zlab_draft_logits  # noqa: E402


@pytest.fixture(scope="module")
def target_pair(tiny_hf_dir, tiny_f32_gguf):
    from transformers import AutoModelForCausalLM

    from dflash27b import _handles
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_hf_dir), dtype=torch.float32).eval()
    return hf, _handles.Model(str(tiny_f32_gguf))


def first_blocks(d, target_pair):
    """Draft logits of two calls, ours and z-lab's: 20 prompt features (longer than the sliding windows
    used here), then a step that committed 5 tokens."""
    from dflash27b import _handles
    hf, target = target_pair
    draft = _handles.Draft(str(d), target)
    B, mask = draft.info["block_size"], draft.info["mask_token_id"]
    width = draft.info["hidden"] * draft.info["n_target_layers"]
    rng = np.random.default_rng(1)
    f1 = rng.standard_normal((20, width)).astype(np.float32)
    f2 = rng.standard_normal((5, width)).astype(np.float32)
    b1, b2 = [17] + [mask] * (B - 1), [901] + [mask] * (B - 1)
    want = zlab_draft_logits(d, hf, [(f1, b1, 0), (f2, b2, 20)])
    dr = _handles.Drafter(draft, target, ring_capacity=4096, n_threads=2)
    dr.push_features(f1)
    got = [dr.propose(b1)]
    dr.push_features(f2)
    got.append(dr.propose(b2))
    for g, w in zip(got, want):
        assert g.shape == w.shape == (B - 1, 2048)
        assert (g.argmax(-1) == w.argmax(-1)).all()
    return got, max(float(np.abs(g - w).max()) for g, w in zip(got, want))


CASES = {
    "full": dict(n_layers=2, block_size=8),
    "sliding": dict(n_layers=3, block_size=8, layer_types=["sliding_attention", "full_attention",
                                                           "sliding_attention"],
                    sliding_window=6, use_sliding_window=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_draft_logits_match_zlab(case, target_pair, tmp_path):
    _, err = first_blocks(make_tiny_draft(tmp_path / case, dtype="f32", seed=3, **CASES[case]), target_pair)
    assert err < 1e-4, err


@pytest.mark.parametrize("form", sorted(FORMS))
def test_draft_logits_match_zlab_per_rope_form(tmp_path, target_pair, form):
    base = make_tiny_draft(tmp_path / "base", n_layers=2, block_size=8, dtype="f32", seed=3)
    cfg = json.loads((base / "config.json").read_text())
    d = write_draft(tmp_path / form, with_overrides(cfg, FORMS[form]), seed=3)
    got, err = first_blocks(d, target_pair)
    print(f"{form}: max |logit diff| vs z-lab {err:.2e}")
    assert err < 1e-4
    unscaled, _ = first_blocks(base, target_pair)
    moved = max(float(np.abs(g - b).max()) for g, b in zip(got, unscaled))
    assert (moved > 1e-2) == (form != "tf5-default"), moved  # the scaling really changes the drafts


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_config_logits_match_zlab(tmp_path, target_pair, name):
    cfg = published_config(name)
    if cfg.get("sliding_window"):
        cfg["sliding_window"] = 6  # a window the 25 positions here pass
    cfg.setdefault("num_target_layers", 8)  # z-lab 0.1.0 evaluates build_target_layer_ids(num_target_layers) eagerly
    _, err = first_blocks(write_draft(tmp_path / name, cfg, seed=4), target_pair)
    print(f"{name}: max |logit diff| vs z-lab {err:.2e}")
    assert err < 1e-4
