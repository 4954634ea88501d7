"""An independent PyTorch oracle for DFlash2 drafters (docs/research/dflash2-spec.md), CPU, float64 by default.

Written from the spec alone (no code of any reference implementation): the C++ forward of issue 42 is tested
against it.  Section numbers (§) below are the spec's.

    ref = load_dflash2(directory)                       # config.json + model.safetensors -> plain tensors
    ctx = ref.context_kv(features, positions)           # §3.2: fc, hidden_norm, per-layer k/v, k_norm, RoPE
    out = ref.block_forward(ctx, block, positions, target_embed, target_lm_head)   # §3.1, §3.3-§3.5, §5
    path = ref.greedy_path(block[0], out.logits, out.hidden)                       # §4.2-§4.4

A DFlash v1 directory (architectures ["DFlashDraftModel"], no conv / selector tensors) loads too: its layers
then have no convolutions and `block_forward` is the v1 forward — the spec's §3.4 identity check compares the
two.  Everything is computed in `dtype` (float64 unless asked otherwise) from the stored weights, converted
exactly (bf16 and f16 are exact in float32/float64).  Lines marked `ASSUMPTION:` are readings of places the
spec marks [INFERRED] / [NOT FOUND] / [NOT VERIFIED] or leaves open.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors.torch import load_file

DFLASH2_ARCH = "DFlash2DraftModel"
DFLASH1_ARCH = "DFlashDraftModel"


# ------------------------------------------------------------------------------------------------------------
# config (§1)

@dataclass
class Config:
    """The config.json values the forward reads (§1.1, lookup and defaults per §1.3)."""
    generation: int
    hidden: int
    intermediate: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    eps: float
    rope_theta: float
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    layer_types: list[str]
    sliding_window: int | None
    causal: list[bool]                      # per layer, resolved per §5
    output_multiplier: float = 1.0
    softcap: float | None = None            # final_logit_softcapping; None = disabled
    input_embedding_scale: float = 1.0
    conv_kernel_size: int = 0               # 0 for a v1 drafter
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


def _value(cfg: dict, name: str, default: Any = None, required: bool = False) -> Any:
    """§1.3: `dflash_config[name]`, else the top-level key, else `default`."""
    dc = cfg.get("dflash_config") or {}
    if name in dc and dc[name] is not None:
        return dc[name]
    if name in cfg and cfg[name] is not None:
        return cfg[name]
    if required:
        raise ValueError(f"missing config key 'dflash_config.{name}'")
    return default


def _rope_theta(cfg: dict) -> float:
    """§1.1 `rope_parameters` = {rope_theta, rope_type: "default"}: plain 1-D RoPE (§5 "Positions")."""
    rp = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    if isinstance(rp, dict):
        kind = rp.get("rope_type", rp.get("type", "default"))
        theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
    else:
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        theta = cfg.get("rope_theta", 10000.0)
    # ASSUMPTION: DFlash2 drafters use plain RoPE (§1.1, pitfall 18: no YaRN, no M-RoPE, full head_dim); any
    # other rope type is refused rather than guessed (the v1 oracle, tests/zlab_ref.py, covers YaRN/linear).
    if kind not in ("default", None):
        raise NotImplementedError(f"rope type {kind!r} is not supported by the DFlash2 oracle")
    return float(theta)


def parse_config(cfg: dict) -> Config:
    """config.json -> Config (§1.1 keys, §1.3 lookup order / defaults / constraints, §5 causality)."""
    archs = cfg.get("architectures") or [DFLASH1_ARCH]
    if archs[0] == DFLASH2_ARCH:
        gen = 2
    elif archs[0] == DFLASH1_ARCH:
        gen = 1
    else:
        raise ValueError(f"architectures {archs[0]!r} is not a DFlash drafter")
    H, nh = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    L = int(cfg["num_hidden_layers"])
    # ASSUMPTION: a missing `layer_types` means every layer is full attention; the legacy Qwen2 keys
    # use_sliding_window / max_window_layers are never read (§1.1, pitfall 3).
    layer_types = list(cfg.get("layer_types") or ["full_attention"] * L)
    if len(layer_types) != L:
        raise ValueError("layer_types does not have one entry per layer")
    sw = cfg.get("sliding_window")
    if any(t == "sliding_attention" for t in layer_types) and not sw:
        raise ValueError("a sliding_attention layer needs sliding_window")
    # §5 causality: a top-level is_causal decides every layer; without it sliding layers are causal and full
    # layers are not.
    # ASSUMPTION: vLLM's dflash_config.causal (§1.3, vLLM-only) is ignored, as the z-lab reference (S4) does.
    if "is_causal" in cfg and cfg["is_causal"] is not None:
        causal = [bool(cfg["is_causal"])] * L
    else:
        causal = [t == "sliding_attention" for t in layer_types]
    soft = _value(cfg, "final_logit_softcapping", None)
    # §1.3: softcap applies only when > 0 (null / 0 = disabled); S16 refuses negatives, and so does this oracle.
    if soft is not None and float(soft) < 0:
        raise ValueError("'final_logit_softcapping' must be >= 0")
    # ASSUMPTION: sample_from_anchor (a DSpark key, §1.1 "absent -> false") changes the protocol, not modelled.
    if _value(cfg, "sample_from_anchor", False):
        raise NotImplementedError("sample_from_anchor is not modelled by the DFlash2 oracle")
    c = Config(
        generation=gen, hidden=H, intermediate=int(cfg["intermediate_size"]), n_layers=L, n_heads=nh,
        n_kv_heads=int(cfg["num_key_value_heads"]), head_dim=int(cfg.get("head_dim") or H // nh),
        vocab=int(cfg["vocab_size"]), eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=_rope_theta(cfg),
        block_size=int(_value(cfg, "block_size", 16)), mask_token_id=int(_value(cfg, "mask_token_id", required=True)),
        target_layer_ids=[int(x) for x in _value(cfg, "target_layer_ids", required=True)],
        layer_types=layer_types, sliding_window=int(sw) if sw else None, causal=causal,
        output_multiplier=float(_value(cfg, "output_multiplier", 1.0)),
        softcap=float(soft) if soft is not None and float(soft) > 0 else None,
        input_embedding_scale=float(_value(cfg, "input_embedding_scale", 1.0)), raw=cfg)
    if c.output_multiplier <= 0:
        raise ValueError("output_multiplier must be > 0 (the unary transform must be monotone, §3.5)")
    if gen == 2:
        c.conv_kernel_size = int(_value(cfg, "conv_kernel_size", required=True))
        c.conv_group_size = int(_value(cfg, "conv_group_size", required=True))
        c.selector_rank = int(_value(cfg, "selector_rank", required=True))
        c.selector_top_k = int(_value(cfg, "selector_top_k", required=True))
        if H % c.conv_group_size:
            raise ValueError(f"conv_group_size {c.conv_group_size} does not divide hidden_size {H}")
        if not 1 <= c.conv_kernel_size <= c.block_size:
            raise ValueError(f"conv_kernel_size {c.conv_kernel_size} is out of range")
        if not 1 <= c.selector_top_k <= c.vocab:
            raise ValueError(f"selector_top_k {c.selector_top_k} is out of range")
    return c


# ------------------------------------------------------------------------------------------------------------
# building blocks

def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3 RMSNorm `w ⊙ x / sqrt(mean(x²) + eps)` over the last dim (pitfall 17: not the (1+w) form)."""
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """§5 "Positions": neox / rotate-half RoPE over the full head_dim at absolute positions.
    x [N, heads, D], positions [N] -> same shape.  Angles are computed in float64."""
    D = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos().to(x.dtype)[:, None, :], ang.sin().to(x.dtype)[:, None, :]
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def grouped_dynamic_conv(u: torch.Tensor, base: torch.Tensor, delta: torch.Tensor, group_size: int) -> torch.Tensor:
    """§3.4, one side of the grouped dynamic causal convolution over the block rows:

        out[i, c] = Σ_τ (base[τ, c] + delta[i, τ, c // group_size]) · u[i - τ, c],   u[i - τ] = 0 for i - τ < 0

    u [B, H] (block rows only: never context, never the previous block), base [T, H] (per channel),
    delta [B, T, G] (row i's own δ weights every tap of row i, including the one reading row i - 1)."""
    B, H = u.shape
    T = base.shape[0]
    coef = base[None, :, :] + delta.repeat_interleave(group_size, dim=-1)   # [B, T, H], group g = channels 16g..
    out = torch.zeros_like(u)
    for tau in range(min(T, B)):
        out[tau:] += coef[tau:, tau, :] * u[:B - tau]
    return out


