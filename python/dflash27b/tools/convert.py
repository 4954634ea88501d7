"""Convert a transformers Qwen3.5 checkpoint (safetensors) to a `qwen35` GGUF, as llama.cpp's converter does.

Why our own: the engine's tests need HF <-> GGUF pairs made without llama.cpp, and every transform must be
explicit (qwen35.md §2.3): norms +1 (not linear_attn.norm), A_log -> -exp(A_log) in f32, dt_bias rename,
conv squeeze, V-head reorder grouped -> tiled when nk != nv, visual.* dropped, tied embeddings -> no
output.weight.  An MTP head (`mtp.*`, `mtp_num_hidden_layers: 1`) is written as llama.cpp's converter writes
it: one more block (block_count + 1, `nextn_predict_layers` = 1, not recurrent) holding the head's
full-attention layer, and `blk.N.nextn.{eh_proj, enorm, hnorm, shared_head_norm}` from mtp.fc and its
norms (+1 like the others); `--no-mtp` drops it, as there. 1-D tensors and ssm_conv1d stay F32 for every outtype. Tensors are read through a small
memory-mapped safetensors reader (bf16 included, no torch needed) and written in row chunks, so a 27B
checkpoint converts without holding it in RAM.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T

from . import kquant
from .layout import FILE_TYPE, TensorOut, add_qwen35_kv, add_tokenizer_kv, row_chunks, tensor_list, write_gguf

OUTTYPES = {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0}
_ST_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8", "I64": "<i8", "I32": "<i4"}


# ----------------------------------------------------------------------------------------------------------
# safetensors

class SafeTensors:
    """Lazy name -> array access over one or many .safetensors files (bf16 decoded to f32 on read)."""

    def __init__(self, hf_dir: str | Path):
        d = Path(hf_dir)
        index = d / "model.safetensors.index.json"
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
            else sorted(p.name for p in d.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors in {d}")
        self.entries: dict[str, tuple[np.memmap, str, tuple[int, ...], int, int]] = {}
        for fn in files:
            with open(d / fn, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            mm = np.memmap(d / fn, dtype=np.uint8, mode="r")
            for name, e in header.items():
                if name == "__metadata__":
                    continue
                b0, b1 = e["data_offsets"]
                self.entries[name] = (mm, e["dtype"], tuple(e["shape"]), 8 + n + b0, 8 + n + b1)

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][2]

    def raw(self, name: str) -> tuple[np.ndarray, str]:
        mm, dt, shape, o0, o1 = self.entries[name]
        if dt not in _ST_DTYPES:
            raise ValueError(f"{name}: unsupported safetensors dtype {dt}")
        return mm[o0:o1].view(_ST_DTYPES[dt]).reshape(shape), dt

    def get(self, name: str, rows: np.ndarray | slice | None = None) -> np.ndarray:
        """float32 copy of the tensor (or of some rows of it)."""
        a, dt = self.raw(name)
        if rows is not None:
            a = a[rows]
        if dt == "BF16":
            return (a.astype(np.uint32) << 16).view(np.float32)
        return np.asarray(a, dtype=np.float32)


# ----------------------------------------------------------------------------------------------------------
# config

def read_hparams(cfg: Mapping[str, Any], has_lm_head: bool = True, has_mtp: bool = False) -> dict[str, Any]:
    """HF config.json (flat Qwen3_5TextConfig or with `text_config`) -> layout.py hparams.  has_mtp: the
    checkpoint's mtp.* tensors are to be written (the head's layers follow the trunk's, none recurrent)."""
    tc = cfg.get("text_config") or cfg
    rope = dict(tc.get("rope_parameters") or tc.get("rope_scaling") or {})
    nh = tc["num_attention_heads"]
    hd = tc.get("head_dim") or tc["hidden_size"] // nh
    prf = rope.get("partial_rotary_factor", tc.get("partial_rotary_factor", 0.25))
    n_layer = tc["num_hidden_layers"]
    layer_types = tc.get("layer_types")
    interval = tc.get("full_attention_interval")
    if layer_types:
        recurrent = [t == "linear_attention" for t in layer_types]
        if interval is None:
            interval = next((i + 1 for i, r in enumerate(recurrent) if not r), 4)
    else:
        interval = interval or 4
        recurrent = [(i + 1) % interval != 0 for i in range(n_layer)]
    n_mtp = int(tc.get("mtp_num_hidden_layers", cfg.get("mtp_num_hidden_layers", 0)) or 0) if has_mtp else 0
    if n_mtp > 1:
        raise ValueError(f"mtp_num_hidden_layers = {n_mtp}: only a one-layer MTP head (Qwen3.5's) is supported")
    if has_mtp and n_mtp == 0:
        raise ValueError("the checkpoint has mtp.* tensors but config.json sets no mtp_num_hidden_layers "
                         "(set it, or drop the head with --no-mtp)")
    recurrent = list(recurrent) + [False] * n_mtp
    tied = bool(tc.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))) or not has_lm_head
    sections = list(rope.get("mrope_section") or [11, 11, 10])
    return dict(n_layer=n_layer, hidden=tc["hidden_size"], ffn=tc["intermediate_size"], n_head=nh,
                n_head_kv=tc["num_key_value_heads"], head_dim=hd, n_rot=int(hd * prf),
                nk=tc["linear_num_key_heads"], nv=tc["linear_num_value_heads"], dk=tc["linear_key_head_dim"],
                dv=tc["linear_value_head_dim"], conv_kernel=tc["linear_conv_kernel_dim"], vocab=tc["vocab_size"],
                tied=tied, ctx=tc.get("max_position_embeddings", 262144),
                rope_theta=float(rope.get("rope_theta", tc.get("rope_theta", 1e7))),
                eps=float(tc.get("rms_norm_eps", 1e-6)), sections=(sections + [0, 0, 0, 0])[:4],
                interval=interval, recurrent=recurrent, n_mtp=n_mtp)


