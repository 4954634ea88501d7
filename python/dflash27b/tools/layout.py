"""The qwen35 GGUF layout shared by the converter and the synthetic-model writer.

Why one module: tensor names/shapes (qwen35.md §2.2), metadata keys (§2.1) and the streaming write path must be
identical whether weights come from a HF checkpoint or a random generator. Hyper-parameters travel as a plain
dict (`HParams` keys below); `tensor_list` gives every tensor in llama-quantize's loader order (non-`blk` names
first, then by layer number, then by name), which is also the order the §6 counters follow.
`write_gguf` writes header, KV and tensor infos with `gguf.GGUFWriter`, then streams each tensor's bytes chunk
by chunk, so multi-GB files never sit in memory.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType as VT, GGUFWriter, GGMLQuantizationType as T

from .kquant import row_bytes

ARCH = "qwen35"
FILE_TYPE = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7, "q4_k_s": 14, "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18,
             "bf16": 32}

# HParams keys: n_layer hidden ffn n_head n_head_kv head_dim n_rot nk nv dk dv conv_kernel vocab tied interval
#               ctx rope_theta eps sections(list of 4) recurrent(list[bool], optional)


def is_recurrent(hp: Mapping[str, Any], i: int) -> bool:
    rec = hp.get("recurrent")
    if rec is not None:
        return bool(rec[i])
    return (i + 1) % hp.get("interval", 4) != 0


def tensor_list(hp: Mapping[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, numpy shape) of every tensor; 2-D shapes are (rows=ne1, cols=ne0)."""
    H, F, V = hp["hidden"], hp["ffn"], hp["vocab"]
    ck, cv = hp["nk"] * hp["dk"], hp["nv"] * hp["dv"]
    glob = [("output_norm.weight", (H,)), ("token_embd.weight", (V, H))]
    if not hp["tied"]:
        glob.append(("output.weight", (V, H)))
    out = sorted(glob)
    n_mtp = hp.get("n_mtp", 0)
    for i in range(hp["n_layer"] + n_mtp):
        t = {"attn_norm.weight": (H,), "post_attention_norm.weight": (H,),
             "ffn_gate.weight": (F, H), "ffn_up.weight": (F, H), "ffn_down.weight": (H, F)}
        if is_recurrent(hp, i):
            t.update({"attn_qkv.weight": (2 * ck + cv, H), "attn_gate.weight": (cv, H),
                      "ssm_beta.weight": (hp["nv"], H), "ssm_alpha.weight": (hp["nv"], H),
                      "ssm_conv1d.weight": (2 * ck + cv, hp["conv_kernel"]), "ssm_dt.bias": (hp["nv"],),
                      "ssm_a": (hp["nv"],), "ssm_norm.weight": (hp["dv"],), "ssm_out.weight": (H, cv)})
        else:
            nh, nkv, hd = hp["n_head"], hp["n_head_kv"], hp["head_dim"]
            t.update({"attn_q.weight": (2 * nh * hd, H), "attn_k.weight": (nkv * hd, H),
                      "attn_v.weight": (nkv * hd, H), "attn_output.weight": (H, nh * hd),
                      "attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,)})
        if i >= hp["n_layer"]:  # the MTP head's block (llama.cpp's layout): its fusion and final norm
            t.update({"nextn.eh_proj.weight": (H, 2 * H), "nextn.enorm.weight": (H,), "nextn.hnorm.weight": (H,),
                      "nextn.shared_head_norm.weight": (H,)})
        out += [(f"blk.{i}.{k}", s) for k, s in sorted(t.items())]
    return out


def layer_of(name: str) -> int:
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def add_qwen35_kv(w: GGUFWriter, hp: Mapping[str, Any], file_type: int, name: str = "qwen35") -> None:
    a = ARCH
    w.add_string("general.type", "model")
    w.add_string("general.name", name)
    n_mtp = hp.get("n_mtp", 0)
    w.add_uint32(f"{a}.block_count", hp["n_layer"] + n_mtp)
    if n_mtp:
        w.add_uint32(f"{a}.nextn_predict_layers", n_mtp)
    w.add_uint32(f"{a}.context_length", hp["ctx"])
    w.add_uint32(f"{a}.embedding_length", hp["hidden"])
    w.add_uint32(f"{a}.feed_forward_length", hp["ffn"])
    w.add_uint32(f"{a}.attention.head_count", hp["n_head"])
    w.add_uint32(f"{a}.attention.head_count_kv", hp["n_head_kv"])
    w.add_uint32(f"{a}.attention.key_length", hp["head_dim"])
    w.add_uint32(f"{a}.attention.value_length", hp["head_dim"])
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", hp["eps"])
    w.add_float32(f"{a}.rope.freq_base", hp["rope_theta"])
    w.add_uint32(f"{a}.rope.dimension_count", hp["n_rot"])
    secs = [int(s) for s in hp["sections"]][:4]
    w.add_key_value(f"{a}.rope.dimension_sections", secs + [0] * (4 - len(secs)), VT.ARRAY, sub_type=VT.INT32)
    w.add_uint32(f"{a}.ssm.conv_kernel", hp["conv_kernel"])
    w.add_uint32(f"{a}.ssm.state_size", hp["dk"])
    w.add_uint32(f"{a}.ssm.group_count", hp["nk"])
    w.add_uint32(f"{a}.ssm.time_step_rank", hp["nv"])
    w.add_uint32(f"{a}.ssm.inner_size", hp["nv"] * hp["dv"])
    w.add_uint32(f"{a}.full_attention_interval", hp["interval"])
    w.add_key_value(f"{a}.attention.recurrent_layers", [is_recurrent(hp, i) for i in range(hp["n_layer"] + n_mtp)],
                    VT.ARRAY, sub_type=VT.BOOL)
    w.add_uint32("general.file_type", file_type)
    w.add_uint32("general.quantization_version", 2)


def add_tokenizer_kv(w: GGUFWriter, tok: Mapping[str, Any]) -> None:
    """tok: GGUF tokenizer keys (`tokenizer.ggml.tokens`, ...). Arrays get explicit element types."""
    arrays = {"tokenizer.ggml.tokens": VT.STRING, "tokenizer.ggml.merges": VT.STRING,
              "tokenizer.ggml.token_type": VT.INT32}
    u32 = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.padding_token_id")
    for k, v in tok.items():
        if v is None:
            continue
        if k in arrays:
            if len(v):
                w.add_key_value(k, list(v), VT.ARRAY, sub_type=arrays[k])
        elif k in u32:
            w.add_uint32(k, int(v))
        elif isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, str):
            w.add_string(k, v)
        else:
            raise TypeError(f"unsupported tokenizer key {k}={type(v)}")


@dataclass
class TensorOut:
    """One tensor to write: numpy shape (rows, cols) / (n,), ggml type, and a producer of its encoded bytes.
    `chunks()` yields uint8/any arrays whose bytes, concatenated, are the tensor data in row order."""
    name: str
    shape: tuple[int, ...]
    qtype: T
    chunks: Callable[[], Iterable[np.ndarray]]

    @property
    def nbytes(self) -> int:
        rows = int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else 1
        return rows * row_bytes(self.qtype, self.shape[-1])


def write_gguf(path: str | Path, add_kv: Callable[[GGUFWriter], None], tensors: list[TensorOut],
               sparse: bool = False) -> None:
    """sparse: leave every tensor's data a hole in the file (zero bytes, no disk used): the exact layout of
    the model with all-zero weights, for plans and loaders of large shapes."""
    w = GGUFWriter(str(path), ARCH)
    add_kv(w)
    for t in tensors:
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    align = w.data_alignment
    try:
        if sparse:
            end = fout.tell()
            for t in tensors:
                end += -end % align
                end += t.nbytes + (-t.nbytes % align)
            fout.truncate(end)
            return
        for t in tensors:
            fout.write(b"\0" * (-fout.tell() % align))
            n = 0
            for c in t.chunks():
                b = np.ascontiguousarray(c).view(np.uint8)
                fout.write(b.data)
                n += b.nbytes
            if n != t.nbytes:
                raise ValueError(f"{t.name}: wrote {n} bytes, expected {t.nbytes}")
            fout.write(b"\0" * (-n % align))
    finally:
        w.close()


def row_chunks(n_rows: int, n_cols: int, target_elems: int = 1 << 24) -> Iterator[tuple[int, int]]:
    step = max(1, target_elems // max(1, n_cols))
    for r0 in range(0, n_rows, step):
        yield r0, min(n_rows, r0 + step)
