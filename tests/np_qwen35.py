"""Test helper (not a test): a plain numpy forward of a qwen35 GGUF, written from qwen35.md §3.

Used to check that converted/synthetic files mean what the sheet says (tiled V heads, +1 norms, -exp(A_log),
per-head [q | gate] packing) by comparing with transformers' logits. Token-by-token (recurrent GDN form),
float64, no cache tricks: slow but obviously correct for a few dozen tokens on the tiny model.
"""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader
from gguf import quants as gq


def load(path) -> tuple[dict, dict[str, np.ndarray]]:
    r = GGUFReader(path)
    meta = {k: f.contents() for k, f in r.fields.items() if k.startswith("qwen35.")}
    w = {}
    for t in r.tensors:
        shape = tuple(int(v) for v in reversed(t.shape))
        w[t.name] = gq.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape).astype(np.float64)
    return meta, w


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _silu(x):
    return x / (1 + np.exp(-x))


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _softplus(x):
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))


def _attention(meta: dict, w: dict[str, np.ndarray], p: str, h: np.ndarray) -> np.ndarray:
    """The gated full-attention sublayer of layer prefix p over normed rows h [T, H] at positions 0..T-1."""
    a = "qwen35."
    eps = meta[a + "attention.layer_norm_rms_epsilon"]
    nh, nkv, hd = meta[a + "attention.head_count"], meta[a + "attention.head_count_kv"], meta[a + "attention.key_length"]
    nrot, base = meta[a + "rope.dimension_count"], meta[a + "rope.freq_base"]
    T = len(h)
    inv = base ** (-np.arange(nrot // 2) * 2.0 / nrot)

    def rope(v, pos):                                   # v: [heads, hd], NeoX half split on first nrot dims
        th = pos * inv
        c, s = np.cos(th), np.sin(th)
        a1, b1 = v[:, :nrot // 2].copy(), v[:, nrot // 2:nrot].copy()
        v = v.copy()
        v[:, :nrot // 2], v[:, nrot // 2:nrot] = a1 * c - b1 * s, a1 * s + b1 * c
        return v

    qg = (h @ w[p + "attn_q.weight"].T).reshape(T, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:]
    k = (h @ w[p + "attn_k.weight"].T).reshape(T, nkv, hd)
    v = (h @ w[p + "attn_v.weight"].T).reshape(T, nkv, hd)
    q = np.stack([rope(_rms(q[t], w[p + "attn_q_norm.weight"], eps), t) for t in range(T)])
    k = np.stack([rope(_rms(k[t], w[p + "attn_k_norm.weight"], eps), t) for t in range(T)])
    grp = nh // nkv
    o = np.empty((T, nh, hd))
    for j in range(nh):
        sc = q[:, j] @ k[:, j // grp].T / np.sqrt(hd)
        sc = np.where(np.tril(np.ones((T, T), bool)), sc, -np.inf)
        pr = np.exp(sc - sc.max(-1, keepdims=True))
        o[:, j] = (pr / pr.sum(-1, keepdims=True)) @ v[:, j // grp]
    return (o * _sigmoid(gate)).reshape(T, -1) @ w[p + "attn_output.weight"].T


def _mlp(meta: dict, w: dict[str, np.ndarray], p: str, x: np.ndarray) -> np.ndarray:
    """x + SwiGLU(post_attention_norm(x)) of layer prefix p."""
    h2 = _rms(x, w[p + "post_attention_norm.weight"], meta["qwen35.attention.layer_norm_rms_epsilon"])
    return x + (_silu(h2 @ w[p + "ffn_gate.weight"].T) * (h2 @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T


def forward(meta: dict, w: dict[str, np.ndarray], ids: list[int], hidden: bool = False) -> np.ndarray:
    """Logits [len(ids), V] for one sequence starting at position 0 (hidden: the last layer's residual
    [len(ids), H] instead).  A file's MTP layers (qwen35.nextn_predict_layers) are not part of the trunk."""
    a = "qwen35."
    L, eps = meta[a + "block_count"], meta[a + "attention.layer_norm_rms_epsilon"]
    L -= meta.get(a + "nextn_predict_layers", 0)
    K, dk = meta[a + "ssm.conv_kernel"], meta[a + "ssm.state_size"]
    nk, nv = meta[a + "ssm.group_count"], meta[a + "ssm.time_step_rank"]
    dv = meta[a + "ssm.inner_size"] // nv
    rec = meta[a + "attention.recurrent_layers"]
    T = len(ids)
    x = w["token_embd.weight"][ids]
    for i in range(L):
        p = f"blk.{i}."
        h = _rms(x, w[p + "attn_norm.weight"], eps)
        out = np.zeros_like(x)
        if rec[i]:
            m = h @ w[p + "attn_qkv.weight"].T
            z = h @ w[p + "attn_gate.weight"].T
            b = h @ w[p + "ssm_beta.weight"].T
            al = h @ w[p + "ssm_alpha.weight"].T
            conv = w[p + "ssm_conv1d.weight"]           # [Cconv, K]
            mp = np.concatenate([np.zeros((K - 1, m.shape[1])), m])
            S = np.zeros((nv, dk, dv))
            for t in range(T):
                c = _silu(np.einsum("kc,ck->c", mp[t:t + K], conv))
                q = c[:nk * dk].reshape(nk, dk)
                k = c[nk * dk:2 * nk * dk].reshape(nk, dk)
                v = c[2 * nk * dk:].reshape(nv, dv)
                q = q / np.maximum(np.linalg.norm(q, axis=-1, keepdims=True), eps) / np.sqrt(dk)
                k = k / np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), eps)
                y = np.empty((nv, dv))
                for hh in range(nv):
                    kh = hh % nk                          # tiled GGUF order
                    beta = _sigmoid(b[t, hh])
                    g = w[p + "ssm_a"][hh] * _softplus(al[t, hh] + w[p + "ssm_dt.bias"][hh])
                    S[hh] *= np.exp(g)
                    delta = beta * (v[hh] - S[hh].T @ k[kh])
                    S[hh] += np.outer(k[kh], delta)
                    o = S[hh].T @ q[kh]
                    y[hh] = _rms(o, w[p + "ssm_norm.weight"], eps) * _silu(z[t, hh * dv:(hh + 1) * dv])
                out[t] = w[p + "ssm_out.weight"] @ y.reshape(-1)
        else:
            out = _attention(meta, w, p, h)
        x = _mlp(meta, w, p, x + out)
    if hidden:
        return x
    head = w.get("output.weight", w["token_embd.weight"])
    return _rms(x, w["output_norm.weight"], eps) @ head.T


def mtp_logits(meta: dict, w: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """The MTP head's logits [len(ids), V], written from vLLM's qwen3_5_mtp and llama.cpp's graph_mtp: row p
    reads the embedding of ids[p] and the trunk's hidden at p - 1 after output_norm (zeros for p = 0),
    u = eh_proj . [rms(e) * enorm | rms(h) * hnorm], one full-attention layer (its own causal KV, RoPE at p),
    then rms(.) * shared_head_norm and the trunk's output head."""
    a = "qwen35."
    eps = meta[a + "attention.layer_norm_rms_epsilon"]
    n = meta[a + "block_count"] - meta[a + "nextn_predict_layers"]
    p = f"blk.{n}."
    x_trunk = forward(meta, w, ids, hidden=True)
    h = np.zeros_like(x_trunk)
    h[1:] = _rms(x_trunk[:-1], w["output_norm.weight"], eps)
    e = w["token_embd.weight"][ids]
    u = np.concatenate([_rms(e, w[p + "nextn.enorm.weight"], eps), _rms(h, w[p + "nextn.hnorm.weight"], eps)], -1)
    x = u @ w[p + "nextn.eh_proj.weight"].T
    x = x + _attention(meta, w, p, _rms(x, w[p + "attn_norm.weight"], eps))
    x = _mlp(meta, w, p, x)
    head = w.get("output.weight", w["token_embd.weight"])
    return _rms(x, w[p + "nextn.shared_head_norm.weight"], eps) @ head.T