def conv_delta(n: torch.Tensor, kernel_projection: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """§3.4: δ = kernel_projection(n) from the normed sublayer input n [B, H], laid out [side][tap][group]
    -> [B, 2, T, G]; side 0 = prepare (sublayer input), side 1 = finish (sublayer output)."""
    d = n @ kernel_projection.T
    return d.reshape(n.shape[0], 2, kernel_size, -1)


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window: int | None) -> torch.Tensor:
    """§5: bool [Q, K], True = visible.  Key k is visible from query q iff q - k < W (sliding layers) and, for
    causal layers, k <= q; for non-causal sliding layers also k - q < W.  Full layers: W = ∞.

    ASSUMPTION: the reference states the window in key-index space with contiguous positions; this oracle states
    it in position space (query/key positions as given).  The two agree whenever the context keys are the
    contiguous positions 0..C-1 followed by the block, which is how the reference's cache is kept."""
    d = q_pos[:, None] - k_pos[None, :]          # q - k
    vis = torch.ones_like(d, dtype=torch.bool)
    if causal:
        vis &= d >= 0
    if window is not None:
        vis &= d < window
        if not causal:
            vis &= -d < window
    return vis


# ------------------------------------------------------------------------------------------------------------
# results

@dataclass
class ContextState:
    """Context K/V per layer (§3.2): k[l], v[l] [C, n_kv_heads, head_dim] (k after k_norm and RoPE), the positions
    [C], and c = hidden_norm(fc(x)) [C, H] (shared by all layers)."""
    positions: torch.Tensor
    c: torch.Tensor
    k: list[torch.Tensor]
    v: list[torch.Tensor]

    def __len__(self) -> int:
        return int(self.positions.shape[0])

    def extend(self, other: "ContextState") -> "ContextState":
        """This context followed by `other` (newly committed rows)."""
        return ContextState(torch.cat([self.positions, other.positions]), torch.cat([self.c, other.c]),
                            [torch.cat([a, b]) for a, b in zip(self.k, other.k)],
                            [torch.cat([a, b]) for a, b in zip(self.v, other.v)])

    def crop(self, n: int) -> "ContextState":
        """The first n rows."""
        return ContextState(self.positions[:n], self.c[:n], [k[:n] for k in self.k], [v[:n] for v in self.v])


