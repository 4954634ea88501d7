"""z-lab's DFlash drafter format: the config.json a drafter carries, and its tensors.

`draft_config` builds the dict z-lab's Qwen3.5-27B-DFlash config.json has (standard Qwen3 keys for the
drafter's own transformer, `dflash_config` with target_layer_ids and mask_token_id, block_size at top
level), for tiny drafters made by tests and by the training scripts.  `tensor_shapes` lists the tensors
such a config implies (z-lab's names), and `write_random_draft` writes a drafter of any shape with random
BF16 weights, streamed tensor by tensor (the 27B drafter's shapes are 3.46 GB).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

DROP = object()  # config override value that removes the key
_DFLASH_KEYS = ("target_layer_ids", "mask_token_id")


def build_target_layer_ids(n_target: int, n_draft: int) -> list[int]:
    """z-lab's helper (Python round: ties to even)."""
    if n_draft == 1:
        return [n_target // 2]
    start, end = 1, n_target - 3
    span = end - start
    return [int(round(start + i * span / (n_draft - 1))) for i in range(n_draft)]


def draft_config(target_hidden: int = 256, target_layers: int = 8, vocab: int = 2048, n_layers: int = 1,
                 block_size: int = 16, mask_token_id: int | None = None, n_head: int = 4, n_head_kv: int = 2,
                 head_dim: int = 64, ffn: int = 512, **overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": block_size,
        "bos_token_id": None,
        "dflash_config": {
            "mask_token_id": vocab - 1 if mask_token_id is None else mask_token_id,  # DROP: removed below
            "target_layer_ids": build_target_layer_ids(target_layers, n_layers),
        },
        "dtype": "bfloat16",
        "eos_token_id": None,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": target_hidden,
        "initializer_range": 0.02,
        "intermediate_size": ffn,
        "layer_types": ["full_attention"] * n_layers,
        "max_position_embeddings": 4096,
        "max_window_layers": n_layers,
        "model_type": "qwen3",
        "num_attention_heads": n_head,
        "num_hidden_layers": n_layers,
        "num_key_value_heads": n_head_kv,
        "num_target_layers": target_layers,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab,
    }
    for k, v in overrides.items():
        where = cfg["dflash_config"] if k in _DFLASH_KEYS else cfg
        where[k] = v
    for where in (cfg, cfg["dflash_config"]):
        for k in [k for k, v in where.items() if v is DROP]:
            del where[k]
    return cfg


def tensor_shapes(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor a drafter with this config.json has, in z-lab's order."""
    H, F, D = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    Q, KV = cfg["num_attention_heads"] * D, cfg["num_key_value_heads"] * D
    n_ids = len((cfg.get("dflash_config") or {}).get("target_layer_ids") or cfg["target_layer_ids"])
    out = [("fc.weight", (H, H * n_ids)), ("hidden_norm.weight", (H,))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        out += [(p + "input_layernorm.weight", (H,)),
                (p + "mlp.down_proj.weight", (H, F)),
                (p + "mlp.gate_proj.weight", (F, H)),
                (p + "mlp.up_proj.weight", (F, H)),
                (p + "post_attention_layernorm.weight", (H,)),
                (p + "self_attn.k_norm.weight", (D,)),
                (p + "self_attn.k_proj.weight", (KV, H)),
                (p + "self_attn.o_proj.weight", (H, Q)),
                (p + "self_attn.q_norm.weight", (D,)),
                (p + "self_attn.q_proj.weight", (Q, H)),
                (p + "self_attn.v_proj.weight", (KV, H))]
    out.append(("norm.weight", (H,)))
    return out


def write_random_draft(out_dir: str | Path, cfg: dict[str, Any], seed: int = 0, sparse: bool = False) -> Path:
    """out_dir/config.json + model.safetensors (BF16, random: matrices ~ N(0, 1/fan_in), norms ~ 1),
    written one tensor at a time so memory stays at the largest tensor.  sparse: all-zero weights left as
    a hole in the file (the layout alone)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    shapes = tensor_shapes(cfg)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, shape in shapes:
        nbytes = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    rng = np.random.default_rng(seed)
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb)
        if sparse:
            f.truncate(8 + len(hb) + off)
            return out
        for _, shape in shapes:
            if len(shape) == 1:
                x = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
            else:
                x = rng.standard_normal(shape, dtype=np.float32)
                x *= np.float32(1.0 / np.sqrt(shape[1]))
            # BF16 by rounding to nearest even on the f32 bits
            bits = x.view(np.uint32)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            f.write(bits.astype(np.uint16).tobytes())
    return out
