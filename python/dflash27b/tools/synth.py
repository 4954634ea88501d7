"""Synthetic qwen35 GGUF files: the exact layout and per-tensor types of a real model, random weights.

Why: engine tests and benchmarks need files of every shape (tiny .. 27B) and ftype without downloading
anything. Small shapes get float weights from the README "tiny random qwen35 that behaves" recipe
(bf16-representable, then quantized with `kquant`), so quantized runs stay comparable to f32 runs; shapes
over 1B parameters write random K-quant blocks directly (`kquant.random_blocks`), streamed in row chunks.
`type_plan` reproduces llama-quantize's choices (qwen35.md §6: output rule, tied embeddings, the shared
attn_v/attn_qkv counter and `more(i, n)`), so it can be checked on any shape without writing data.
A small byte-level BPE vocab trained on Python stdlib sources (cached per size) rides in the metadata.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T

from . import kquant
from .layout import FILE_TYPE, TensorOut, add_qwen35_kv, add_tokenizer_kv, row_chunks, tensor_list, write_gguf

_COMMON = dict(conv_kernel=4, interval=4, rope_theta=1e7, eps=1e-6)
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(n_layer=8, hidden=256, ffn=512, n_head=4, n_head_kv=2, head_dim=64, n_rot=16, nk=2, nv=4,
                 dk=64, dv=64, vocab=2048, tied=False, ctx=4096, sections=[3, 3, 2, 0], **_COMMON),
    "0.8b": dict(n_layer=24, hidden=1024, ffn=3584, n_head=8, n_head_kv=2, head_dim=256, n_rot=64, nk=16, nv=16,
                 dk=128, dv=128, vocab=248320, tied=True, ctx=262144, sections=[11, 11, 10, 0], **_COMMON),
    "9b": dict(n_layer=32, hidden=4096, ffn=12288, n_head=16, n_head_kv=4, head_dim=256, n_rot=64, nk=16, nv=32,
               dk=128, dv=128, vocab=248320, tied=False, ctx=262144, sections=[11, 11, 10, 0], **_COMMON),
    "27b": dict(n_layer=64, hidden=5120, ffn=17408, n_head=24, n_head_kv=4, head_dim=256, n_rot=64, nk=16, nv=48,
                dk=128, dv=128, vocab=248320, tied=False, ctx=262144, sections=[11, 11, 10, 0], **_COMMON),
}
FTYPES = ("q4_k_m", "q5_k_m", "q6_k", "q8_0", "q4_0", "f16", "bf16", "f32")
_BASE = {"q4_k_m": T.Q4_K, "q5_k_m": T.Q5_K, "q6_k": T.Q6_K, "q8_0": T.Q8_0, "q4_0": T.Q4_0,
         "f16": T.F16, "bf16": T.BF16, "f32": T.F32}
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def resolve_shape(shape: str | Mapping[str, Any]) -> dict[str, Any]:
    """A named shape, or a dict of overrides on top of `base` (default "tiny")."""
    if isinstance(shape, str):
        return dict(SHAPES[shape])
    over = dict(shape)
    hp = dict(SHAPES[over.pop("base", "tiny")])
    hp.update(over)
    return hp


def n_params(hp: Mapping[str, Any]) -> int:
    return sum(int(np.prod(s)) for _, s in tensor_list(hp))


def more_bits(i: int, n: int) -> bool:
    """llama.cpp `use_more_bits`: first/last eighth and every third layer in between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def type_plan(hp: Mapping[str, Any], ftype: str) -> dict[str, T]:
    """ggml type of every tensor (in loader order) for llama-quantize's `ftype` mix (or converter f32/f16/bf16)."""
    if ftype not in FTYPES:
        raise ValueError(f"unknown ftype {ftype!r}; choose from {FTYPES}")
    base = _BASE[ftype]
    tensors = tensor_list(hp)
    n_attn_v = sum(1 for n, _ in tensors if n.endswith(("attn_v.weight", "attn_qkv.weight")))
    mixed = ftype in ("q4_k_m", "q5_k_m")
    i_v = i_down = 0
    plan: dict[str, T] = {}
    for name, shape in tensors:
        if len(shape) < 2 or "ssm_conv1d" in name or "_norm.weight" in name:
            plan[name] = T.F32
            continue
        t = base
        if base in (T.F32, T.F16, T.BF16):
            pass
        elif name == "output.weight" or (hp["tied"] and name == "token_embd.weight"):
            t = T.Q8_0 if base == T.Q8_0 or shape[1] % kquant.GGML_QUANT_SIZES[base][0] else T.Q6_K
        elif name.endswith(("attn_v.weight", "attn_qkv.weight")):
            if mixed and more_bits(i_v, n_attn_v):
                t = T.Q6_K
            i_v += 1
        elif name.endswith("ffn_down.weight"):
            if mixed and more_bits(i_down, hp["n_layer"]):
                t = T.Q6_K
            i_down += 1
        if shape[1] % kquant.GGML_QUANT_SIZES[t][0]:
            if t != T.Q6_K:
                raise ValueError(f"{name}: ne0={shape[1]} does not fit {t.name} (no fallback implemented)")
            t = T.Q8_0                                            # llama.cpp's Q6_K fallback
        plan[name] = t
    return plan