@dataclass
class BlockOut:
    """block_forward's result.  Mask rows are block rows 1..B-1 (§3.5).
    logits      [B-1, V]  draft logits after output_multiplier, then softcap (§3.5 order)
    raw_logits  [B-1, V]  target lm_head on the final hidden, before the unary transform
    hidden      [B-1, H]  post-final-norm hidden of the mask rows (lm_head input = selector input, pitfall 10)
    hidden_all  [B, H]    post-final-norm hidden of every block row (row 0 = root)
    residual    list of [B, H]: the block stream entering the layers, then after each layer (before `norm`)"""
    logits: torch.Tensor
    raw_logits: torch.Tensor
    hidden: torch.Tensor
    hidden_all: torch.Tensor
    residual: list[torch.Tensor]


@dataclass
class PathOut:
    """greedy_path's result, one row per mask position t = 1..B-1 (row index t-1):
    tokens [B-1] the chain d_1..d_{B-1}; predecessors [B-1] (root, d_1, ..);
    cand_ids [B-1, K] candidates sorted by (transformed logit desc, id asc); unary [B-1, K] their transformed
    logits; scores [B-1, K] s_t(pred_t -> j); choice [B-1] the chosen index j* into cand_ids."""
    tokens: list[int]
    predecessors: list[int]
    cand_ids: torch.Tensor
    unary: torch.Tensor
    scores: torch.Tensor
    choice: list[int]


# ------------------------------------------------------------------------------------------------------------
# the model

