"""A tiny random DFlash drafter in z-lab's published layout, for tests.

`make_tiny_draft` writes `config.json` (the keys z-lab's Qwen3.5-27B-DFlash
config carries) and `model.safetensors` (the exact tensor names z-lab's
checkpoint has: fc, hidden_norm, norm, layers.{i}.{input_layernorm,
post_attention_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
mlp.{gate,up,down}_proj}).  The safetensors file is written by hand
(json + struct) so tests can also write deliberately broken ones with
`write_safetensors_raw`.  BF16 tensors are stored as uint16 bit patterns
(f32 rounded to nearest even).
"""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np

from dflash27b.tools.draft_format import DROP, build_target_layer_ids, draft_config, tensor_shapes  # noqa: F401

_ST_DTYPE = {"bf16": "BF16", "f16": "F16", "f32": "F32"}


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def encode(x: np.ndarray, dtype: str) -> bytes:
    if dtype == "bf16":
        return f32_to_bf16_bits(x).tobytes()
    if dtype == "f16":
        return np.ascontiguousarray(x, dtype=np.float16).tobytes()
    return np.ascontiguousarray(x, dtype=np.float32).tobytes()


def write_safetensors_raw(path: str | Path, header: dict[str, Any], data: bytes, header_pad: bool = True) -> Path:
    """Writes header (a dict, taken as is) + data; pads the JSON with spaces to 8 bytes like the reference."""
    hb = json.dumps(header, separators=(",", ":")).encode()
    if header_pad:
        hb += b" " * (-len(hb) % 8)
    path = Path(path)
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + data)
    return path


def read_safetensors_raw(path: str | Path) -> tuple[dict[str, Any], bytes]:
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_safetensors(path: str | Path, tensors: list[tuple[str, str, tuple[int, ...], bytes]],
                      metadata: dict[str, str] | None = None) -> Path:
    """tensors: (name, dtype "BF16"/"F16"/"F32"/..., shape, bytes), laid out in order."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    data = bytearray()
    for name, dt, shape, b in tensors:
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [len(data), len(data) + len(b)]}
        data += b
    return write_safetensors_raw(path, header, bytes(data))


def make_tiny_draft(out_dir: str | Path, target_hidden: int = 256, target_layers: int = 8, vocab: int = 2048,
                    n_layers: int = 1, block_size: int = 16, mask_token_id: int | None = None, dtype: str = "bf16",
                    seed: int = 0, **config_overrides: Any) -> Path:
    """Writes out_dir/config.json and out_dir/model.safetensors; returns out_dir.
    config_overrides: top-level config keys (target_layer_ids / mask_token_id go into
    dflash_config); DROP removes a key.  Shapes follow the final config."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = draft_config(target_hidden, target_layers, vocab, n_layers, block_size, mask_token_id, **config_overrides)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    # Shapes follow the config as written; dropped keys and values of the wrong type
    # (written to test the loader's checks) fall back to the defaults.
    usable = {k: v for k, v in config_overrides.items() if v is not DROP and not isinstance(v, str)}
    full = draft_config(target_hidden, target_layers, vocab, n_layers, block_size,
                        None if mask_token_id is DROP else mask_token_id, **usable)
    write_draft_weights(out, full, dtype, seed)
    return out


def write_draft_weights(out_dir: str | Path, cfg: dict[str, Any], dtype: str = "bf16", seed: int = 0) -> Path:
    """out_dir/model.safetensors with random weights of the shapes config dict `cfg` implies."""
    rng = np.random.default_rng(seed)
    tensors = []
    for name, shape in tensor_shapes(cfg):
        if len(shape) == 1:
            x = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            x = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
        tensors.append((name, _ST_DTYPE[dtype], shape, encode(x, dtype)))
    return write_safetensors(Path(out_dir) / "model.safetensors", tensors)


