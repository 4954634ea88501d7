"""Drafter config.json in every published form: transformers-5 `rope_parameters`, transformers-4 `rope_theta` +
`rope_scaling` (`rope_type` or legacy `type`), RoPE scaling (linear, YaRN), sliding layers from `layer_types` or
derived from `use_sliding_window` / `sliding_window` / `max_window_layers`.

Oracles: transformers 5.23's own `Qwen3Config` and `Qwen3RotaryEmbedding` (how a config is read), z-lab's `dflash`
0.1.0 (draft logits; its decode loop for acceptance lengths).  The core's reader is reached through
`dfl_draft_config_info` (no weights) and through loading.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dflash27b import Decoder, DFlashError
from dflash27b._handles import draft_config_info
from tiny_draft import DROP, FORMS, PUBLISHED, make_tiny_draft, published_config, write_draft

def hf_reading(cfg: dict):
    """transformers 5.23's reading of a Qwen3 config.json: (config, its rotary embedding)."""
    tr = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
    c = tr.Qwen3Config.from_dict(json.loads(json.dumps(cfg)))
    return c, Qwen3RotaryEmbedding(c)


def assert_reads_like_transformers(cfg: dict, info: dict):
    c, rot = hf_reading(cfg)
    n_sliding = sum(t == "sliding_attention" for t in c.layer_types)
    assert info["n_sliding_layers"] == n_sliding
    assert info["sliding_window"] == (c.sliding_window or 0)
    assert info["rope_type"] == c.rope_parameters["rope_type"]
    assert info["rope_theta"] == pytest.approx(c.rope_parameters["rope_theta"], rel=1e-7)
    assert info["rope_attention_factor"] == pytest.approx(rot.attention_scaling, rel=1e-6)
    if info["rope_type"] != "default":
        assert info["rope_factor"] == pytest.approx(c.rope_parameters["factor"], rel=1e-7)


# ---------------------------------------------------------------- the reader vs transformers (no weights)

@pytest.mark.parametrize("form", sorted(FORMS))
def test_rope_forms_read_like_transformers(tmp_path, form):
    d = make_tiny_draft(tmp_path / form, **FORMS[form])
    cfg = json.loads((d / "config.json").read_text())
    info = draft_config_info(d)
    assert_reads_like_transformers(cfg, info)
    assert info == draft_config_info(d / "config.json")  # the file itself names the drafter too


SLIDING = {
    # explicit layer_types, window only with use_sliding_window
    "types+window": dict(layer_types=["sliding_attention", "full_attention"], use_sliding_window=True,
                         sliding_window=8),
    "types, window key absent": dict(layer_types=["sliding_attention", "full_attention"], use_sliding_window=True,
                                     sliding_window=DROP),
    # derived: layers from max_window_layers on slide when there is a window
    "derived": dict(layer_types=DROP, use_sliding_window=True, sliding_window=8, max_window_layers=1),
    "derived, default max_window_layers": dict(layer_types=DROP, use_sliding_window=True, sliding_window=8,
                                               max_window_layers=DROP),
    "derived, no window": dict(layer_types=DROP, use_sliding_window=True, sliding_window=None, max_window_layers=0),
    "derived, off": dict(layer_types=DROP, use_sliding_window=False, sliding_window=8, max_window_layers=0),
}


@pytest.mark.parametrize("case", sorted(SLIDING))
def test_sliding_layers_read_like_transformers(tmp_path, case):
    d = make_tiny_draft(tmp_path / "d", n_layers=2, **SLIDING[case])
    cfg = json.loads((d / "config.json").read_text())
    assert_reads_like_transformers(cfg, draft_config_info(d))


