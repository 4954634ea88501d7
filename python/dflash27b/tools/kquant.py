"""Vectorised numpy encoders for ggml block formats (Q4_K, Q5_K, Q6_K, plus Q8_0/Q4_0 via `gguf`).

Why: `gguf` (PyPI) can dequantize every type but quantize none of the K-quants, and our tools need
K-quant files (the 27B target is Q4_K_M). Two entry points:
  * `quantize(x, qtype)`: straightforward rounding with per-sub-block scale/min (no llama.cpp search), exact
    ggml byte layouts (qwen35.md §4.2), so any ggml-compatible reader decodes them;
  * `random_blocks(qtype, n_rows, n_cols, std, rng)`: random but well-conditioned blocks written directly
    (random scales and packed quants) with dequantized std ~ `std` and mean ~ 0, cheap enough to stream a
    27B-shaped file; the packed nibbles/bits of a uniformly random quant are just random bytes.
All functions take/return row-major arrays: rows of `n_cols` values -> rows of `row_bytes(qtype, n_cols)` bytes.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf import quants as gq

QK_K = 256
F16, F32, U8 = np.float16, np.float32, np.uint8


def row_bytes(qtype: T, n_cols: int) -> int:
    blk, size = GGML_QUANT_SIZES[qtype]
    if n_cols % blk:
        raise ValueError(f"{qtype.name}: row of {n_cols} is not a multiple of the block size {blk}")
    return n_cols // blk * size


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b with 0 where b == 0."""
    safe = np.where(b == 0, 1, b)
    return np.where(b == 0, 0, a / safe)


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(F16).reshape(-1, 1).view(U8)


def pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit (scale, min) pairs per block -> the 12-byte Q4_K/Q5_K scale field (inverse of §4.2 unpack)."""
    sc, mn = sc.astype(U8), mn.astype(U8)
    out = np.empty((sc.shape[0], 12), U8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    return out


def _asym_k(x: np.ndarray, nmax: int):
    """Per 256-block: f16 d, dmin; 6-bit scales/mins per 32-sub-block; quants in [0, nmax]."""
    xb = x.reshape(-1, 8, 32).astype(F32)
    lo = np.minimum(xb.min(-1), 0.0)
    hi = np.maximum(xb.max(-1), lo)
    scale, mins = (hi - lo) / nmax, -lo
    d = (scale.max(-1) / 63).astype(F16)
    dmin = (mins.max(-1) / 63).astype(F16)
    df, dmf = d.astype(F32)[:, None], dmin.astype(F32)[:, None]
    sc = np.clip(np.rint(_div(scale, df)), 0, 63)
    mn = np.clip(np.rint(_div(mins, dmf)), 0, 63)
    eff_d, eff_m = (df * sc)[..., None], (dmf * mn)[..., None]
    q = np.clip(np.rint(_div(xb + eff_m, eff_d)), 0, nmax).astype(U8)
    return d, dmin, pack_k_scales(sc, mn), q


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _asym_k(x, 15)
    q = q.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qs], axis=1)
    return blocks.reshape(x.shape[0], -1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _asym_k(x, 31)                            # q: (nb, 8, 32)
    qh = np.zeros((q.shape[0], 32), U8)
    for s in range(8):                                             # 8 bit planes, vectorised over blocks
        qh |= ((q[:, s] >> 4) & 1) << s
    lo = (q & 15).reshape(-1, 4, 2, 32)
    qs = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qh, qs], axis=1)
    return blocks.reshape(x.shape[0], -1)


def _pack_q6_k(u: np.ndarray, sc: np.ndarray, d: np.ndarray) -> np.ndarray:
    """u: (nb, 256) unsigned 6-bit quants (q + 32); sc: (nb, 16) int8; d: (nb,) f16."""
    u = u.reshape(-1, 2, 4, 32)                                    # [half n, quarter j, l]: elem 128n+32j+l
    ql = np.empty((u.shape[0], 2, 64), U8)
    ql[:, :, :32] = (u[:, :, 0] & 15) | ((u[:, :, 2] & 15) << 4)
    ql[:, :, 32:] = (u[:, :, 1] & 15) | ((u[:, :, 3] & 15) << 4)
    qh = (u[:, :, 0] >> 4) | ((u[:, :, 1] >> 4) << 2) | ((u[:, :, 2] >> 4) << 4) | ((u[:, :, 3] >> 4) << 6)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.astype(np.int8).view(U8),
                           _f16_bytes(d)], axis=1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    xb = x.reshape(-1, 16, 16).astype(F32)
    scale = np.abs(xb).max(-1) / 31
    d = (scale.max(-1) / 127).astype(F16)
    sc = np.clip(np.rint(_div(scale, d.astype(F32)[:, None])), 0, 127)
    eff = (d.astype(F32)[:, None] * sc)[..., None]
    q = np.clip(np.rint(_div(xb, eff)), -32, 31)
    u = (q + 32).astype(U8).reshape(-1, QK_K)
    return _pack_q6_k(u, sc, d).reshape(x.shape[0], -1)


def quantize(x: np.ndarray, qtype: T) -> np.ndarray:
    """Encode a 2-D float array (rows, cols) as ggml blocks; returns uint8 (rows, row_bytes)."""
    x = np.ascontiguousarray(x, dtype=F32)
    rows, cols = x.shape
    row_bytes(qtype, cols)
    if qtype == T.Q4_K:
        return quantize_q4_k(x)
    if qtype == T.Q5_K:
        return quantize_q5_k(x)
    if qtype == T.Q6_K:
        return quantize_q6_k(x)
    if qtype == T.F32:
        return x.view(U8)
    out = gq.quantize(x, qtype)                                   # Q8_0, Q4_0, BF16, F16
    return np.ascontiguousarray(out).view(U8).reshape(rows, -1)


def dequantize(data: np.ndarray, qtype: T, n_cols: int) -> np.ndarray:
    """Inverse of `quantize` via gguf's reference decoders (for tests and tools)."""
    return gq.dequantize(np.ascontiguousarray(data).view(U8).reshape(-1, row_bytes(qtype, n_cols)), qtype)


