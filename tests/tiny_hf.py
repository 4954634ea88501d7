"""Test helper (not a test): a tiny random transformers Qwen3.5 checkpoint that behaves.

`make_tiny_hf(out_dir, seed=0, **overrides)` builds `Qwen3_5ForCausalLM` from `Qwen3_5TextConfig` with the
qwen35.md S7 shape (8 layers, hidden 256, 4 q / 2 kv heads of 64, 2 key / 4 value linear heads of 64, partial
rotary 0.25, mrope [3,3,2] interleaved, vocab 2048, untied, no MTP), initialised with the README recipe
(embeddings 0.5, projections 0.03, lm_head 0.1, conv 0.25, A in [0.02, 1.5], dt_bias 1 + 0.5 N, norm weights
small multiples of 1/128) and rounded to bf16-representable values (A_log kept f32), saved in float32 with
a byte-level BPE tokenizer.json (vocab trained as in dflash27b.tools.synth) and a ChatML template.
transformers 5.23 facts used: rope settings live in `rope_parameters` (rope_type, rope_theta,
partial_rotary_factor, mrope_section, mrope_interleaved); `layer_types` is stored instead of
`full_attention_interval`; saved tensor names are `model.layers.*` (no `language_model`).
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash27b.tools.hf_files import CHAT_TEMPLATE, write_tokenizer_files  # noqa: F401


DEFAULTS = dict(num_hidden_layers=8, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, vocab_size=2048,
                max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
                rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                     mrope_section=[3, 3, 2], mrope_interleaved=True))


def _bf16(t):
    import torch
    return t.to(torch.bfloat16).to(torch.float32)


def init_weights(model, seed: int = 0) -> None:
    """README recipe, in place, bf16-representable (A_log stays f32)."""
    import torch
    g = torch.Generator().manual_seed(seed)

    def normal(shape, std):
        return torch.randn(shape, generator=g) * std

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty(p.shape).uniform_(0.02, 1.5, generator=g)))
                continue
            if name.endswith("dt_bias"):
                v = 1 + 0.5 * torch.randn(p.shape, generator=g)
            elif name.endswith("linear_attn.norm.weight"):
                v = 1 + torch.randint(-4, 5, p.shape, generator=g) / 128.0
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                v = torch.randint(-4, 5, p.shape, generator=g) / 128.0
            elif name.endswith("embed_tokens.weight"):
                v = normal(p.shape, 0.5)
            elif name == "lm_head.weight":
                v = normal(p.shape, 0.1)
            elif name.endswith("conv1d.weight"):
                v = normal(p.shape, 0.25)
            else:
                v = normal(p.shape, 0.03)
            p.copy_(_bf16(v))


def make_tiny_hf(out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """Build, initialise and save the tiny checkpoint into `out_dir`; returns the directory."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kw = dict(DEFAULTS)
    kw.update(overrides)
    vocab_size = kw["vocab_size"]
    write_tokenizer_files(out, vocab_size)
    ids = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    by_name = {a["content"]: a["id"] for a in ids}
    kw.setdefault("eos_token_id", by_name["<|im_end|>"])
    kw.setdefault("pad_token_id", by_name["<|endoftext|>"])
    cfg = Qwen3_5TextConfig(**kw)
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(cfg).to(torch.float32).eval()
    init_weights(model, seed)
    model.save_pretrained(out)
    return out


if __name__ == "__main__":
    import sys
    print(make_tiny_hf(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tiny_qwen35_hf"))