class DFlash2Ref:
    """A loaded DFlash2 (or v1) drafter: `cfg` (Config) and `w` (name -> tensor in `dtype`)."""

    def __init__(self, cfg: Config, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float64):
        self.cfg, self.dtype = cfg, dtype
        self.w = {k: v.to(dtype) for k, v in weights.items()}
        self._check_shapes()

    # -- loading ------------------------------------------------------------------------------------------------
    def _check_shapes(self) -> None:
        """§2.1 tensor inventory (names and torch [out, in] shapes)."""
        c, w = self.cfg, self.w
        H, F, D = c.hidden, c.intermediate, c.head_dim
        Q, KV = c.n_heads * D, c.n_kv_heads * D
        fc = w["fc.weight"]
        want = {"hidden_norm.weight": (H,), "norm.weight": (H,)}
        if fc.shape[0] != H or fc.shape[1] % len(c.target_layer_ids):
            raise ValueError(f"fc.weight has shape {list(fc.shape)}")
        for i in range(c.n_layers):
            p = f"layers.{i}."
            want.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                         p + "self_attn.q_proj.weight": (Q, H), p + "self_attn.k_proj.weight": (KV, H),
                         p + "self_attn.v_proj.weight": (KV, H), p + "self_attn.o_proj.weight": (H, Q),
                         p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,),
                         p + "mlp.gate_proj.weight": (F, H), p + "mlp.up_proj.weight": (F, H),
                         p + "mlp.down_proj.weight": (H, F)})
            if c.generation == 2:
                T, G = c.conv_kernel_size, H // c.conv_group_size
                for conv in ("attention_conv", "mlp_conv"):
                    want[p + conv + ".base_kernel"] = (2, T, H)
                    want[p + conv + ".kernel_projection.weight"] = (2 * T * G, H)
        if c.generation == 2:
            R, V = c.selector_rank, c.vocab
            want.update({"candidate_selector.hidden_projection.weight": (R, H),
                         "candidate_selector.predecessor_codebook": (V, R),
                         "candidate_selector.successor_codebook": (V, R)})
        for name, shape in want.items():
            if name not in w:
                raise ValueError(f"missing tensor {name!r}")
            if tuple(w[name].shape) != shape:
                raise ValueError(f"tensor {name!r} has shape {list(w[name].shape)}, expected {list(shape)}")
        extra = set(w) - set(want) - {"fc.weight"}
        if extra:
            raise ValueError(f"unexpected tensors {sorted(extra)}")

    # -- §3.2 context path ----------------------------------------------------------------------------------------
    def context_kv(self, features, positions=None, start: int = 0) -> ContextState:
        """§3.1 item 1 and §3.2.  features [C, n_ids · H_target]: the target's residual stream after each layer of
        target_layer_ids, concatenated in list order (the caller builds it).  positions [C] (default start..start+C-1).

            c(p)   = hidden_norm(fc · x(p))                       one vector per position, shared by all layers
            k_ctx  = RoPE_p(k_norm_l(W_k,l · c(p)))  per head   v_ctx = W_v,l · c(p)   (no norm)

        No input_layernorm, no conv, no q on the context (pitfall 5).  This is the same context path as DFlash v1
        (the spec's sources for it, S4 Qwen3DFlashAttention.forward and S8, are the ones v1 uses)."""
        c, w = self.cfg, self.w
        x = torch.as_tensor(features).to(self.dtype)
        if x.ndim != 2 or x.shape[1] != w["fc.weight"].shape[1]:
            raise ValueError(f"features must be [C, {w['fc.weight'].shape[1]}], got {list(x.shape)}")
        C = x.shape[0]
        pos = torch.arange(start, start + C) if positions is None else torch.as_tensor(positions).long()
        ctx = rms_norm(x @ w["fc.weight"].T, w["hidden_norm.weight"], c.eps)
        ks, vs = [], []
        for i in range(c.n_layers):
            p = f"layers.{i}.self_attn."
            k = (ctx @ w[p + "k_proj.weight"].T).reshape(C, c.n_kv_heads, c.head_dim)
            k = rope(rms_norm(k, w[p + "k_norm.weight"], c.eps), pos, c.rope_theta)
            v = (ctx @ w[p + "v_proj.weight"].T).reshape(C, c.n_kv_heads, c.head_dim)
            ks.append(k)
            vs.append(v)
        return ContextState(pos, ctx, ks, vs)

    def empty_context(self) -> ContextState:
        c = self.cfg
        z = torch.zeros(0, c.n_kv_heads, c.head_dim, dtype=self.dtype)
        return ContextState(torch.zeros(0, dtype=torch.long), torch.zeros(0, c.hidden, dtype=self.dtype),
                            [z] * c.n_layers, [z] * c.n_layers)

    # -- §3.3 / §3.4 pieces -------------------------------------------------------------------------------------
    def conv_pair(self, layer: int, which: str, n: torch.Tensor):
        """§3.4 for `which` in ("attention_conv", "mlp_conv") of `layer`: from the normed sublayer input n [B, H],
        returns (prepare(n) [B, H], finish) where finish(y) convolves the sublayer output y with side 1 and the δ
        of n.  For a v1 drafter both are the identity."""
        c, w = self.cfg, self.w
        if c.generation == 1:
            return n, (lambda y: y)
        p = f"layers.{layer}.{which}."
        base = w[p + "base_kernel"]                                           # [2 side, T tap, H]
        delta = conv_delta(n, w[p + "kernel_projection.weight"], c.conv_kernel_size)  # [B, 2, T, G]
        gs = c.conv_group_size
        prepared = grouped_dynamic_conv(n, base[0], delta[:, 0], gs)
        return prepared, (lambda y: grouped_dynamic_conv(y, base[1], delta[:, 1], gs))

    def attention(self, layer: int, a_in: torch.Tensor, positions: torch.Tensor, ctx: ContextState) -> torch.Tensor:
        """§3.3 attention of one layer on the (prepared) block rows a_in [B, H]: q/k/v projections, per-head q_norm /
        k_norm, RoPE at the block positions, keys/values = [context ; block], the §5 mask, softmax with scale
        1/√head_dim, GQA (query head h reads KV head h // (n_heads / n_kv_heads)), o_proj."""
        c, w = self.cfg, self.w
        p = f"layers.{layer}.self_attn."
        B, D = a_in.shape[0], c.head_dim
        q = rms_norm((a_in @ w[p + "q_proj.weight"].T).reshape(B, c.n_heads, D), w[p + "q_norm.weight"], c.eps)
        kb = rms_norm((a_in @ w[p + "k_proj.weight"].T).reshape(B, c.n_kv_heads, D), w[p + "k_norm.weight"], c.eps)
        vb = (a_in @ w[p + "v_proj.weight"].T).reshape(B, c.n_kv_heads, D)
        q, kb = rope(q, positions, c.rope_theta), rope(kb, positions, c.rope_theta)
        k = torch.cat([ctx.k[layer], kb])                      # [C + B, n_kv, D]
        v = torch.cat([ctx.v[layer], vb])
        k_pos = torch.cat([ctx.positions, positions])
        window = c.sliding_window if c.layer_types[layer] == "sliding_attention" else None
        vis = attention_mask(positions, k_pos, c.causal[layer], window)      # [B, C + B]
        rep = c.n_heads // c.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)   # [C+B, n_heads, D]
        s = torch.einsum("bhd,khd->hbk", q, k) / math.sqrt(D)
        s = s.masked_fill(~vis[None], float("-inf"))
        o = torch.einsum("hbk,khd->bhd", torch.softmax(s, -1), v).reshape(B, c.n_heads * D)
        return o @ w[p + "o_proj.weight"].T

    def mlp(self, layer: int, z: torch.Tensor) -> torch.Tensor:
        """§3.3 MLP(z) = down(silu(gate z) ⊙ up z)."""
        w, p = self.w, f"layers.{layer}.mlp."
        return (torch.nn.functional.silu(z @ w[p + "gate_proj.weight"].T) * (z @ w[p + "up_proj.weight"].T)) \
            @ w[p + "down_proj.weight"].T

    def layer_forward(self, layer: int, x: torch.Tensor, positions: torch.Tensor, ctx: ContextState) -> torch.Tensor:
        """§3.3, one decoder layer on the block stream x [B, H] (pitfall 8: the residual is never convolved):

            n = input_layernorm(x); a_in, fin = conv(n)         x = x + fin(o_proj(attn(a_in)))
            m = post_attention_layernorm(x); z, fin = conv(m)   x = x + fin(mlp(z))"""
        c, w = self.cfg, self.w
        p = f"layers.{layer}."
        n = rms_norm(x, w[p + "input_layernorm.weight"], c.eps)
        a_in, finish = self.conv_pair(layer, "attention_conv", n)
        x = x + finish(self.attention(layer, a_in, positions, ctx))
        m = rms_norm(x, w[p + "post_attention_layernorm.weight"], c.eps)
        z, finish = self.conv_pair(layer, "mlp_conv", m)
        return x + finish(self.mlp(layer, z))

    # -- §3.5 -------------------------------------------------------------------------------------------------
    def unary_transform(self, z: torch.Tensor) -> torch.Tensor:
        """§3.5: z · output_multiplier, then (if softcap c > 0) c · tanh(z / c) — in this order."""
        z = z * self.cfg.output_multiplier
        if self.cfg.softcap is not None:
            z = self.cfg.softcap * torch.tanh(z / self.cfg.softcap)
        return z

    def block_forward(self, ctx_state: ContextState | None, block_tokens: Sequence[int], positions,
                      target_embed, target_lm_head) -> BlockOut:
        """§3.1 items 2-3, §3.3 (every layer), §3.5, masks per §5.
        block_tokens [B]: [root, MASK × (B-1)] normally (any ids are accepted); positions: [B] or the root's
        position P0 (then P0..P0+B-1); target_embed [V, H] and target_lm_head [V, H]: the target's (the drafter
        has neither, §2.1).  e_i = target_embed[token_i] · input_embedding_scale; after the layers
        h = norm(x); logits are the transformed target head on h for the mask rows 1..B-1 only.

        ASSUMPTION: the block length is whatever is passed; §6.2 / pitfall 9 say the trained block (block_size)
        should always be run, which is the caller's choice here."""
        c, w = self.cfg, self.w
        toks = torch.as_tensor(list(block_tokens), dtype=torch.long)
        B = toks.shape[0]
        if isinstance(positions, int):
            positions = torch.arange(positions, positions + B)
        positions = torch.as_tensor(positions).long()
        if positions.shape != (B,):
            raise ValueError("one position per block token")
        ctx = ctx_state if ctx_state is not None else self.empty_context()
        E = torch.as_tensor(target_embed).to(self.dtype)
        head = torch.as_tensor(target_lm_head).to(self.dtype)
        x = E[toks] * c.input_embedding_scale
        res = [x]
        for i in range(c.n_layers):
            x = self.layer_forward(i, x, positions, ctx)
            res.append(x)
        h = rms_norm(x, w["norm.weight"], c.eps)
        raw = h[1:] @ head.T
        # ASSUMPTION: no lm_head rows are excluded (pitfall 23: vocab padding rows are not masked by any source).
        return BlockOut(self.unary_transform(raw), raw, h[1:], h, res)

    # -- §4 selector ------------------------------------------------------------------------------------------
    def candidates(self, logits: torch.Tensor, k: int | None = None, raw_logits: torch.Tensor | None = None):
        """§4.2: per row of transformed logits [N, V], the top-K ids and their transformed values (the unary
        terms u), sorted by (value desc, id asc) as §4.4 recommends.

        ASSUMPTION: with `raw_logits` (the logits before §3.5's transform) the ranking is done on them, as vLLM /
        SGLang do (top-K on the raw logits, then transform the K values); the unary terms are still the
        transformed values.  The transform is monotone, so this is the same order as ranking the transformed
        logits in exact arithmetic; it differs only where the softcap's tanh rounds distinct raw logits to one
        value — then the higher raw logit comes first.  Without `raw_logits`, ties go to the lower id."""
        k = k or self.cfg.selector_top_k
        key = logits if raw_logits is None else raw_logits
        _, ids = torch.sort(key, dim=-1, descending=True, stable=True)   # stable: equal keys keep id order
        ids = ids[:, :k]
        return ids, logits.gather(-1, ids)

    def selector_gate(self, hidden: torch.Tensor) -> torch.Tensor:
        """§4.3 g_t = P · h_t (hidden_projection of the post-final-norm mask-row hidden), [.., R]."""
        return hidden @ self.w["candidate_selector.hidden_projection.weight"].T

    def selector_scores(self, hidden_row: torch.Tensor, prev_token: int, cand_ids: torch.Tensor,
                        unary: torch.Tensor) -> torch.Tensor:
        """§4.3, one position t and one predecessor token a:

            s_t(a -> j) = u_t[j] + Σ_r A[a, r] · g_t[r] · Bc[cand_t[j], r],   g_t = P · h_t

        hidden_row [H] (post-final-norm hidden of mask row t), cand_ids / unary [K].  Logit scale: no
        log-softmax, no normalisation."""
        if self.cfg.generation != 2:
            raise ValueError("a v1 drafter has no candidate selector")
        A = self.w["candidate_selector.predecessor_codebook"]
        Bc = self.w["candidate_selector.successor_codebook"]
        g = self.selector_gate(hidden_row)
        return unary + (Bc[cand_ids] @ (A[int(prev_token)] * g))

    def selector_lattice(self, root: int, cand_ids: torch.Tensor, hidden: torch.Tensor,
                         unary: torch.Tensor) -> torch.Tensor:
        """§4.3 "batched implementations": [B-1, K pred, K succ] edge scores; the predecessor set of row 1 is the
        root repeated K times, of row t ≥ 2 the candidates of row t-1.  The walk reads one row per step."""
        N, K = cand_ids.shape
        out = torch.empty(N, K, K, dtype=self.dtype)
        for t in range(N):
            preds = [int(root)] * K if t == 0 else cand_ids[t - 1].tolist()
            for a, pred in enumerate(preds):
                out[t, a] = self.selector_scores(hidden[t], pred, cand_ids[t], unary[t])
        return out

    def greedy_path(self, root: int, logits: torch.Tensor, hidden: torch.Tensor,
                    raw_logits: torch.Tensor | None = None) -> PathOut:
        """§4.4 greedy walk (T = 0), not Viterbi: prev = root; for each mask row t, scores = s_t(prev -> ·) over
        the K candidates of row t, j* = first maximum (lowest index in the (value desc, id asc) order, §4.4
        tie-breaking), d_t = cand_t[j*], prev = d_t.  No path score is accumulated.
        logits [B-1, V] (transformed, block_forward's `logits`), hidden [B-1, H] (block_forward's `hidden`).
        raw_logits (optional, block_forward's `raw_logits`): rank the candidates on them (see `candidates`).
        Predecessors are chosen tokens, never the mask id or the argmax-unary token (pitfall 11)."""
        cand, unary = self.candidates(logits, raw_logits=raw_logits)
        tokens, preds, scores, choice = [], [], [], []
        prev = int(root)
        for t in range(cand.shape[0]):
            s = self.selector_scores(hidden[t], prev, cand[t], unary[t])
            j = int(torch.argmax(s))        # torch.argmax returns the first maximal index
            preds.append(prev)
            prev = int(cand[t, j])
            tokens.append(prev)
            scores.append(s)
            choice.append(j)
        return PathOut(tokens, preds, cand, unary, torch.stack(scores) if scores else unary[:0], choice)

    def propose(self, ctx_state: ContextState | None, root: int, p0: int, target_embed, target_lm_head):
        """One draft step (§6.1 item 2-3): block [root, MASK × (block_size-1)] at p0.., forward, greedy walk."""
        block = [int(root)] + [self.cfg.mask_token_id] * (self.cfg.block_size - 1)
        out = self.block_forward(ctx_state, block, p0, target_embed, target_lm_head)
        return out, self.greedy_path(root, out.logits, out.hidden, out.raw_logits)


def load_dflash2(directory: str | Path, dtype: torch.dtype = torch.float64) -> DFlash2Ref:
    """A drafter directory (config.json + model.safetensors, §1 and §2.1; the codebooks carry no `.weight`
    suffix) -> DFlash2Ref with every tensor converted to `dtype` and its shape checked."""
    d = Path(directory)
    cfg = parse_config(json.loads((d / "config.json").read_text()))
    return DFlash2Ref(cfg, load_file(str(d / "model.safetensors")), dtype)
