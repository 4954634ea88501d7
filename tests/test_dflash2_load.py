"""DFlash2 drafters in the published layout (architectures ["DFlash2DraftModel"]; docs/research/dflash2-spec.md):
config.json with conv_kernel_size / conv_group_size / selector_top_k / selector_rank in dflash_config, and
model.safetensors with the DFlash drafter's tensors plus attention_conv / mlp_conv per layer and the candidate
selector's projection and two codebooks.  They load with every shape validated, are listed by
`dflash27b models`, count in the drafter's weight bytes, and draft (chain from the candidate selector's path) with output
equal to AR's.  Malformed ones get one-line errors naming the key or tensor."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dflash27b._lib import DFlashError

torch = pytest.importorskip("torch")
from safetensors.torch import load_file  # noqa: E402
from tiny_draft import to_dflash2  # noqa: E402

BUNDLED = Path(__file__).resolve().parent.parent / "python" / "dflash27b" / "models"


def _write_dflash2(d: Path, cfg_edit=None, tensors_edit=None) -> Path:
    """The bundled tiny drafter turned into a DFlash2 checkpoint of the published layout (BF16, block 8,
    non-causal as Qwen3.8's drafter)."""
    def edit(cfg):
        cfg["is_causal"] = False
        if cfg_edit:
            cfg_edit(cfg)
    return to_dflash2(BUNDLED / "tiny-draft", d, scale=0.02, seed=0, dtype="bf16", cfg_edit=edit,
                      tensors_edit=tensors_edit, block_size=8)


@pytest.fixture(scope="module")
def target():
    from dflash27b._handles import Model
    m = Model(str(BUNDLED / "tiny-target.gguf"))
    yield m
    m.close()


def test_published_layout_loads_and_counts(tmp_path, target):
    from dflash27b._handles import Draft, draft_config_info
    d = _write_dflash2(tmp_path / "d2")
    info = draft_config_info(d)
    assert info["generation"] == 2 and info["block_size"] == 8
    assert (info["conv_kernel_size"], info["conv_group_size"], info["selector_top_k"], info["selector_rank"]) == \
        (2, 16, 16, 32)
    dr = Draft(str(d), target)
    assert dr.info["generation"] == 2
    assert dr.info["weight_bytes"] == sum(v.numel() * 2 for v in load_file(str(d / "model.safetensors")).values())
    q8 = Draft(str(d), target, weight_type="q8_0")  # the new matrices convert too
    assert q8.info["weight_bytes"] < dr.info["weight_bytes"]
    from dflash27b.memory_plan import drafter_weight_bytes  # the plan counts every part, codebooks included
    assert drafter_weight_bytes(dr.info, "q8_0") == q8.info["weight_bytes"]
    assert drafter_weight_bytes(dr.info, "bf16") == dr.info["weight_bytes"]
    v1 = draft_config_info(BUNDLED / "tiny-draft")
    assert v1["generation"] == 1 and v1["selector_top_k"] == 0


@pytest.mark.parametrize("sampled", [False, True])
def test_chain_ddtree_auto_equal_ar(tmp_path, sampled):
    """Drafting with a DFlash2 drafter (its selector's path as the chain; trees from its selector's lattice or
    from its draft distribution alone) changes no token: chain, DDTree and auto == AR, greedy and seeded."""
    from dflash27b import Decoder
    d = _write_dflash2(tmp_path / "d2")
    kw = dict(temperature=0.8, top_p=0.9, seed=4) if sampled else {}
    with Decoder(BUNDLED / "tiny-target.gguf", d, threads=2) as dec:
        ar = dec.generate("def fibonacci(n):", 40, mode="ar", ignore_eos=True, **kw).tokens
        for mode, extra in (("chain", {}), ("ddtree", {"budget": 12}), ("auto", {}),
                            ("ddtree", {"budget": 12, "tree_scores": "draft"}), ("auto", {"tree_scores": "draft"})):
            r = dec.generate("def fibonacci(n):", 40, mode=mode, ignore_eos=True, **extra, **kw)
            assert r.tokens == ar, mode
            assert r.stats.block_size == 8 or mode == "auto"


def test_sliding_window_feature_ring_and_prefix_cache(tmp_path):
    """Qwen3.8's drafter layout (every layer sliding_attention, non-causal) with a window shorter than the
    prompt: the draft KV and the feature ring roll past it, and a prefix-cache hit (turn 2 extends turn 1)
    decodes as a cold start does, chain and DDTree, each == AR."""
    from dflash27b import Decoder

    def sliding(cfg):
        cfg.update(layer_types=["sliding_attention"] * cfg["num_hidden_layers"], sliding_window=48,
                   use_sliding_window=True)
    d = _write_dflash2(tmp_path / "d2", cfg_edit=sliding)
    t = BUNDLED / "tiny-target.gguf"
    with Decoder(t, d, threads=2, ctx=1024, batch=64) as cold, \
            Decoder(t, d, threads=2, ctx=1024, batch=64, cache_mem=32 << 20) as warm:
        p1 = cold.tokenize(Path(__file__).read_text())[:200]
        for mode in ("chain", "ddtree"):
            r1 = warm.generate(p1, 24, mode=mode, ignore_eos=True)
            assert r1.tokens == cold.generate(p1, 24, mode="ar", ignore_eos=True).tokens
            p2 = p1 + r1.tokens + p1[:20]
            r2 = warm.generate(p2, 24, mode=mode, ignore_eos=True)
            assert r2.stats.cached_tokens >= len(p1), r2.stats.cached_tokens
            assert r2.tokens == cold.generate(p2, 24, mode=mode, ignore_eos=True).tokens
            assert r2.tokens == cold.generate(p2, 24, mode="ar", ignore_eos=True).tokens


def test_models_lists_it(tmp_path, monkeypatch):
    from dflash27b import model_paths
    md = tmp_path / "models"
    shutil.copytree(BUNDLED / "tiny-draft", md / "z" / "Tiny-DFlash")
    _write_dflash2(md / "z" / "Tiny-DFlash2")
    shutil.copy(BUNDLED / "tiny-target.gguf", md / "z" / "tiny-target.gguf")
    monkeypatch.setenv("DFLASH27B_MODELS", str(md))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "nohub"))
    targets, drafts = model_paths.scan()
    gens = {d.path.name: d.generation for d in drafts}
    assert gens == {"Tiny-DFlash": 1, "Tiny-DFlash2": 2}, gens
    t = targets[0]
    # a DFlash2 drafter drafts as a DFlash one does: both match the target they were made for
    assert sorted(d.path.name for d in drafts if model_paths.drafter_matches(t, d)) == ["Tiny-DFlash", "Tiny-DFlash2"]