@pytest.mark.parametrize("overrides, why", [
    (dict(use_sliding_window=False, sliding_window=8), "'use_sliding_window' is false"),
    (dict(use_sliding_window=True, sliding_window=None), "'sliding_window' is null"),
])
def test_sliding_layer_without_a_window_is_refused(tmp_path, overrides, why):
    # transformers drops the window (use_sliding_window false) or has none: its sliding cache cannot be built
    d = make_tiny_draft(tmp_path / "d", n_layers=2, layer_types=["full_attention", "sliding_attention"], **overrides)
    with pytest.raises(DFlashError, match="layer_types\\[1\\] is sliding_attention but there is no window"):
        draft_config_info(d)
    with pytest.raises(DFlashError, match=why):
        draft_config_info(d)


def test_dflash_keys_at_top_level(tmp_path):
    cfg = json.loads((make_tiny_draft(tmp_path / "a", n_layers=2) / "config.json").read_text())
    flat = {**{k: v for k, v in cfg.items() if k != "dflash_config"}, **cfg["dflash_config"], "block_size": 8}
    info = draft_config_info(write_draft(tmp_path / "b", flat))
    assert (info["block_size"], info["mask_token_id"]) == (8, cfg["dflash_config"]["mask_token_id"])
    assert info["target_layer_ids"] == cfg["dflash_config"]["target_layer_ids"]


# ---------------------------------------------------------------- malformed rope blocks: one line naming the key

BAD = {
    "factor zero": (dict(rope_parameters={"rope_type": "yarn", "factor": 0, "original_max_position_embeddings": 32}),
                    "config key 'rope_parameters.factor' must be positive, found 0"),
    "factor negative": (dict(rope_scaling={"type": "linear", "factor": -2.0}),
                        "config key 'rope_scaling.factor' must be positive, found -2"),
    "factor missing": (dict(rope_parameters={"rope_type": "linear"}),
                       "config key 'rope_parameters.factor' is missing (required for linear RoPE)"),
    "yarn without original": (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}),
                              "config key 'rope_parameters.original_max_position_embeddings' is missing"),
    "unknown type": (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}),
                     "config key 'rope_parameters.rope_type' is 'dynamic': this RoPE type is not supported"),
    "unknown legacy type": (dict(rope_scaling={"type": "longrope", "factor": 2.0}),
                            "config key 'rope_scaling.type' is 'longrope'"),
    "not an object": (dict(rope_parameters=[10000.0]),
                      "config key 'rope_parameters' should be an object or null, found array"),
    "scaling a string": (dict(rope_scaling="yarn"), "config key 'rope_scaling' should be an object or null, found string"),
    "type not a string": (dict(rope_parameters={"rope_type": 3}),
                          "config key 'rope_parameters.rope_type' should be a string, found number"),
    "theta negative": (dict(rope_parameters={"rope_type": "default", "rope_theta": -5}),
                       "config key 'rope_parameters.rope_theta' must be positive"),
    "top theta zero": (dict(rope_theta=0, rope_scaling=None), "config key 'rope_theta' must be positive"),
    "per layer type": (dict(rope_parameters={"full_attention": {"rope_type": "default"},
                                             "sliding_attention": {"rope_type": "default"}}),
                       "config key 'rope_parameters' holds per-layer-type parameters"),
    "partial rotary": (dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}),
                       "config key 'rope_parameters.partial_rotary_factor' is 0.5"),
    "truncate not bool": (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0,
                                                "original_max_position_embeddings": 32, "truncate": "yes"}),
                          "config key 'rope_parameters.truncate' should be true or false"),
}


@pytest.fixture(scope="module")
def target(synth_gguf):
    return synth_gguf("f32")


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_rope_python(tmp_path, target, case):
    overrides, fragment = BAD[case]
    d = make_tiny_draft(tmp_path / "d", **overrides)
    for load in (lambda: draft_config_info(d), lambda: Decoder(target, d, threads=1)):
        with pytest.raises(DFlashError) as ei:
            load()
        msg = str(ei.value)
        assert fragment in msg and "config.json" in msg and "\n" not in msg, msg


