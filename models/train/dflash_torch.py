"""A DFlash drafter in plain torch, for training only (the engine runs drafters in C++).

Parameter names are z-lab's checkpoint names (fc, hidden_norm, norm, layers.{i}.input_layernorm,
post_attention_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, mlp.{gate,up,down}_proj), so
`state_dict()` saves as a z-lab model.safetensors.  The forward is the published math without a cache:
context features -> fc -> hidden_norm feed every layer's k/v projections; the block
[root, mask, ...] (embedded with the target's table) attends bidirectionally over [context ; block];
the draft's final norm, then the target's lm_head.  Full-attention layers only.

A DFlash2 config (architectures ["DFlash2DraftModel"]) adds, as published (docs/research/dflash2-spec.md §3.4,
§4): per layer a grouped dynamic causal convolution around attention and around the MLP
(`attention_conv` / `mlp_conv`: base_kernel [2, T, H], kernel_projection [2 T G, H]; side 0 convolves the normed
sublayer input, side 1 the sublayer output, both with the delta of the normed input; block rows only), and
the candidate selector (`candidate_selector.hidden_projection`, `predecessor_codebook`, `successor_codebook`),
trained by `selector_loss`.  The convolutions start as the identity, the selector's bilinear term near 0: a
fresh DFlash2 is its DFlash.
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


def is_dflash2(cfg: dict) -> bool:
    return (cfg.get("architectures") or [""])[0] == "DFlash2DraftModel"


class GroupedConv(nn.Module):
    """One sublayer's grouped dynamic causal convolution over the block rows (spec §3.4):
    out[i, c] = sum_tau (base[side, tau, c] + delta[i, side, tau, c // group]) * u[i - tau, c]."""

    def __init__(self, H: int, taps: int, group: int):
        super().__init__()
        self.taps, self.group = taps, group
        base = torch.zeros(2, taps, H)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(H, 2 * taps * (H // group), bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def deltas(self, n):  # [b, B, H] -> [b, B, 2, T, G]
        return self.kernel_projection(n).view(*n.shape[:2], 2, self.taps, -1)

    def convolve(self, u, delta, side: int):
        B = u.shape[1]
        coef = self.base_kernel[side][None, None] + delta[:, :, side].repeat_interleave(self.group, -1)  # [b,B,T,H]
        out = coef[:, :, 0] * u
        for tau in range(1, min(self.taps, B)):
            out = out + F.pad(coef[:, tau:, tau] * u[:, :B - tau], (0, 0, tau, 0))
        return out


class Layer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        H, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.self_attn = Attention(H, cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], eps)
        self.mlp = MLP(H, cfg["intermediate_size"])
        self.conv = is_dflash2(cfg)
        if self.conv:
            dc = cfg["dflash_config"]
            self.attention_conv = GroupedConv(H, dc["conv_kernel_size"], dc["conv_group_size"])
            self.mlp_conv = GroupedConv(H, dc["conv_kernel_size"], dc["conv_group_size"])

    def forward(self, h, ctx, cos, sin):
        n = self.input_layernorm(h)
        if not self.conv:
            h = h + self.self_attn(n, ctx, cos, sin)
            return h + self.mlp(self.post_attention_layernorm(h))
        d = self.attention_conv.deltas(n)
        y = self.self_attn(self.attention_conv.convolve(n, d, 0), ctx, cos, sin)
        h = h + self.attention_conv.convolve(y, d, 1)
        m = self.post_attention_layernorm(h)
        d = self.mlp_conv.deltas(m)
        return h + self.mlp_conv.convolve(self.mlp(self.mlp_conv.convolve(m, d, 0)), d, 1)


class CandidateSelector(nn.Module):
    """Spec §4.3: s_t(a -> j) = u_t[j] + <A[a] * (P h_t), Bc[cand_t[j]]>."""

    def __init__(self, H: int, V: int, rank: int):
        super().__init__()
        self.hidden_projection = nn.Linear(H, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.randn(V, rank) * 0.02)
        self.successor_codebook = nn.Parameter(torch.randn(V, rank) * 0.02)

    def scores(self, h, prev, cand, unary):
        """h [b, N, H], prev [b, N], cand / unary [b, N, K] -> [b, N, K]."""
        g = self.hidden_projection(h) * self.predecessor_codebook[prev]
        return unary + (self.successor_codebook[cand] * g[:, :, None]).sum(-1)


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
        if is_dflash2(cfg):
            dc = cfg["dflash_config"]
            self.candidate_selector = CandidateSelector(H, cfg["vocab_size"], dc["selector_rank"])
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


def selector_loss(net: DraftNet, h, logits, block, K: int):
    """Teacher-forced candidate-selector cross-entropy: at mask row t the candidates are the K best draft
    logits (the unary terms, detached, as is the hidden: the selector learns on top of the drafter), the
    predecessor is the true token of row t-1 (the root for t = 1), the label the true token of row t where it
    is a candidate (rows where it is not are left out).  h [b, B, H] final-normed, logits [b, B-1, V],
    block [b, B] true tokens.  Returns (loss, fraction of rows whose true token is a candidate)."""
    lg = logits.detach()
    unary, cand = lg.topk(K, -1)  # sorted: ties to the lower index, as the engine's ranking
    s = net.candidate_selector.scores(h[:, 1:].detach(), block[:, :-1], cand, unary)
    hit = cand == block[:, 1:, None]
    ok = hit.any(-1)
    if not ok.any():
        return s.sum() * 0.0, 0.0
    label = hit.float().argmax(-1)
    return F.cross_entropy(s[ok], label[ok]), ok.float().mean().item()