# ----------------------------------------------------------------------------------------------------------
# tokenizer

_TOK_CACHE: dict[int, dict[str, Any]] = {}
_CORPUS = ("typing.py", "argparse.py", "inspect.py", "textwrap.py", "dataclasses.py", "functools.py",
           "pathlib.py", "difflib.py", "json/decoder.py", "json/encoder.py", "collections/__init__.py",
           "random.py", "statistics.py", "string.py", "heapq.py", "fractions.py", "enum.py", "shutil.py",
           "tempfile.py", "subprocess.py")


def corpus_texts() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(root / f).read_text(encoding="utf-8") for f in _CORPUS if (root / f).exists()]


def train_byte_bpe(n_tokens: int) -> tuple[list[str], list[str]]:
    """(tokens, merges): 256 byte symbols in GPT-2 order, then one token per learned merge (<= n_tokens total)."""
    from tokenizers import Regex, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    from ..tokenizer import QWEN35_REGEX, byte_to_unicode

    tok = HFTokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=n_tokens, min_frequency=2, show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_texts(), trainer)
    merges = json.loads(tok.to_str())["model"]["merges"]
    pairs = [tuple(m) if not isinstance(m, str) else tuple(m.split(" ", 1)) for m in merges]
    tokens = sorted(byte_to_unicode().values())              # code-point order == GPT-2 byte order
    for a, b in pairs[: max(0, n_tokens - 256)]:
        tokens.append(a + b)
    return tokens, [f"{a} {b}" for a, b in pairs[: len(tokens) - 256]]


def synth_tokenizer(vocab_size: int) -> dict[str, Any]:
    """GGUF tokenizer metadata: trained tokens, the 3 ChatML control tokens, `[PAD{id}]` fillers (type 5)."""
    if vocab_size in _TOK_CACHE:
        return _TOK_CACHE[vocab_size]
    from ..tokenizer import CHATML_TEMPLATE

    if vocab_size < 256 + len(SPECIALS):
        raise ValueError("vocab too small for a byte-level BPE")
    tokens, merges = train_byte_bpe(vocab_size - len(SPECIALS))
    types = [1] * len(tokens)
    tokens += SPECIALS
    types += [3] * len(SPECIALS)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    types += [5] * (vocab_size - len(types))
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen35", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
            "tokenizer.ggml.padding_token_id": tokens.index("<|endoftext|>"),
            "tokenizer.ggml.add_bos_token": False, "tokenizer.chat_template": CHATML_TEMPLATE}
    _TOK_CACHE[vocab_size] = meta
    return meta


# ----------------------------------------------------------------------------------------------------------
# weights

def round_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest bf16-representable value (ties to even), kept as float32."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    u = (u + (0x7FFF + ((u >> 16) & 1))) & np.uint32(0xFFFF0000)
    return u.view(np.float32)


def weight_std(name: str) -> float:
    if name == "token_embd.weight":
        return 0.5
    if name == "output.weight":
        return 0.1
    if "ssm_conv1d" in name:
        return 0.25
    return 0.03