# ----------------------------------------------------------------------------------------------------------
# tensor mapping and transforms

_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
          "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
          "mlp.down_proj.weight": "ffn_down.weight", "self_attn.q_proj.weight": "attn_q.weight",
          "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
          "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
          "self_attn.k_norm.weight": "attn_k_norm.weight", "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
          "linear_attn.in_proj_z.weight": "attn_gate.weight", "linear_attn.in_proj_b.weight": "ssm_beta.weight",
          "linear_attn.in_proj_a.weight": "ssm_alpha.weight", "linear_attn.conv1d.weight": "ssm_conv1d.weight",
          "linear_attn.dt_bias": "ssm_dt.bias", "linear_attn.A_log": "ssm_a",
          "linear_attn.norm.weight": "ssm_norm.weight", "linear_attn.out_proj.weight": "ssm_out.weight"}


_MTP = {"fc.weight": "nextn.eh_proj.weight", "pre_fc_norm_embedding.weight": "nextn.enorm.weight",
        "pre_fc_norm_hidden.weight": "nextn.hnorm.weight", "norm.weight": "nextn.shared_head_norm.weight"}


def map_names(names: list[str], n_layer: int | None = None) -> dict[str, str]:
    """GGUF name -> HF checkpoint name; drops vision tensors, rejects anything unknown.  MTP tensors map to
    block n_layer (llama.cpp's layout) when n_layer is given, else they are dropped."""
    out = {}
    for hf in names:
        n = hf.replace("model.language_model.", "model.", 1) if hf.startswith("model.language_model.") else hf
        if n.startswith("model.mtp."):
            n = n[len("model."):]
        if n.startswith(("model.visual.", "visual.")) or (n.startswith("mtp.") and n_layer is None):
            continue
        if n.startswith("mtp."):
            rest = n[len("mtp."):]
            m = re.fullmatch(r"layers\.0\.(.+)", rest)
            if m and m.group(1) in _LAYER:
                out[f"blk.{n_layer}.{_LAYER[m.group(1)]}"] = hf
            elif rest in _MTP:
                out[f"blk.{n_layer}.{_MTP[rest]}"] = hf
            else:
                raise ValueError(f"unexpected checkpoint tensor {hf}")
            continue
        if n in _GLOBAL:
            out[_GLOBAL[n]] = hf
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", n)
        if not m or m.group(2) not in _LAYER:
            raise ValueError(f"unexpected checkpoint tensor {hf}")
        out[f"blk.{m.group(1)}.{_LAYER[m.group(2)]}"] = hf
    return out


