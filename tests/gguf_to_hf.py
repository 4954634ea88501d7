"""Test helper (not a test): a qwen35 GGUF (F32 / F16 / BF16 tensors) written back as a transformers
checkpoint, MTP head included — the inverse of the converter's transforms (dflash27b.tools.convert: names,
norms +1, A_log -> -exp(A_log), the V-head reorder), so the bundled target with its trained head can be
handed to llama.cpp's own converter and to transformers.

`export_hf(gguf_path, out_dir)` writes config.json (Qwen3_5TextConfig, `mtp_num_hidden_layers` when the file
has a head), model.safetensors (float32; `mtp.*` beside the trunk as Qwen3.5 checkpoints hold them) and the
tokenizer files of the models made here (tools/hf_files.py).  Values round-trip: a norm stored as 1 + w
gives back w = x - 1 exactly (x within [0.5, 2]); A_log = log(-A) is the one value that may move by an ulp
through exp, the same for every converter and for transformers, which all recompute exp from it.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dflash27b.tools.convert import _GLOBAL, _LAYER, _MTP, _plan
from dflash27b.tools.hf_files import write_tokenizer_files

_INV_GLOBAL = {v: k for k, v in _GLOBAL.items()}
_INV_LAYER = {v: k for k, v in _LAYER.items()}
_INV_MTP = {v: k for k, v in _MTP.items()}


def _hf_name(gg: str, n_layer: int) -> str:
    if gg in _INV_GLOBAL:
        return _INV_GLOBAL[gg]
    _, i, rest = gg.split(".", 2)
    if int(i) < n_layer:
        return f"model.layers.{i}.{_INV_LAYER[rest]}"
    return f"mtp.{_INV_MTP[rest]}" if rest in _INV_MTP else f"mtp.layers.0.{_INV_LAYER[rest]}"


def export_hf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    import gguf
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    r = gguf.GGUFReader(str(gguf_path))
    meta = {k: f.contents() for k, f in r.fields.items() if k.startswith("qwen35.")}
    g = lambda k: meta[f"qwen35.{k}"]  # noqa: E731
    n_mtp = int(meta.get("qwen35.nextn_predict_layers", 0))
    n_layer = int(g("block_count")) - n_mtp
    tensors = {t.name: t for t in r.tensors}
    vocab = int(tensors["token_embd.weight"].shape[1])
    hd = int(g("attention.key_length"))
    nk, nv, dk = int(g("ssm.group_count")), int(g("ssm.time_step_rank")), int(g("ssm.state_size"))
    dv = int(g("ssm.inner_size")) // nv
    hp = {"nk": nk, "nv": nv, "dk": dk, "dv": dv}
    cfg = dict(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", num_hidden_layers=n_layer,
               hidden_size=int(g("embedding_length")), intermediate_size=int(g("feed_forward_length")),
               num_attention_heads=int(g("attention.head_count")), num_key_value_heads=int(g("attention.head_count_kv")),
               head_dim=hd, linear_num_key_heads=nk, linear_num_value_heads=nv, linear_key_head_dim=dk,
               linear_value_head_dim=dv, linear_conv_kernel_dim=int(g("ssm.conv_kernel")), vocab_size=vocab,
               max_position_embeddings=int(g("context_length")), rms_norm_eps=float(g("attention.layer_norm_rms_epsilon")),
               tie_word_embeddings="output.weight" not in tensors,
               layer_types=["linear_attention" if x else "full_attention" for x in g("attention.recurrent_layers")[:n_layer]],
               rope_parameters=dict(rope_type="default", rope_theta=float(g("rope.freq_base")),
                                    partial_rotary_factor=int(g("rope.dimension_count")) / hd,
                                    mrope_section=[int(x) for x in g("rope.dimension_sections")[:3]],
                                    mrope_interleaved=True), torch_dtype="float32")
    if n_mtp:
        cfg["mtp_num_hidden_layers"] = n_mtp
    st = {}
    for gg, t in tensors.items():
        x = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape([int(d) for d in reversed(t.shape)])
        rows, cols, op = _plan(gg, hp)
        if op == "plus1":
            x = x - np.float32(1)
        elif op == "neg_exp":
            x = np.log(-x.astype(np.float64)).astype(np.float32)
        y = np.empty_like(x)
        if rows is not None:
            y[rows] = x
        elif cols is not None:
            y[:, cols] = x
        else:
            y = x
        name = _hf_name(gg, n_layer)
        if gg.endswith("ssm_conv1d.weight"):
            y = y.reshape(y.shape[0], 1, y.shape[1])
        st[name] = np.ascontiguousarray(y)
    save_file(st, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    write_tokenizer_files(out, vocab)
    return out
