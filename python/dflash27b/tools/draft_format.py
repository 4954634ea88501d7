"""z-lab's DFlash drafter format: the config.json a drafter carries.

`draft_config` builds the dict z-lab's Qwen3.5-27B-DFlash config.json has (standard Qwen3 keys for the
drafter's own transformer, `dflash_config` with target_layer_ids and mask_token_id, block_size at top
level), for tiny drafters made by tests and by the training scripts.
"""
from __future__ import annotations

from typing import Any

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