def v_head_perm(nk: int, nv: int, blk: int) -> np.ndarray:
    """Index map grouped -> tiled: out[j*nk + kh] = in[kh*r + j] for blocks of `blk` (qwen35.md §2.3 item 6)."""
    r = nv // nk
    return np.arange(nv * blk).reshape(nk, r, blk).transpose(1, 0, 2).reshape(-1)


def _plan(gg: str, hp: Mapping[str, Any]) -> tuple[np.ndarray | None, np.ndarray | None, str | None]:
    """(row permutation, column permutation, value op) for one GGUF tensor."""
    nk, nv, dv, ck = hp["nk"], hp["nv"], hp["dv"], hp["nk"] * hp["dk"]
    reorder = nk != nv
    base = gg.split(".", 2)[-1] if gg.startswith("blk.") else gg
    op = "plus1" if base.endswith("norm.weight") and base != "ssm_norm.weight" else None
    if base == "ssm_a":
        op = "neg_exp"
    rows = cols = None
    if reorder:
        if base in ("attn_qkv.weight", "ssm_conv1d.weight"):
            rows = np.concatenate([np.arange(2 * ck), 2 * ck + v_head_perm(nk, nv, dv)])
        elif base == "attn_gate.weight":
            rows = v_head_perm(nk, nv, dv)
        elif base in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_a", "ssm_dt.bias"):
            rows = v_head_perm(nk, nv, 1)
        elif base == "ssm_out.weight":
            cols = v_head_perm(nk, nv, dv)
    return rows, cols, op


def _apply_op(x: np.ndarray, op: str | None) -> np.ndarray:
    if op == "plus1":
        return x + np.float32(1)
    if op == "neg_exp":
        return -np.exp(x.astype(np.float32))
    return x


def _tensor_out(st: SafeTensors, hf: str, gg: str, shape: tuple[int, ...], qtype: T, hp) -> TensorOut:
    rows, cols, op = _plan(gg, hp)
    n_rows = shape[0] if len(shape) == 2 else 1

    def chunks():
        if len(shape) == 1:
            x = st.get(hf).reshape(-1)
            yield _apply_op(x if rows is None else x[rows], op).astype(np.float32)
            return
        for r0, r1 in row_chunks(n_rows, shape[1]):
            x = st.get(hf, slice(r0, r1) if rows is None else rows[r0:r1]).reshape(r1 - r0, shape[1])
            if cols is not None:
                x = x[:, cols]
            yield kquant.quantize(_apply_op(x, op), qtype)
    return TensorOut(gg, shape, qtype, chunks)


# ----------------------------------------------------------------------------------------------------------
# tokenizer

def _tok_content(v: Any) -> str | None:
    return v.get("content") if isinstance(v, dict) else v


