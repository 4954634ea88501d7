"""End to end against z-lab's `dflash_generate` (the oracle decode loop) on CPU, greedy.

z-lab's stock loop crops the transformers cache after a rejection, which rolls back attention KV but not
the Gated DeltaNet recurrent state of a qwen35 target, so its output drifts from the target's own greedy
output.  `ExactTarget` gives it the true reference: every call recomputes the whole committed prefix
without a cache (slow, exact).  dflash27b must then produce the same ids and the same per-step
acceptance lengths, with the drafter distilled on this tiny target (tests/fixtures/tiny_draft_distilled).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.oracle

torch = pytest.importorskip("torch")
zl = pytest.importorskip("dflash.model")
from tiny_draft import DROP, FORMS, with_overrides, write_draft  # noqa: E402
from zlab_ref import ExactTarget, zlab_loop_on_cpu  # noqa: E402

DISTILLED = Path(__file__).resolve().parent / "fixtures" / "tiny_draft_distilled"


@pytest.fixture(scope="module")
def zlab_pair(tiny_hf_dir):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_hf_dir), dtype=torch.float32).eval()
    draft = zl.DFlashDraftModel.from_pretrained(str(DISTILLED), dtype=torch.float32).eval()
    return ExactTarget(hf), draft


def training_prompts(k: int) -> list[list[int]]:
    """The first k prompts the fixture drafter was distilled on (see fixtures/tiny_draft_distilled)."""
    import numpy as np
    rng = np.random.default_rng(0)
    return [rng.integers(0, 2047, 16).tolist() for _ in range(k)]


# two training prompts (high acceptance) and one it never saw
PROMPTS = training_prompts(2) + [[100, 200, 300, 400, 500, 600, 700]]


@pytest.mark.parametrize("block", [4, 8, 16])
def test_same_ids_and_acceptance_as_zlab(zlab_pair, tiny_f32_gguf, block, monkeypatch):
    from dflash27b import Decoder
    zlab_loop_on_cpu(monkeypatch)
    target, draft = zlab_pair
    n_new = 64
    with Decoder(tiny_f32_gguf, DISTILLED, kv_type="f32", threads=2) as dec:
        for prompt in PROMPTS:
            ref = zl.dflash_generate(draft, target, torch.tensor([prompt]), n_new, None, block_size=block,
                                     return_stats=True)
            want_ids = ref.output_ids[0, len(prompt):].tolist()
            got = dec.generate(prompt, n_new, ignore_eos=True, mode="chain", block_size=block)
            assert got.tokens == want_ids
            assert got.stats.accept_lengths == ref.acceptance_lengths
            if prompt is not PROMPTS[-1]:
                assert got.stats.mean_accept > 2.0  # multi-token acceptance really exercised


@pytest.mark.slow
def test_chain_acceptance_matches_zlab_per_rope_form(zlab_pair, tiny_f32_gguf, tmp_path, monkeypatch):
    """z-lab's decode loop (on the exact target) and ours, with the distilled drafter's weights under each rope
    form: the same tokens and the same per-step acceptance lengths; YaRN changes them."""
    from dflash27b import Decoder
    zlab_loop_on_cpu(monkeypatch)
    target, _ = zlab_pair
    base = json.loads((DISTILLED / "config.json").read_text())
    prompts = training_prompts(2)
    # This drafter memorised positions under unscaled RoPE: a mild YaRN (original context 512) keeps some
    # multi-token acceptance while changing the drafts.
    mild = {"factor": 8.0, "original_max_position_embeddings": 512}
    forms = {"tf5-default": FORMS["tf5-default"],
             "tf5-yarn": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000000.0, **mild},
                              rope_theta=DROP, rope_scaling=DROP),
             "tf4-yarn-type": dict(rope_theta=10000000.0, rope_scaling={"type": "yarn", **mild})}
    accepts = {}
    for form, overrides in forms.items():
        d = write_draft(tmp_path / form, with_overrides(base, overrides), weights_from=DISTILLED)
        draft = zl.DFlashDraftModel.from_pretrained(str(d), dtype=torch.float32).eval()
        with Decoder(tiny_f32_gguf, d, kv_type="f32", threads=2) as dec:
            for i, prompt in enumerate(prompts):
                ref = zl.dflash_generate(draft, target, torch.tensor([prompt]), 48, None, block_size=8,
                                         return_stats=True)
                got = dec.generate(prompt, 48, ignore_eos=True, mode="chain", block_size=8)
                assert got.tokens == ref.output_ids[0, len(prompt):].tolist()
                assert got.stats.accept_lengths == ref.acceptance_lengths, form
                accepts[form, i] = got.stats.accept_lengths
        print(form, [accepts[form, i] for i in range(len(prompts))])
    for form in ("tf5-yarn", "tf4-yarn-type"):
        assert any(accepts[form, i] != accepts["tf5-default", i] for i in range(len(prompts))), form
        assert max(max(accepts[form, i]) for i in range(len(prompts))) > 2, form  # multi-token steps under YaRN
