"""End to end against z-lab's `dflash_generate` (the oracle decode loop) on CPU, greedy.

z-lab's stock loop crops the transformers cache after a rejection, which rolls back attention KV but not
the Gated DeltaNet recurrent state of a qwen35 target, so its output drifts from the target's own greedy
output.  `ExactTarget` gives it the true reference: every call recomputes the whole committed prefix
without a cache (slow, exact).  dflash27b must then produce the same ids and the same per-step
acceptance lengths, with the drafter distilled on this tiny target (tests/fixtures/tiny_draft_distilled).
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.oracle

torch = pytest.importorskip("torch")
zl = pytest.importorskip("dflash.model")

DISTILLED = Path(__file__).resolve().parent / "fixtures" / "tiny_draft_distilled"


class ExactTarget(torch.nn.Module):
    """The HF target, recomputing the committed prefix without a cache on every call."""

    def __init__(self, hf):
        super().__init__()
        self.hf = hf
        self.config = hf.config
        self.lm_head = hf.lm_head
        self.hist = None

    @property
    def device(self):
        return self.hf.device

    def get_input_embeddings(self):
        return self.hf.get_input_embeddings()

    def forward(self, input_ids, position_ids, past_key_values=None, use_cache=False, logits_to_keep=0,
                output_hidden_states=False, **_):
        p0 = int(position_ids[0, 0])  # tokens before p0 are committed; anything after was rejected
        prev = self.hist[:, :p0] if self.hist is not None and p0 > 0 else input_ids[:, :0]
        self.hist = torch.cat([prev, input_ids], 1)
        out = self.hf(self.hist, use_cache=False, output_hidden_states=output_hidden_states)
        n = input_ids.shape[1]
        keep = logits_to_keep if logits_to_keep else n
        hs = tuple(h[:, -n:] for h in out.hidden_states) if output_hidden_states else None
        return SimpleNamespace(logits=out.logits[:, -keep:], hidden_states=hs)


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
    import time

    from dflash27b import Decoder
    monkeypatch.setattr(zl, "_cuda_time", time.perf_counter)  # its stats timer syncs CUDA; CPU here
    crop = zl._crop_to
    # ExactTarget never fills z-lab's target cache; cropping that empty hybrid cache would raise.
    monkeypatch.setattr(zl, "_crop_to", lambda cache, n: crop(cache, n) if cache.get_seq_length() else None)
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