def _cfg(f):
    return dict(cfg_edit=f)


def _ten(f):
    return dict(tensors_edit=f)


MALFORMED = {
    "no conv_kernel_size": (_cfg(lambda c: c["dflash_config"].pop("conv_kernel_size")),
                            "missing config key 'dflash_config.conv_kernel_size'"),
    "group does not divide hidden": (_cfg(lambda c: c["dflash_config"].update(conv_group_size=24)),
                                     "conv_group_size 24 does not divide hidden_size 256"),
    "kernel longer than the block": (_cfg(lambda c: c["dflash_config"].update(conv_kernel_size=9)),
                                     "config key 'conv_kernel_size' = 9 is out of range"),
    "selector_top_k zero": (_cfg(lambda c: c["dflash_config"].update(selector_top_k=0)),
                            "config key 'selector_top_k' = 0 is out of range"),
    "selector_rank a string": (_cfg(lambda c: c["dflash_config"].update(selector_rank="32")),
                               "config key 'selector_rank' should be an integer"),
    "unknown architecture": (_cfg(lambda c: c.update(architectures=["DFlash3DraftModel"])),
                             "architectures 'DFlash3DraftModel' is not a DFlash drafter"),
    "negative softcap": (_cfg(lambda c: c["dflash_config"].update(final_logit_softcapping=-1)),
                         "'final_logit_softcapping' must be >= 0"),
    "codebook of the wrong rank": (_ten(lambda t: t.update({"candidate_selector.successor_codebook":
                                                            torch.zeros(4096, 16, dtype=torch.bfloat16)})),
                                   "tensor 'candidate_selector.successor_codebook' has shape [4096, 16], expected "
                                   "[4096, 32]"),
    "missing predecessor codebook": (_ten(lambda t: t.pop("candidate_selector.predecessor_codebook")),
                                     "missing tensor 'candidate_selector.predecessor_codebook'"),
    "conv base kernel of another width": (_ten(lambda t: t.update({"layers.1.mlp_conv.base_kernel":
                                                                   torch.zeros(2, 3, 256, dtype=torch.bfloat16)})),
                                          "tensor 'layers.1.mlp_conv.base_kernel' has shape [2, 3, 256]"),
    "a stray tensor": (_ten(lambda t: t.update({"mask_embedding": torch.zeros(256, dtype=torch.bfloat16)})),
                       "unexpected tensor 'mask_embedding' (not part of a 2-layer DFlash2 drafter)"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_dflash2_gets_one_line_naming_it(tmp_path, target, case):
    from dflash27b._handles import Draft
    edit, msg = MALFORMED[case]
    d = _write_dflash2(tmp_path / "bad", **edit)
    with pytest.raises(DFlashError) as e:
        Draft(str(d), target)
    assert msg in str(e.value) and "\n" not in str(e.value), str(e.value)
