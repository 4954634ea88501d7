"""A DFlash drafter in plain torch, for training only (the engine runs drafters in C++).

Parameter names are z-lab's checkpoint names (fc, hidden_norm, norm, layers.{i}.input_layernorm,
post_attention_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, mlp.{gate,up,down}_proj), so
`state_dict()` saves as a z-lab model.safetensors.  The forward is the published math without a cache:
context features -> fc -> hidden_norm feed every layer's k/v projections; the block
[root, mask, ...] (embedded with the target's table) attends bidirectionally over [context ; block];
the draft's final norm, then the target's lm_head.  Full-attention layers only.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Attention(nn.Module):
    def __init__(self, H: int, n_head: int, n_kv: int, hd: int, eps: float):
        super().__init__()
        self.n_head, self.n_kv, self.hd = n_head, n_kv, hd
        self.q_proj = nn.Linear(H, n_head * hd, bias=False)
        self.k_proj = nn.Linear(H, n_kv * hd, bias=False)
        self.v_proj = nn.Linear(H, n_kv * hd, bias=False)
        self.o_proj = nn.Linear(n_head * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, eps)
        self.k_norm = RMSNorm(hd, eps)

    def forward(self, x, ctx, cos, sin):
        b, B, _ = x.shape
        C = ctx.shape[1]
        q = self.q_norm(self.q_proj(x).view(b, B, self.n_head, self.hd)).transpose(1, 2)
        kv_in = torch.cat([ctx, x], 1)
        k = self.k_norm(self.k_proj(kv_in).view(b, C + B, self.n_kv, self.hd)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, C + B, self.n_kv, self.hd).transpose(1, 2)
        q = rotate(q, cos[..., -B:, :], sin[..., -B:, :])
        k = rotate(k, cos, sin)
        rep = self.n_head // self.n_kv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        a = F.scaled_dot_product_attention(q, k, v)
        return self.o_proj(a.transpose(1, 2).reshape(b, B, -1))


class MLP(nn.Module):
    def __init__(self, H: int, Fd: int):
        super().__init__()
        self.gate_proj = nn.Linear(H, Fd, bias=False)
        self.up_proj = nn.Linear(H, Fd, bias=False)
        self.down_proj = nn.Linear(Fd, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        H, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.self_attn = Attention(H, cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], eps)
        self.mlp = MLP(H, cfg["intermediate_size"])

    def forward(self, h, ctx, cos, sin):
        h = h + self.self_attn(self.input_layernorm(h), ctx, cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class DraftNet(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        H, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        n_ids = len(cfg["dflash_config"]["target_layer_ids"])
        self.cfg = cfg
        self.fc = nn.Linear(n_ids * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, eps)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(H, eps)
        hd = cfg["head_dim"]
        self.register_buffer("inv_freq", cfg["rope_theta"] ** (-torch.arange(0, hd, 2).float() / hd), persistent=False)

    def forward(self, feats, block_emb, pos):
        """feats [b, C, n_ids*H], block_emb [b, B, H], pos [C+B] -> final-normed block states [b, B, H]."""
        ang = pos.float()[:, None] * self.inv_freq[None]
        ang = torch.cat([ang, ang], -1)
        cos, sin = ang.cos()[None, None], ang.sin()[None, None]
        ctx = self.hidden_norm(self.fc(feats))
        h = block_emb
        for layer in self.layers:
            h = layer(h, ctx, cos, sin)
        return self.norm(h)