FIXTURES = Path(__file__).resolve().parent / "fixtures"
# config.json files of published drafters, shrunk to the tiny target (see fixtures/draft_configs/README.md)
PUBLISHED = sorted(p.name for p in (FIXTURES / "draft_configs").iterdir() if (p / "config.json").is_file())


def published_config(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / "draft_configs" / name / "config.json").read_text())


# RoPE forms: (config overrides).  The YaRN ones put the original context (32) far below the positions the
# tests reach, so the ramp (pairs 0..4 of 32) and the attention factor change the drafts.
FORMS = {
    "tf5-default": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000000.0},
                        rope_theta=DROP, rope_scaling=DROP),
    "tf5-yarn": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 32, "beta_fast": 16.0, "beta_slow": 1.0,
                                      "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False},
                     rope_theta=DROP, rope_scaling=DROP),
    "tf4-yarn-type": dict(rope_theta=10000000.0,
                          rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    "tf5-linear": dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000000.0, "factor": 3.0},
                       rope_theta=DROP, rope_scaling=DROP),
}


def with_overrides(cfg: dict, overrides: dict) -> dict:
    cfg = json.loads(json.dumps(cfg))
    for k, v in overrides.items():
        if v is DROP:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    return cfg


def write_draft(out: Path, cfg: dict, weights_from: Path | None = None, seed: int = 0, dtype: str = "f32") -> Path:
    """A drafter directory with config `cfg`: weights copied from `weights_from`, else random."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if weights_from is not None:
        shutil.copy(weights_from / "model.safetensors", out / "model.safetensors")
    else:
        write_draft_weights(out, cfg, dtype, seed)
    return out


def to_dflash2(v1: Path, out: Path, scale: float, seed: int, dtype: str = "f32", cfg_edit=None, tensors_edit=None,
               **keys: Any) -> Path:
    """A DFlash drafter directory made a DFlash2 one in the published layout (docs/research/dflash2-spec.md):
    architectures DFlash2DraftModel, the conv / selector keys in dflash_config (defaults 2 taps, groups of 16,
    top-16, rank 32; `keys` override or add, e.g. block_size), attention_conv / mlp_conv per layer (identity
    base kernel plus noise) and the candidate selector, random at `scale` (0.5 makes them move the result a
    lot).  Every tensor is written as `dtype` (f32 or bf16); cfg_edit / tensors_edit change the config dict /
    the tensor dict before writing (malformed files)."""
    import torch
    from safetensors.torch import load_file, save_file
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((Path(v1) / "config.json").read_text())
    cfg["architectures"] = ["DFlash2DraftModel"]
    cfg.setdefault("dflash_config", {}).update({"conv_kernel_size": 2, "conv_group_size": 16, "selector_top_k": 16,
                                                "selector_rank": 32, **keys})
    if "block_size" in keys:
        cfg.pop("block_size", None)
    if cfg_edit:
        cfg_edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    t = load_file(str(Path(v1) / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    H, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    K, R = keys.get("conv_kernel_size", 2), keys.get("selector_rank", 32)
    G = H // 16
    for i in range(L):
        for conv in ("attention_conv", "mlp_conv"):
            base = torch.zeros(2, K, H)
            base[:, 0] = 1.0
            t[f"layers.{i}.{conv}.base_kernel"] = base + scale * torch.randn(2, K, H, generator=g)
            t[f"layers.{i}.{conv}.kernel_projection.weight"] = scale * 0.1 * torch.randn(2 * K * G, H, generator=g)
    t["candidate_selector.hidden_projection.weight"] = scale * torch.randn(R, H, generator=g)
    t["candidate_selector.predecessor_codebook"] = (4 * scale) ** 0.5 * torch.randn(V, R, generator=g)
    t["candidate_selector.successor_codebook"] = (4 * scale) ** 0.5 * torch.randn(V, R, generator=g)
    if tensors_edit:
        tensors_edit(t)
    want = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    save_file({k: v.to(want).contiguous() for k, v in t.items()}, str(out / "model.safetensors"))
    return out