@pytest.mark.parametrize("case", ["factor zero", "yarn without original", "unknown type", "not an object"])
def test_malformed_rope_cli(tmp_path, target, case):
    overrides, fragment = BAD[case]
    d = make_tiny_draft(tmp_path / "d", **overrides)
    r = subprocess.run([sys.executable, "-m", "dflash27b.cli", "generate", "-m", str(target), "-md", str(d), "hi",
                        "-n", "2"], capture_output=True, text=True)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert fragment in lines[0], lines[0]


def test_gguf_target_with_rope_scaling_is_refused(target, tmp_path):
    from gguf import GGUFValueType as V
    from test_errors import rewrite
    bad = rewrite(target, tmp_path / "yarn.gguf", extra_kv=[("qwen35.rope.scaling.type", "yarn", V.STRING, None),
                                                            ("qwen35.rope.scaling.factor", 4.0, V.FLOAT32, None)])
    with pytest.raises(DFlashError, match=r"rope scaling is not supported for qwen35 targets "
                                          r"\(qwen35.rope.scaling.type 'yarn', factor 4\)"):
        Decoder(bad, threads=1)
    # explicit "none" is what llama.cpp writes for unscaled files: accepted
    ok = rewrite(target, tmp_path / "none.gguf", extra_kv=[("qwen35.rope.scaling.type", "none", V.STRING, None)])
    Decoder(ok, threads=1).close()


# ---------------------------------------------------------------- published configs

@pytest.mark.parametrize("name", PUBLISHED)
def test_published_config_loads_and_decodes(tmp_path, target, name, ar_tokens_synth):
    cfg = published_config(name)
    d = write_draft(tmp_path / name, cfg, seed=5, dtype="bf16")
    info = draft_config_info(d)
    assert_reads_like_transformers(cfg, info)
    prompt = [5, 17, 300, 1200, 41, 7, 99, 1500]
    with Decoder(target, d, threads=2) as dec:
        assert dec.draft_info == {**info, "weight_bytes": dec.draft_info["weight_bytes"]}
        for mode in ("chain", "ddtree"):
            got = dec.generate(prompt, 24, ignore_eos=True, mode=mode)
            assert got.tokens == ar_tokens_synth(prompt, 24), mode


@pytest.fixture(scope="module")
def ar_tokens_synth(target):
    cache: dict = {}

    def get(prompt, n):
        key = (tuple(prompt), n)
        if key not in cache:
            with Decoder(target, threads=2) as d:
                cache[key] = d.generate(list(prompt), n, ignore_eos=True, mode="ar").tokens
        return cache[key]

    return get


def test_models_lists_published_drafters(tmp_path, target):
    root = tmp_path / "models"
    (root / "local").mkdir(parents=True)
    shutil.copy(target, root / "local" / "tiny-f32.gguf")
    for name in PUBLISHED:
        cfg = published_config(name)
        write_draft(root / "z-lab" / name, cfg)
    bad = make_tiny_draft(root / "z-lab" / "broken", **BAD["unknown type"][0])
    env = dict(os.environ, DFLASH27B_MODELS=str(root), HF_HUB_CACHE=str(tmp_path / "no-hub"))
    r = subprocess.run([sys.executable, "-m", "dflash27b.cli", "models", "--json"], capture_output=True, text=True,
                       env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    drafts = {Path(d["path"]).name: d for d in out["drafters"]}
    assert set(drafts) == set(PUBLISHED) | {"broken"}
    assert "'rope_parameters.rope_type' is 'dynamic'" in drafts["broken"]["error"]
    for name in PUBLISHED:
        assert drafts[name]["error"] == "" and drafts[name]["block_size"] == 16
    (tgt,) = out["targets"]
    assert sorted(Path(x).name for x in tgt["drafters"]) == sorted(PUBLISHED)
    assert drafts["Qwen3.6-35B-A3B-DFlash-yarn"]["rope"] == "yarn x64"
    assert drafts["Qwen3.6-27B-DFlash"]["sliding"] == "4/5 layers, window 2048"
    assert bad.is_dir()
    r = subprocess.run([sys.executable, "-m", "dflash27b.cli", "models"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "refused" in r.stdout, r.stdout + r.stderr
