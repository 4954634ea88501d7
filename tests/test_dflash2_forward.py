"""DFlash2 drafter forward and candidate-selector path against the independent PyTorch reference
(tests/dflash2_ref.py, written from docs/research/dflash2-spec.md and cross-checked there against z-lab's own
DFlash2 code): F32 weights, same features and block, logits within 1e-4 and the same selected path, across
two draft calls (the second sees context K/V the first computed) and with strong convolutions and selector."""
from __future__ import annotations


import numpy as np
import pytest

from tiny_draft import make_tiny_draft, to_dflash2

pytestmark = pytest.mark.oracle
torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file  # noqa: E402

from dflash2_ref import load_dflash2  # noqa: E402


@pytest.fixture(scope="module")
def target_pair(tiny_hf_dir, tiny_f32_gguf):
    from transformers import AutoModelForCausalLM

    from dflash27b import _handles
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_hf_dir), dtype=torch.float32).eval()
    return hf, _handles.Model(str(tiny_f32_gguf))


CASES = {
    "mild": dict(scale=0.05, seed=1),
    "strong": dict(scale=0.5, seed=2),
    "three taps, multiplier": dict(scale=0.3, seed=3, conv_kernel_size=3, output_multiplier=0.5),
    "sliding, non-causal": dict(scale=0.3, seed=4, v1=dict(layer_types=["sliding_attention", "sliding_attention"],
                                                           sliding_window=6, use_sliding_window=True,
                                                           is_causal=False)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_selector_path_match_the_reference(case, target_pair, tmp_path):
    from dflash27b import _handles
    hf, target = target_pair
    kw = dict(CASES[case])
    v1 = make_tiny_draft(tmp_path / "v1", n_layers=2, block_size=8, dtype="f32", seed=7, **kw.pop("v1", {}))
    d = to_dflash2(v1, tmp_path / "d2", **kw)
    ref = load_dflash2(d)
    E = hf.model.embed_tokens.weight.detach().double()
    head = hf.lm_head.weight.detach().double()
    draft = _handles.Draft(str(d), target)
    B, mask, K = draft.info["block_size"], draft.info["mask_token_id"], draft.info["selector_top_k"]
    width = draft.info["hidden"] * draft.info["n_target_layers"]
    rng = np.random.default_rng(5)
    dr = _handles.Drafter(draft, target, ring_capacity=4096, n_threads=2)
    ctx, n_ctx = None, 0
    for n_new, root in ((20, 17), (5, 901)):
        f = rng.standard_normal((n_new, width)).astype(np.float32)
        dr.push_features(f)
        new = ref.context_kv(torch.from_numpy(f).double(), start=n_ctx)
        ctx = new if ctx is None else ctx.extend(new)
        n_ctx += n_new
        block = [root] + [mask] * (B - 1)
        out = ref.block_forward(ctx, block, n_ctx, E, head)
        got = dr.propose(block)
        err = float(np.abs(got - out.logits.numpy()).max())
        assert err < 1e-4, err
        path, ids, _ = dr.propose_path(block, K)
        want = ref.greedy_path(root, out.logits, out.hidden, out.raw_logits)
        assert ids.tolist() == want.cand_ids.tolist()
        assert path == want.tokens, (path, want.tokens)


def test_chain_decode_equals_zlab_dflash2_loop(tiny_hf_dir, tiny_f32_gguf, tmp_path, monkeypatch):
    """z-lab's own decode loop (dflash_generate) with its DFlash2DraftModel, on the exact target, against ours in
    chain mode with the same checkpoint: the same tokens and the same per-step acceptance lengths.  The drafter
    is the distilled tiny one with light convolutions and a selector added, so it still accepts several tokens."""
    import shutil

    zl = pytest.importorskip("dflash.model")
    if not hasattr(zl, "DFlash2DraftModel"):
        pytest.skip("this dflash package has no DFlash2DraftModel")
    from transformers import AutoModelForCausalLM

    from dflash27b import Decoder
    from test_zlab_generate import DISTILLED, training_prompts
    from zlab_ref import ExactTarget, zlab_loop_on_cpu
    zlab_loop_on_cpu(monkeypatch)
    v1 = tmp_path / "v1"
    shutil.copytree(DISTILLED, v1)
    w = load_file(str(v1 / "model.safetensors"))
    save_file({k: v.float().contiguous() for k, v in w.items()}, str(v1 / "model.safetensors"))
    d = to_dflash2(v1, tmp_path / "d2", scale=0.02, seed=1)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_hf_dir), dtype=torch.float32).eval()
    draft = zl.DFlash2DraftModel.from_pretrained(str(d), dtype=torch.float32).eval()
    target = ExactTarget(hf)
    n_new, block = 48, 8
    with Decoder(tiny_f32_gguf, d, kv_type="f32", threads=2) as dec:
        for prompt in training_prompts(2):
            ref = zl.dflash_generate(draft, target, torch.tensor([prompt]), n_new, None, block_size=block,
                                     return_stats=True)
            got = dec.generate(prompt, n_new, ignore_eos=True, mode="chain", block_size=block)
            assert got.tokens == ref.output_ids[0, len(prompt):].tolist()
            assert got.stats.accept_lengths == ref.acceptance_lengths
            assert got.stats.mean_accept > 1.5