# ----------------------------------------------------------------------------------------------------------
# random well-conditioned blocks

_SC_LO, _SC_HI = 40, 63              # Q4_K/Q5_K 6-bit scales drawn uniformly from [40, 63]
_E_SC2 = np.mean(np.arange(_SC_LO, _SC_HI + 1) ** 2.0)
_D_JITTER = 0.1                      # per-block d drawn from base * U(1 - j, 1 + j)
_E_J2 = 1 + _D_JITTER ** 2 / 3


def _uniform_q2(levels: int) -> float:
    """E[q^2] of q uniform on {0..levels-1} centred by its mean (variance)."""
    return (levels * levels - 1) / 12.0


def _rand_bytes(rng: np.random.Generator, nb: int, n: int) -> np.ndarray:
    return np.frombuffer(rng.bytes(nb * n), U8).reshape(nb, n)


def _rand_d(rng, nb: int, base: float, signed: bool) -> np.ndarray:
    d = base * rng.uniform(1 - _D_JITTER, 1 + _D_JITTER, nb)
    if signed:
        d *= rng.choice(np.array([-1.0, 1.0]), nb)
    return d.astype(F16)


def random_blocks(qtype: T, n_rows: int, n_cols: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of `qtype` whose dequantized values have std ~ `std` and mean ~ 0; (rows, row_bytes)."""
    rb = row_bytes(qtype, n_cols)
    blk, size = GGML_QUANT_SIZES[qtype]
    nb = n_rows * n_cols // blk
    if qtype in (T.Q4_K, T.Q5_K):
        levels = 16 if qtype == T.Q4_K else 32
        mid = (levels - 1) / 2                                    # mean quant; min offset cancels it
        base = std / np.sqrt(_E_SC2 * _uniform_q2(levels) * _E_J2)
        d = _rand_d(rng, nb, base, signed=False)
        dmin = (d.astype(F32) * (levels // 2)).astype(F16)       # exact (power of two)
        sc = rng.integers(_SC_LO, _SC_HI + 1, (nb, 8))
        mn = np.clip(np.rint(sc * mid / (levels // 2)), 0, 63)
        parts = [_f16_bytes(d), _f16_bytes(dmin), pack_k_scales(sc, mn)]
        if qtype == T.Q5_K:
            parts.append(_rand_bytes(rng, nb, 32))
        parts.append(_rand_bytes(rng, nb, 128))
        out = np.concatenate(parts, axis=1)
    elif qtype == T.Q6_K:
        sc_abs = rng.integers(64, 128, (nb, 16))
        e_sc2 = np.mean(np.arange(64, 128) ** 2.0)
        base = std / np.sqrt(e_sc2 * (_uniform_q2(64) + 0.25) * _E_J2)
        d = _rand_d(rng, nb, base, signed=False)
        sc = sc_abs * rng.choice(np.array([-1, 1]), (nb, 16))   # random sign cancels the -0.5 quant mean
        out = np.concatenate([_rand_bytes(rng, nb, 192), sc.astype(np.int8).view(U8), _f16_bytes(d)], axis=1)
    elif qtype == T.Q8_0:
        base = std / np.sqrt((_uniform_q2(256) + 0.25) * _E_J2)
        out = np.concatenate([_f16_bytes(_rand_d(rng, nb, base, signed=True)), _rand_bytes(rng, nb, 32)], axis=1)
    elif qtype == T.Q4_0:
        base = std / np.sqrt((_uniform_q2(16) + 0.25) * _E_J2)
        out = np.concatenate([_f16_bytes(_rand_d(rng, nb, base, signed=True)), _rand_bytes(rng, nb, 16)], axis=1)
    else:
        raise ValueError(f"random_blocks: unsupported type {qtype.name}")
    assert out.shape[1] == size
    return out.reshape(n_rows, rb)