def read_tokenizer(hf_dir: str | Path, vocab_size: int, cfg: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """GGUF tokenizer metadata from tokenizer.json + tokenizer_config.json (+ chat_template.jinja)."""
    d = Path(hf_dir)
    tj = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
    tc_path = d / "tokenizer_config.json"
    tcfg = json.loads(tc_path.read_text(encoding="utf-8")) if tc_path.exists() else {}
    model = tj["model"]
    if model.get("type", "BPE") != "BPE":
        raise ValueError("only byte-level BPE tokenizers are supported")
    id_to_tok: dict[int, tuple[str, int]] = {i: (t, 1) for t, i in model["vocab"].items()}
    for a in tj.get("added_tokens", []):
        c = a["content"]
        special = a.get("special", False) or (c.startswith("<|") and c.endswith("|>"))
        id_to_tok[a["id"]] = (c, 3 if special else 4)
    n = max(vocab_size, max(id_to_tok) + 1)
    tokens, types = [], []
    for i in range(n):
        t, ty = id_to_tok.get(i, (f"[PAD{i}]", 5))
        tokens.append(t)
        types.append(ty)
    merges = [m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in model.get("merges", [])]
    ids = {t: i for i, t in enumerate(tokens)}
    eos = ids.get(_tok_content(tcfg.get("eos_token")))
    if eos is None and cfg is not None:
        e = (cfg.get("text_config") or cfg).get("eos_token_id", cfg.get("eos_token_id"))
        eos = e[0] if isinstance(e, list) else e
    template = tcfg.get("chat_template")
    if isinstance(template, list):
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is None and (d / "chat_template.jinja").exists():
        template = (d / "chat_template.jinja").read_text(encoding="utf-8")
    if template is None and (d / "chat_template.json").exists():
        template = json.loads((d / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen35", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.eos_token_id": eos,
            "tokenizer.ggml.padding_token_id": ids.get(_tok_content(tcfg.get("pad_token"))),
            "tokenizer.ggml.bos_token_id": ids.get(_tok_content(tcfg.get("bos_token"))),
            "tokenizer.chat_template": template}
    if "add_bos_token" in tcfg:
        meta["tokenizer.ggml.add_bos_token"] = bool(tcfg["add_bos_token"])
    return meta


# ----------------------------------------------------------------------------------------------------------

def convert_hf_to_gguf(hf_dir: str | Path, out_path: str | Path, outtype: str = "f32", mtp: bool = True) -> Path:
    """mtp: write the checkpoint's MTP head, when it has one (False: drop it, llama.cpp's --no-mtp)."""
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {sorted(OUTTYPES)}")
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    _check_output(hf_dir, out_path)
    cfg = json.loads((hf_dir / "config.json").read_text())
    st = SafeTensors(hf_dir)
    has_mtp = mtp and any(n.startswith(("mtp.", "model.mtp.")) for n in st.names())
    n_layer = (cfg.get("text_config") or cfg)["num_hidden_layers"]
    name_map = map_names(st.names(), n_layer if has_mtp else None)
    hp = read_hparams(cfg, has_lm_head="output.weight" in name_map, has_mtp=has_mtp)
    if hp["nv"] % hp["nk"]:
        raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    if hp["tied"]:
        name_map.pop("output.weight", None)
    tok = read_tokenizer(hf_dir, hp["vocab"], cfg)
    qt = OUTTYPES[outtype]
    outs = []
    for gg, shape in tensor_list(hp):
        if gg not in name_map:
            raise ValueError(f"checkpoint lacks the tensor for {gg}")
        hf = name_map.pop(gg)
        if int(np.prod(st.shape(hf))) != int(np.prod(shape)):
            raise ValueError(f"{hf}: shape {st.shape(hf)} does not fit {gg} {shape}")
        keep_f32 = len(shape) == 1 or gg.endswith("ssm_conv1d.weight")
        outs.append(_tensor_out(st, hf, gg, shape, T.F32 if keep_f32 else qt, hp))
    if name_map:
        raise ValueError(f"unused checkpoint tensors: {sorted(name_map.values())[:5]}")

    def add_kv(w):
        add_qwen35_kv(w, hp, FILE_TYPE[outtype], name=hf_dir.name)
        add_tokenizer_kv(w, tok)

    # written beside the output, then renamed over it: a failed or interrupted conversion leaves no half file,
    # and the checkpoint's mapped weights are never overwritten while they are read
    part = out_path.with_name(f".{out_path.name}.part-{os.getpid()}")
    try:
        write_gguf(part, add_kv, outs)
        os.replace(part, out_path)
    finally:
        part.unlink(missing_ok=True)
    return out_path


def _check_output(hf_dir: Path, out_path: Path) -> None:
    """The output may not be one of the checkpoint's own files (its weights were being overwritten while mapped
    for reading: a bus error and a truncated checkpoint), nor anything but a regular file."""
    if out_path.is_dir():
        raise ValueError(f"{out_path} is a directory: give the GGUF file to write")
    if out_path.exists() and not out_path.is_file():
        raise ValueError(f"{out_path} is not a regular file: give the GGUF file to write")
    if out_path.exists() and hf_dir.is_dir() and out_path.resolve().parent == hf_dir.resolve() \
            and out_path.suffix.lower() != ".gguf":
        raise ValueError(f"{out_path} is a file of the checkpoint being converted: write the GGUF elsewhere "
                         "(or name it *.gguf)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="convert a HF Qwen3.5 checkpoint to a qwen35 GGUF")
    ap.add_argument("hf_dir")
    ap.add_argument("out")
    ap.add_argument("--outtype", default="f32", choices=sorted(OUTTYPES))
    ap.add_argument("--no-mtp", action="store_true", help="drop the checkpoint's MTP head (mtp.*)")
    a = ap.parse_args(argv)
    p = convert_hf_to_gguf(a.hf_dir, a.out, a.outtype, mtp=not a.no_mtp)
    print(f"wrote {p} ({p.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
