"""dflash27b.tools.convert on the tiny transformers checkpoint.

Every GGUF tensor is mapped back to HF with an independently written inverse (explicit per-head loops for
the V-head reorder, qwen35.md §2.3) and compared with the safetensors file read by the `safetensors`
package; metadata is compared key by key; f16/bf16/q8_0 outputs must dequantize close to the f32 file.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T, GGUFReader
from gguf import quants as gq

from dflash27b.tools.convert import convert_hf_to_gguf, main

pytest.importorskip("torch")
safetensors_np = pytest.importorskip("safetensors.numpy")

HF_OF = {  # GGUF per-layer suffix -> HF suffix
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight", "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight", "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight", "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight", "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias", "ssm_a": "linear_attn.A_log", "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight"}
GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
          "output.weight": "lm_head.weight"}


def hf_name(gg: str) -> str:
    if gg in GLOBAL:
        return GLOBAL[gg]
    _, i, rest = gg.split(".", 2)
    return f"model.layers.{i}.{HF_OF[rest]}"


def untile(a: np.ndarray, nk: int, nv: int, blk: int, axis: int) -> np.ndarray:
    """GGUF tiled value-head order -> HF grouped order, one head block at a time."""
    r = nv // nk
    a = np.moveaxis(a, axis, 0)
    out = np.empty_like(a)
    for h_gg in range(nv):
        j, kh = divmod(h_gg, nk)          # h_gg = j*nk + kh
        h_hf = kh * r + j
        out[h_hf * blk:(h_hf + 1) * blk] = a[h_gg * blk:(h_gg + 1) * blk]
    return np.moveaxis(out, 0, axis)


def to_hf(gg: str, x: np.ndarray, cfg: dict) -> np.ndarray:
    """Inverse of the converter transform for one tensor (x in numpy (ne1, ne0) shape)."""
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    base = gg.split(".", 2)[-1] if gg.startswith("blk.") else gg
    x = x.astype(np.float64)
    if base.endswith("norm.weight") and base != "ssm_norm.weight":
        x = x - 1
    if base == "ssm_a":
        x = np.log(-x)
    if nk != nv:
        if base in ("attn_qkv.weight", "ssm_conv1d.weight"):
            x = np.concatenate([x[:2 * nk * dk], untile(x[2 * nk * dk:], nk, nv, dv, 0)])
        elif base == "attn_gate.weight":
            x = untile(x, nk, nv, dv, 0)
        elif base in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_a", "ssm_dt.bias"):
            x = untile(x, nk, nv, 1, 0)
        elif base == "ssm_out.weight":
            x = untile(x, nk, nv, dv, 1)
    if base == "ssm_conv1d.weight":
        x = x[:, None, :]
    return x


def gguf_tensors(path) -> dict[str, tuple[T, np.ndarray]]:
    r = GGUFReader(path)
    out = {}
    for t in r.tensors:
        shape = tuple(int(v) for v in reversed(t.shape))
        out[t.name] = (t.tensor_type, gq.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape))
    return out


def field(r: GGUFReader, key: str):
    return r.fields[key].contents()


@pytest.fixture(scope="module")
def hf(tiny_hf_dir):
    cfg = json.loads((tiny_hf_dir / "config.json").read_text())
    return cfg, safetensors_np.load_file(str(tiny_hf_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def f32_path(tiny_hf_dir, tmp_path_factory):
    return convert_hf_to_gguf(tiny_hf_dir, tmp_path_factory.mktemp("cv") / "f32.gguf", "f32")


def test_every_tensor_inverts_to_hf(hf, f32_path):
    cfg, st = hf
    tensors = gguf_tensors(f32_path)
    assert len(tensors) == 3 + 6 * 14 + 2 * 11 == 109
    assert {hf_name(n) for n in tensors} == set(st)
    for name, (qt, x) in tensors.items():
        assert qt == T.F32, name
        ref = st[hf_name(name)]
        back = to_hf(name, x, cfg)
        assert back.shape == ref.shape, name
        tol = 1e-6 if name.endswith("ssm_a") else 0.0
        np.testing.assert_allclose(back, ref, rtol=tol, atol=tol, err_msg=name)


def test_documented_values(hf, f32_path):
    cfg, st = hf
    t = gguf_tensors(f32_path)
    a_log = st["model.layers.0.linear_attn.A_log"]
    ssm_a = t["blk.0.ssm_a"][1]
    assert (ssm_a < 0).all()
    np.testing.assert_allclose(np.sort(ssm_a), np.sort(-np.exp(a_log.astype(np.float32))), rtol=1e-7)
    np.testing.assert_array_equal(t["output_norm.weight"][1], st["model.norm.weight"] + 1)
    np.testing.assert_array_equal(t["blk.3.attn_q_norm.weight"][1], st["model.layers.3.self_attn.q_norm.weight"] + 1)
    np.testing.assert_array_equal(t["blk.0.ssm_norm.weight"][1], st["model.layers.0.linear_attn.norm.weight"])
    # the reorder really moves heads (nk=2, nv=4): GGUF head 1 is HF head 2
    dv = cfg["linear_value_head_dim"]
    np.testing.assert_array_equal(t["blk.0.attn_gate.weight"][1][dv:2 * dv],
                                  st["model.layers.0.linear_attn.in_proj_z.weight"][2 * dv:3 * dv])


def test_metadata(f32_path):
    r = GGUFReader(f32_path)
    expect = {"general.architecture": "qwen35", "qwen35.block_count": 8, "qwen35.context_length": 4096,
              "qwen35.embedding_length": 256, "qwen35.feed_forward_length": 512,
              "qwen35.attention.head_count": 4, "qwen35.attention.head_count_kv": 2,
              "qwen35.attention.key_length": 64, "qwen35.attention.value_length": 64,
              "qwen35.rope.dimension_count": 16, "qwen35.rope.dimension_sections": [3, 3, 2, 0],
              "qwen35.ssm.conv_kernel": 4, "qwen35.ssm.state_size": 64, "qwen35.ssm.group_count": 2,
              "qwen35.ssm.time_step_rank": 4, "qwen35.ssm.inner_size": 256, "qwen35.full_attention_interval": 4,
              "qwen35.attention.recurrent_layers": [True, True, True, False] * 2,
              "general.file_type": 0, "general.quantization_version": 2, "tokenizer.ggml.model": "gpt2",
              "tokenizer.ggml.pre": "qwen35", "tokenizer.ggml.eos_token_id": 2047,
              "tokenizer.ggml.padding_token_id": 2045, "tokenizer.ggml.add_bos_token": False}
    for k, v in expect.items():
        assert field(r, k) == v, k
    assert field(r, "qwen35.rope.freq_base") == pytest.approx(1e7)
    assert field(r, "qwen35.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)
    assert r.fields["qwen35.rope.dimension_sections"].types[-1].name == "INT32"
    toks, types = field(r, "tokenizer.ggml.tokens"), field(r, "tokenizer.ggml.token_type")
    assert len(toks) == len(types) == 2048
    assert toks[2045:] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] and types[2045:] == [3, 3, 3]
    assert toks[0] == "!" and set(types[:2045]) == {1}
    assert len(field(r, "tokenizer.ggml.merges")) == 2045 - 256
    assert "<|im_start|>" in field(r, "tokenizer.chat_template")
    assert "bos_token_id" not in " ".join(r.fields)


@pytest.mark.parametrize("outtype,ftype,qt,tol", [("f16", 1, T.F16, 2e-3), ("bf16", 32, T.BF16, 0.0),
                                                  ("q8_0", 7, T.Q8_0, 1e-2)])
def test_outtypes_close_to_f32(tiny_hf_dir, f32_path, tmp_path, outtype, ftype, qt, tol):
    out = convert_hf_to_gguf(tiny_hf_dir, tmp_path / f"{outtype}.gguf", outtype)
    assert field(GGUFReader(out), "general.file_type") == ftype
    ref, got = gguf_tensors(f32_path), gguf_tensors(out)
    for name, (t, x) in got.items():
        keep = x.ndim == 1 or "ssm_conv1d" in name
        assert t == (T.F32 if keep else qt), name
        r = ref[name][1]
        err = np.abs(x - r).max() / max(np.abs(r).max(), 1e-12)
        assert err <= (0 if keep else tol), (name, err)      # bf16 is exact: weights are bf16-representable


def test_nested_config_prefix_shards_tied(tiny_hf_dir, tmp_path):
    """Multimodal-style checkpoint: text_config, model.language_model.*, visual/mtp tensors (--no-mtp), two shards,
    rope given the old way (no mrope_section -> [11,11,10,0]); tied embeddings drop lm_head."""
    cfg = json.loads((tiny_hf_dir / "config.json").read_text())
    st = safetensors_np.load_file(str(tiny_hf_dir / "model.safetensors"))
    rope = cfg.pop("rope_parameters")
    text = dict(cfg, rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"],
                tie_word_embeddings=True, full_attention_interval=4)
    text.pop("layer_types")
    d = tmp_path / "mm"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": text,
                                               "tie_word_embeddings": True}))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).write_bytes((tiny_hf_dir / f).read_bytes())
    renamed = {("model.language_model." + k[6:] if k.startswith("model.") else k): v for k, v in st.items()
               if k != "lm_head.weight"}
    renamed["model.visual.blocks.0.weight"] = np.zeros((4, 4), np.float32)
    renamed["mtp.fc.weight"] = np.zeros((4, 4), np.float32)
    keys = sorted(renamed)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for fn, ks in shards.items():
        safetensors_np.save_file({k: renamed[k] for k in ks}, str(d / fn))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: fn for fn, ks in shards.items() for k in ks}}))
    out = tmp_path / "mm.gguf"
    with pytest.raises(ValueError, match="mtp.* tensors but config.json sets no mtp_num_hidden_layers"):
        main([str(d), str(out), "--outtype", "f32"])   # a head is written unless --no-mtp says otherwise
    main([str(d), str(out), "--outtype", "f32", "--no-mtp"])
    import subprocess
    import sys
    cli_out = tmp_path / "mm-cli.gguf"   # the CLI's convert takes --no-mtp too (docs/USAGE.md names it there)
    r = subprocess.run([sys.executable, "-m", "dflash27b.cli", "convert", str(d), str(cli_out), "--no-mtp"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and cli_out.read_bytes() == out.read_bytes(), r.stderr
    r = GGUFReader(out)
    assert field(r, "qwen35.rope.dimension_sections") == [11, 11, 10, 0]
    assert field(r, "qwen35.rope.dimension_count") == 16
    assert field(r, "qwen35.rope.freq_base") == pytest.approx(1e7)
    got = gguf_tensors(out)
    assert "output.weight" not in got and len(got) == 108
    for name, (_, x) in got.items():
        np.testing.assert_allclose(to_hf(name, x, cfg), st[hf_name(name)],
                                   rtol=1e-6 if name.endswith("ssm_a") else 0, err_msg=name)


def test_no_reorder_when_nk_equals_nv(tmp_path):
    from tiny_hf import make_tiny_hf
    d = make_tiny_hf(tmp_path / "hf", seed=1, num_hidden_layers=4, linear_num_value_heads=2, vocab_size=1024)
    cfg = json.loads((d / "config.json").read_text())
    st = safetensors_np.load_file(str(d / "model.safetensors"))
    got = gguf_tensors(convert_hf_to_gguf(d, tmp_path / "eq.gguf", "f32"))
    np.testing.assert_array_equal(got["blk.0.attn_qkv.weight"][1], st["model.layers.0.linear_attn.in_proj_qkv.weight"])
    np.testing.assert_array_equal(got["blk.0.ssm_out.weight"][1], st["model.layers.0.linear_attn.out_proj.weight"])
    for name, (_, x) in got.items():
        np.testing.assert_allclose(to_hf(name, x, cfg), st[hf_name(name)],
                                   rtol=1e-6 if name.endswith("ssm_a") else 0, err_msg=name)


def test_numpy_forward_on_gguf_matches_transformers(tiny_hf_dir, f32_path):
    """End-to-end meaning check: the §3 math on the converted weights reproduces transformers' logits."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    import np_qwen35

    ids = np.random.default_rng(5).integers(0, 2000, 12).tolist()
    model = Qwen3_5ForCausalLM.from_pretrained(tiny_hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].double().numpy()
    ours = np_qwen35.forward(*np_qwen35.load(f32_path), ids)
    assert np.abs(ours - ref).max() < 1e-4