def vector_init(name: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """1-D tensors in GGUF form (norms already +1, ssm_a = -A)."""
    if name.endswith("ssm_a"):
        return (-rng.uniform(0.02, 1.5, n)).astype(np.float32)
    if name.endswith("ssm_dt.bias"):
        return round_bf16(1 + 0.5 * rng.standard_normal(n))
    return (1 + rng.integers(-4, 5, n) / 128).astype(np.float32)   # norms (GGUF +1 form) and ssm_norm


def _tensor_out(name: str, shape: tuple[int, ...], qtype: T, rng: np.random.Generator, direct: bool) -> TensorOut:
    if len(shape) == 1:
        return TensorOut(name, shape, qtype, lambda: [vector_init(name, shape[0], rng)])
    rows, cols = shape
    std = weight_std(name)
    use_blocks = direct and qtype in (T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.Q4_0)

    def chunks():
        for r0, r1 in row_chunks(rows, cols):
            if use_blocks:
                yield kquant.random_blocks(qtype, r1 - r0, cols, std, rng)
            else:
                x = round_bf16(rng.standard_normal((r1 - r0, cols), dtype=np.float32) * np.float32(std))
                yield kquant.quantize(x, qtype)
    return TensorOut(name, shape, qtype, chunks)


def write_synthetic(out_path: str | Path, shape: str | Mapping[str, Any] = "tiny", ftype: str = "q4_k_m",
                    seed: int = 0, vocab: Mapping[str, Any] | None = None,
                    random_quant: bool | None = None, sparse: bool = False, mtp: bool = False) -> Path:
    """Write a synthetic qwen35 GGUF. `vocab`: GGUF tokenizer keys to embed instead of the trained vocab.
    `random_quant`: write random quant blocks directly (default: when the model has > 1e9 parameters).
    `sparse`: all-zero weights left as holes in the file (the layout alone, for plans and loader tests).
    `mtp`: with an MTP head, as llama.cpp's converter writes one (with_mtp_head)."""
    hp = resolve_shape(shape)
    if mtp:
        hp = with_mtp_head(hp)
    plan = type_plan(hp, ftype)
    tok = dict(vocab) if vocab is not None else synth_tokenizer(hp["vocab"])
    if len(tok["tokenizer.ggml.tokens"]) != hp["vocab"]:
        raise ValueError(f"vocab has {len(tok['tokenizer.ggml.tokens'])} tokens, shape wants {hp['vocab']}")
    direct = n_params(hp) > 1_000_000_000 if random_quant is None else random_quant
    label = shape if isinstance(shape, str) else "custom"
    outs = [_tensor_out(name, s, plan[name], np.random.default_rng([seed, k]), direct)
            for k, (name, s) in enumerate(tensor_list(hp))]

    def add_kv(w):
        add_qwen35_kv(w, hp, FILE_TYPE[ftype], name=f"synthetic-qwen35-{label}")
        add_tokenizer_kv(w, tok)

    out_path = Path(out_path)
    write_gguf(out_path, add_kv, outs, sparse=sparse)
    return out_path


def with_mtp_head(hp: Mapping[str, Any]) -> dict[str, Any]:
    """The shape with a one-layer MTP head after the trunk: one more block, a full-attention one (not
    recurrent) with the nextn tensors, `nextn_predict_layers` = 1 (layout.py writes what llama.cpp's converter
    writes for Qwen3.5's mtp.* weights)."""
    from .layout import is_recurrent
    out = dict(hp)
    out["recurrent"] = [is_recurrent(hp, i) for i in range(hp["n_layer"])] + [False]
    out["n_mtp"] = 1
    return out


def synth_draft_config(shape: str | Mapping[str, Any] = "27b") -> dict[str, Any]:
    """config.json of a DFlash drafter for a target of this shape.  For the 27B shape it is z-lab's
    published Qwen3.5-27B-DFlash (5 full-attention layers, 32/8 heads of 128, ffn 17408, block 16, captured
    layers [1, 16, 31, 46, 61], mask token 248070); other shapes get the same recipe scaled to the target
    (heads of 128 over its width, its ffn; one layer of heads of 64 for the tiny shape)."""
    from .draft_format import build_target_layer_ids, draft_config
    hp = resolve_shape(shape)
    H, L, V = hp["hidden"], hp["n_layer"], hp["vocab"]
    if H == 5120 and L == 64:
        kw = dict(n_layers=5, n_head=32, n_head_kv=8, head_dim=128, ffn=17408, mask_token_id=248070)
    elif H < 1024:
        kw = dict(n_layers=1, n_head=H // 64, n_head_kv=max(1, H // 128), head_dim=64, ffn=hp["ffn"],
                  mask_token_id=V - 3)
    else:
        kw = dict(n_layers=5, n_head=H // 128, n_head_kv=max(1, H // 512), head_dim=128, ffn=hp["ffn"],
                  mask_token_id=V - 250)
    cfg = draft_config(H, L, V, block_size=16, max_position_embeddings=262144, **kw)
    cfg["dflash_config"]["target_layer_ids"] = build_target_layer_ids(L, kw["n_layers"])
    return cfg


def write_synthetic_draft(out_dir: str | Path, shape: str | Mapping[str, Any] = "27b", seed: int = 0,
                          sparse: bool = False) -> Path:
    """A drafter directory (config.json + BF16 model.safetensors, random weights) for `dflash27b synth`'s
    target of the same shape: what the GPU record times the drafter's block step with.  sparse: zero
    weights left as holes (the layout alone)."""
    from .draft_format import write_random_draft
    return write_random_draft(out_dir, synth_draft_config(shape), seed, sparse=sparse)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="write a synthetic qwen35 GGUF")
    ap.add_argument("out")
    ap.add_argument("--shape", default="tiny", help=f"{sorted(SHAPES)} or a JSON dict of overrides")
    ap.add_argument("--ftype", default="q4_k_m", choices=FTYPES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--random-quant", choices=("auto", "yes", "no"), default="auto")
    a = ap.parse_args(argv)
    shape = json.loads(a.shape) if a.shape.lstrip().startswith("{") else a.shape
    rq = {"auto": None, "yes": True, "no": False}[a.random_quant]
    p = write_synthetic(a.out, shape, a.ftype, a.seed, random_quant=rq)
    print(f"wrote {p} ({p.stat().st_size / 1e9:.3f} GB)")


if __name__ == "__main__":
    main()
