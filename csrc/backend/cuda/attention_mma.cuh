// attention_mma.cuh — attention's two products (q k and p v) on the tf32
// tensor cores (mma.m16n8k8, mma.cuh), for every cache type and head_dim up
// to 256: the target's layers whatever --cache-type, and the drafter's (F32
// by default).  Wider heads keep attention_split_kernel.
//
// Why: the first H100 record spent 10.8 of an 8K prefill's 21.8 s in
// attention_split_kernel (about 1 TFLOPS of f32 fmas fed from shared memory,
// plus a butterfly per score), and an AR step after 8,000 tokens 13 ms more
// than at a short context.  Here a CTA's rows (tokens x query heads of one KV
// head, up to 32) meet a tile of 64 K rows as one 32 x 64 x head_dim product
// and the softmax weights meet 64 V rows as one 32 x 64 x head_dim product.
//
// Same structure as attention_split_kernel: fixed splits of kSplit visible
// indices, tiles of kTile, the combine kernel, one warp's softmax per row.
// Exactness (the batch-invariance contract) holds by construction:
//   * scores: element (row, column) is a fixed instruction sequence over the
//     head's dims — per 32-dim group (a Q8_0 / Q4_0 block), four k-steps of
//     q_hi then q_lo (q split as in matmul_half.cu: 22 of its 24 bits) from 0;
//     then total += group sum (times the column's block scale when quantised),
//     in group order; then times the softmax scale.  An mma element depends
//     only on its row of A and column of B, so neither the other rows (the
//     batch) nor the other columns change it;
//   * weights: the CPU-shaped softmax of attention_split_kernel, row by row;
//     weights past a row's visible count are 0;
//   * p v: a row's tile sum is eight k-steps over the tile's 64 columns (p_hi
//     then p_lo, p first times the V block's scale when quantised) from 0,
//     then out = out * correction + tile sum.  Columns a row does not see
//     have p = 0 and finite V (zero-filled past the tile), so their products
//     add exactly nothing;
//   * when the tile's slots differ between the CTA's tokens (a tree's extra
//     slots), each token takes its own pass with its own slots as columns and
//     keeps only its rows: the same sequences on the same values.
// K and V values enter the instruction exactly (F16 and BF16 fit tf32; Q8_0
// and Q4_0 as their integers, the block scale applied in f32 outside); F32
// values are split like q, and each k-step takes a third product (q_hi times
// the value's low half) after the two.  So versus the CPU's f32 attention the
// difference is 22-bit operands and the hardware's summation (tested within
// backend_ops' 1e-5).  The emulator
// models the instruction (mma.cuh), so there the contract holds bit for bit.
#pragma once
#include "forward_kernels.cuh"
#include "mma.cuh"

namespace dfl {
namespace cuda {
namespace fwd {

constexpr int kMmaAttnRows = 32;          // a CTA's rows: two m-tiles of 16
constexpr int kMmaAttnMaxHeadDim = 256;
// The k-steps' K order: lane t's two k positions (t and t + 4 of the instruction) take dims (or tile columns)
// 2t and 2t + 1 of the step's eight, so each lane's A values are one 8-byte load and its B values one 4-byte
// word of the tile (F16 / BF16 / Q8_0 / Q4_0) or one 8-byte load (F32).  Which dims share a k-step position
// is fixed by the shapes: it changes no result between batches.
//
// The tile in shared memory.  F32 caches: floats, K as [column][dim], V as [column][dim].  Every other type:
// 4-byte words of two 16-bit values (F16 / BF16 as stored; Q8_0 / Q4_0 integers as exact F16), K as
// [column][dim pair] (the cache's own bytes: copied as they are for F16 / BF16), V as [column pair][dim] (the
// values of columns 2c and 2c + 1 of one dim in a word): half the bytes of floats, and one load a lane for
// both of a B fragment's values.
// Row strides, in floats or words, chosen so that every fragment load is conflict-free: q[g][k + 2t] (8 bytes)
// in banks 8g + 2t, K words [g][k / 2 + t] in 4g + t, V words [k / 2 + t][d + g] in 8t + g; F32 K [g][k + 2t]
// (8 bytes) in 8g + 2t, F32 V [k + 2t (+ 1)][d + g] in 8t + g (+ 4).
constexpr int kMmaScStride = kTile + 8;   // a row of weights: p[g][c + 2t] (8 bytes) in banks 8g + 2t
__host__ __device__ constexpr int mma_q_stride(int hd) { return hd + 8; }
__host__ __device__ constexpr int mma_k_stride(int hd) { return hd + 8; }      // F32
__host__ __device__ constexpr int mma_v_stride(int hd) { return hd + 4; }      // F32
__host__ __device__ constexpr int mma_kw_stride(int hd) { return hd / 2 + 4; }  // words: a column's dim pairs
__host__ __device__ constexpr int mma_vw_stride(int hd) { return hd + 8; }      // words: a column pair's dims

// Every cache type the forward accepts (F32, F16, BF16, Q8_0, Q4_0: runtime/forward.cpp) is taken; the head
// decides.
inline bool attn_mma_supported(int head_dim) { return head_dim % 32 == 0 && head_dim <= kMmaAttnMaxHeadDim; }

// q of 16 mt rows, the tile and its block scales, the weights, each token's slots, each row's running
// max / sum / correction, each token's visible count and own flag.  Head_dim 256: 120 KiB for 32 rows, 95 KiB
// for 16 (the 99 KiB a CTA may have on sm_86 / sm_89: backend.cu sizes the rows to the device).
inline size_t attn_mma_smem_bytes(int mt, int toks, int hd) {
  const size_t rows = 16 * (size_t)mt;
  return rows * mma_q_stride(hd) * 4 + (size_t)kTile * mma_k_stride(hd) * 4 + (size_t)kTile * (hd / 32) * 4 +
         rows * kMmaScStride * 4 + (size_t)toks * kTile * 4 + rows * 3 * 4 + (size_t)toks * 4 * 2;
}

// The tile's words: two 16-bit K or V values (F16 bits, or BF16 for BF16 caches) as tf32 operands (exact).
__device__ __forceinline__ void tf32_pair(uint32_t w, bool bf16, uint32_t& lo, uint32_t& hi) {
  lo = __float_as_uint(bf16 ? bf16_bits_to_f32(w & 0xffffu) : f16_bits_to_f32(w & 0xffffu));
  hi = __float_as_uint(bf16 ? bf16_bits_to_f32(w >> 16) : f16_bits_to_f32(w >> 16));
}
// Two 16-bit values of consecutive columns from two words (column c's in a, c + 1's in b): the words of a V
// column pair, one per dim in each half.
__device__ __forceinline__ uint32_t pair_lo(uint32_t a, uint32_t b) { return (a & 0xffffu) | (b << 16); }
__device__ __forceinline__ uint32_t pair_hi(uint32_t a, uint32_t b) { return (a >> 16) | (b & 0xffff0000u); }
__device__ __forceinline__ uint4 select4(int c, uint4 a, uint4 b) {  // c ? a : b, without a branch
  return make_uint4(c ? a.x : b.x, c ? a.y : b.y, c ? a.z : b.z, c ? a.w : b.w);
}
// A lane's N consecutive 16-byte chunks into dst, in pair-swapped order (chunk k ^ 1 at step k) when `swap`:
// lanes whose chunks would start in the same bank quad store alternately, so one store instruction of the
// warp covers every quad (an address and a select, no branch)
template <int N>
__device__ __forceinline__ void store_chunks(uint4* dst, const uint4 (&w)[N], int swap) {
#pragma unroll
  for (int k = 0; k < N; ++k) dst[k ^ swap] = select4(swap, w[k ^ 1], w[k]);
}
// An integer of a Q8_0 / Q4_0 block (|v| <= 128) as F16 bits: exact.
__device__ __forceinline__ uint32_t int_f16_bits(int v) { return f32_to_f16_bits((float)v); }

// f32 -> (hi, lo) tf32 bits, hi + lo carrying 22 of x's 24 significant bits.
__device__ __forceinline__ void attn_split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = tf32_rna_bits(__float_as_uint(x));
  lo = tf32_rna_bits(__float_as_uint(__fsub_rn(x, __uint_as_float(hi))));
}

// f(i, j, e) for each element e of a lane's M x N fragments of 16 x 8 tiles (unrolled: constant indices).
template <int M, int N, class F>
__device__ __forceinline__ void each_frag(F&& f) {
#pragma unroll
  for (int i = 0; i < M; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) f(i, j, e);
}
template <int M, int N>
__device__ __forceinline__ void zero_frags(float (&x)[M][N][4]) {
  each_frag<M, N>([&](int i, int j, int e) { x[i][j][e] = 0.f; });
}

template <int kMT>
__global__ void __launch_bounds__(kAttnThreads, 1) attention_mma_kernel(AttnArgs a) {
  DFL_LAUNCH_BOUND(kAttnThreads);
  constexpr int kRows16 = 16 * kMT, kNj = kMmaAttnMaxHeadDim / 32;
  const int TT = a.tok_per_cta, G = a.heads_per_cta, R = TT * G, hd = a.head_dim, nb = hd / 32;
  const int gs = a.n_head / a.n_head_kv, hgroups = gs / G;
  const int m = blockIdx.y / hgroups, j0 = m * gs + (blockIdx.y % hgroups) * G;  // KV head, first query head
  const int tl0 = blockIdx.x * TT, z = blockIdx.z;                               // first local token, split
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int qs = mma_q_stride(hd), nj = hd / 32, dw0 = warp * (hd / 4);  // p v: warp's dims dw0 .. + hd / 4
  const bool quant = a.kvt == DType::Q8_0 || a.kvt == DType::Q4_0, f32 = a.kvt == DType::F32;
  const bool bf16 = a.kvt == DType::BF16;  // the tile's 16-bit values: BF16, else F16
  DFL_DYNAMIC_SMEM(float, smem);
  float* q = smem;                                                         // [kRows16][qs]
  float* tile = q + kRows16 * qs;                                          // the K or V tile (above)
  uint32_t* const tile_w = reinterpret_cast<uint32_t*>(tile);              // (its words)
  float* bscale = tile + kTile * mma_k_stride(hd);  // [kTile][nb] (after the largest tile: F32 K's)
  float* sc = bscale + kTile * nb;                                         // [kRows16][kMmaScStride]
  int32_t* slot_of = reinterpret_cast<int32_t*>(sc + kRows16 * kMmaScStride);  // [TT][kTile]
  float* run_max = reinterpret_cast<float*>(slot_of + TT * kTile);         // [kRows16]
  float* run_sum = run_max + kRows16;
  float* corr = run_sum + kRows16;
  int32_t* nt_of = reinterpret_cast<int32_t*>(corr + kRows16);  // [TT]
  int32_t* own_of = nt_of + TT;                                 // [TT]
  // a row r is token tl0 + r / G (local to the launch), head j0 + r % G; rows from R on are zeros
  for (int i = tid; i < kRows16 * hd; i += kAttnThreads) {
    const int r = i / hd, d = i % hd;
    float x = 0.f;
    if (r < R) {
      const int tl = min(tl0 + r / G, a.n_tok - 1);  // rows past the launch's tokens read the last, write nothing
      x = a.qg[((int64_t)(a.t0 + tl) * a.n_head + j0 + r % G) * a.q_stride + d];
    }
    q[r * qs + d] = x;
  }
  for (int r = tid; r < kRows16; r += kAttnThreads) run_max[r] = -INFINITY, run_sum[r] = 0.f;
  const int s_begin = z * kSplit, s_stop = attn_split_stop(a, tl0, TT, s_begin);
  float acc[kMT][kNj][4];
  zero_frags(acc);
  auto row_live = [&](int r) { return r < R && nt_of[r / G] > 0; };  // the row sees a slot of this tile
  __syncthreads();
  for (int s0 = s_begin; s0 < s_stop; s0 += kTile) {
    attn_tile_slots(a, tl0, TT, s_begin, s0, slot_of, nt_of, own_of);
    __syncthreads();
    bool shared = true;  // column c is slot s0 + c for every token: one pass for all rows
    int nt_max = 0;
    for (int tt = 0; tt < TT; ++tt) shared = shared && !own_of[tt], nt_max = max(nt_max, nt_of[tt]);
    const int n_pass = shared ? 1 : TT;
    // A pass's columns c < ncols into `tile` in the layout of its type (above), Q8_0 / Q4_0 with their blocks'
    // scales in bscale[c][b]; columns from ncols on are zeros.
    auto load = [&](const uint8_t* cache, bool v_side, int pass) {
      const int ncols = shared ? nt_max : nt_of[pass];
      const uint8_t* base = cache + (int64_t)m * a.head_bytes;
      auto row_at = [&](int c) {
        return reinterpret_cast<const uint4*>(base +
                                              (int64_t)(shared ? s0 + c : slot_of[pass * kTile + c]) * a.kv_row);
      };
      constexpr int kBatch = 4;  // 16-byte loads in flight a thread before their stores
      if (f32 || (!quant && !v_side)) {
        // F32 K and V, F16 / BF16 K: the rows' bytes as they are, 16 bytes a load (head_dim % 32 == 0: rows and
        // heads start 64-byte aligned)
        const int chunks = hd / (f32 ? 4 : 8);
        const int stride = f32 ? (v_side ? mma_v_stride(hd) : mma_k_stride(hd)) : mma_kw_stride(hd);  // 4-byte units
        for (int i0 = tid; i0 < kTile * chunks; i0 += kBatch * kAttnThreads) {
          uint4 u[kBatch];
#pragma unroll
          for (int k = 0; k < kBatch; ++k) {
            const int i = i0 + k * kAttnThreads, c = i / chunks;
            u[k] = make_uint4(0, 0, 0, 0);
            if (i < kTile * chunks && c < ncols) u[k] = __ldg(row_at(c) + i % chunks);
          }
#pragma unroll
          for (int k = 0; k < kBatch; ++k) {
            const int i = i0 + k * kAttnThreads;
            if (i >= kTile * chunks) break;
            *reinterpret_cast<uint4*>(tile_w + (i / chunks) * stride + 4 * (i % chunks)) = u[k];
          }
        }
        return;
      }
      const int vsw = mma_vw_stride(hd);
      if (!quant) {
        // F16 / BF16 V: a thread takes 8 dims of a column pair, the two columns' values interleaved into 8 words
        // (32 bytes: chunks x and x + 4 start in one bank quad, so chunks with bit 2 set store pair-swapped)
        const int chunks = hd / 8;
        for (int i0 = tid; i0 < kTile / 2 * chunks; i0 += kBatch / 2 * kAttnThreads) {
          uint4 u[kBatch / 2][2];
#pragma unroll
          for (int k = 0; k < kBatch / 2; ++k) {
            const int i = i0 + k * kAttnThreads, cp = i / chunks;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              u[k][h] = make_uint4(0, 0, 0, 0);
              if (i < kTile / 2 * chunks && 2 * cp + h < ncols) u[k][h] = __ldg(row_at(2 * cp + h) + i % chunks);
            }
          }
#pragma unroll
          for (int k = 0; k < kBatch / 2; ++k) {
            const int i = i0 + k * kAttnThreads, x = i % chunks;
            if (i >= kTile / 2 * chunks) break;
            const uint4 c0 = u[k][0], c1 = u[k][1];
            const uint4 words[2] = {
                make_uint4(pair_lo(c0.x, c1.x), pair_hi(c0.x, c1.x), pair_lo(c0.y, c1.y), pair_hi(c0.y, c1.y)),
                make_uint4(pair_lo(c0.z, c1.z), pair_hi(c0.z, c1.z), pair_lo(c0.w, c1.w), pair_hi(c0.w, c1.w))};
            store_chunks(reinterpret_cast<uint4*>(tile_w + (i / chunks) * vsw + 8 * x), words, (x >> 2) & 1);
          }
        }
        return;
      }
      // Q8_0 / Q4_0: a thread takes one block (32 dims) of a column (K) or of a column pair (V), its integers as
      // F16 (blocks start at even offsets: 16-bit loads)
      const bool q8 = a.kvt == DType::Q8_0;
      const int block_bytes = q8 ? (int)sizeof(block_q8_0) : (int)sizeof(block_q4_0);
      auto block_f16 = [&](int c, int b, uint32_t (&f)[32]) {  // column c's block b; zeros past ncols
        if (c >= ncols) {
#pragma unroll
          for (int e = 0; e < 32; ++e) f[e] = 0u;
          bscale[c * nb + b] = 0.f;
          return;
        }
        const uint16_t* h = reinterpret_cast<const uint16_t*>(reinterpret_cast<const uint8_t*>(row_at(c)) +
                                                              (int64_t)b * block_bytes);
        bscale[c * nb + b] = f16_bits_to_f32(h[0]);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const uint32_t u0 = h[1 + 2 * k], u1 = h[2 + 2 * k];  // qs bytes 4k .. 4k + 3
          if (q8) {
            f[4 * k] = int_f16_bits((int8_t)(u0 & 0xffu)), f[4 * k + 1] = int_f16_bits((int8_t)(u0 >> 8));
            f[4 * k + 2] = int_f16_bits((int8_t)(u1 & 0xffu)), f[4 * k + 3] = int_f16_bits((int8_t)(u1 >> 8));
          } else if (k < 4) {  // qs byte i holds elements i (low nibble) and 16 + i (high)
            f[4 * k] = int_f16_bits((int)(u0 & 15u) - 8), f[4 * k + 1] = int_f16_bits((int)((u0 >> 8) & 15u) - 8);
            f[4 * k + 2] = int_f16_bits((int)(u1 & 15u) - 8), f[4 * k + 3] = int_f16_bits((int)((u1 >> 8) & 15u) - 8);
            f[16 + 4 * k] = int_f16_bits((int)((u0 >> 4) & 15u) - 8);
            f[17 + 4 * k] = int_f16_bits((int)((u0 >> 12) & 15u) - 8);
            f[18 + 4 * k] = int_f16_bits((int)((u1 >> 4) & 15u) - 8);
            f[19 + 4 * k] = int_f16_bits((int)((u1 >> 12) & 15u) - 8);
          }
        }
      };
      if (!v_side) {
        const int ksw = mma_kw_stride(hd);
        for (int i = tid; i < kTile * nb; i += kAttnThreads) {
          const int c = i % kTile, b = i / kTile;  // a warp: 32 columns of one block
          uint32_t f[32];
          block_f16(c, b, f);
          uint4* dst = reinterpret_cast<uint4*>(tile_w + c * ksw + 16 * b);
#pragma unroll
          for (int k = 0; k < 4; ++k)
            dst[k] = make_uint4(f[8 * k] | f[8 * k + 1] << 16, f[8 * k + 2] | f[8 * k + 3] << 16,
                                f[8 * k + 4] | f[8 * k + 5] << 16, f[8 * k + 6] | f[8 * k + 7] << 16);
        }
        return;
      }
      for (int i = tid; i < kTile / 2 * nb; i += kAttnThreads) {
        const int cp = i % (kTile / 2), b = i / (kTile / 2);  // a warp: 32 column pairs of one block
        uint32_t f0[32], f1[32];
        block_f16(2 * cp, b, f0);
        block_f16(2 * cp + 1, b, f1);
        uint4 words[8];
#pragma unroll
        for (int k = 0; k < 8; ++k)
          words[k] = make_uint4(f0[4 * k] | f1[4 * k] << 16, f0[4 * k + 1] | f1[4 * k + 1] << 16,
                                f0[4 * k + 2] | f1[4 * k + 2] << 16, f0[4 * k + 3] | f1[4 * k + 3] << 16);
        // (column pairs 4 apart start in one bank quad, vsw % 32 == 8: every other group of four stores pair-swapped)
        store_chunks(reinterpret_cast<uint4*>(tile_w + cp * vsw + 32 * b), words, (cp >> 2) & 1);
      }
    };
    auto pass_rows = [&](int pass, int& r_lo, int& r_hi) {
      r_lo = shared ? 0 : pass * G;
      r_hi = shared ? R : (pass + 1) * G;
    };
    // ---- scores: warp w takes columns 16 w .. 16 w + 15 (two n-tiles) for the pass's m-tiles
    for (int pass = 0; pass < n_pass; ++pass) {
      if ((shared ? nt_max : nt_of[pass]) == 0) continue;  // (uniform: shared memory after a barrier)
      int r_lo, r_hi;
      pass_rows(pass, r_lo, r_hi);
      const int ks = mma_k_stride(hd), ksw = mma_kw_stride(hd);
      load(a.k_cache, false, pass);
      __syncthreads();
      const int n0 = 16 * warp;
      float tot[kMT][2][4];
      zero_frags(tot);
      for (int b = 0; b < nb; ++b) {
        float gsum[kMT][2][4];
        zero_frags(gsum);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const int k0 = 32 * b + 8 * kk;
          uint32_t bf[2][2], bl[2][2];  // B = K^T (8 dims x 8 columns); bl: an F32 value's low half
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int col = n0 + 8 * j + g;
            if (f32) {
              const float2 kv = *reinterpret_cast<const float2*>(tile + col * ks + k0 + 2 * t);
              attn_split_tf32(kv.x, bf[j][0], bl[j][0]);  // an F32 value's two halves
              attn_split_tf32(kv.y, bf[j][1], bl[j][1]);
            } else {
              tf32_pair(tile_w[col * ksw + k0 / 2 + t], bf16, bf[j][0], bf[j][1]);
              bl[j][0] = bl[j][1] = 0u;
            }
          }
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            if (16 * mt >= r_hi || 16 * mt + 16 <= r_lo) continue;  // (uniform)
            const float* qr = q + (16 * mt + g) * qs + k0 + 2 * t;
            const float2 qa = *reinterpret_cast<const float2*>(qr), qb = *reinterpret_cast<const float2*>(qr + 8 * qs);
            const float qv[4] = {qa.x, qb.x, qa.y, qb.y};
            uint32_t ah[4], al[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) attn_split_tf32(qv[e], ah[e], al[e]);
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              mma_m16n8k8_tf32(gsum[mt][j], ah, bf[j], gsum[mt][j]);
              mma_m16n8k8_tf32(gsum[mt][j], al, bf[j], gsum[mt][j]);
              if (f32) mma_m16n8k8_tf32(gsum[mt][j], ah, bl[j], gsum[mt][j]);
            }
          }
        }
        each_frag<kMT, 2>([&](int mt, int j, int e) {
          const int col = n0 + 8 * j + 2 * t + (e & 1);
          const float gv = quant ? __fmul_rn(gsum[mt][j][e], bscale[col * nb + b]) : gsum[mt][j][e];
          tot[mt][j][e] = __fadd_rn(tot[mt][j][e], gv);
        });
      }
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h) {  // elements 2h, 2h + 1: columns 2t, 2t + 1 of one row, one 8-byte store
            const int row = 16 * mt + g + 8 * h, col = n0 + 8 * j + 2 * t;
            if (row >= r_lo && row < r_hi)
              *reinterpret_cast<float2*>(sc + row * kMmaScStride + col) =
                  make_float2(__fmul_rn(tot[mt][j][2 * h], a.scale), __fmul_rn(tot[mt][j][2 * h + 1], a.scale));
          }
      __syncthreads();  // the tile is rewritten by the next pass
    }
    // ---- softmax statistics: a warp per row (attention_split_kernel's); weights past nt are 0
    for (int r = warp; r < kRows16; r += kAttnThreads / 32) {
      const int nt = r < R ? nt_of[r / G] : 0;
      float* sr = sc + r * kMmaScStride;
      if (nt > 0) {
        attn_softmax_row(sr, nt, run_max[r], run_sum[r], corr[r]);
      } else {  // nothing visible in this tile (or a padding row): zero weights, the row left as it is
        sr[lane] = 0.f;
        sr[lane + 32] = 0.f;
      }
    }
    __syncthreads();
    // ---- p v: each live row's output times its correction, then each pass's tile sum added to its rows
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = 16 * mt + g + 8 * h;
        if (!row_live(row)) continue;
        const float c = corr[row];
#pragma unroll
        for (int j = 0; j < kNj; ++j)
          if (j < nj) acc[mt][j][2 * h] = __fmul_rn(acc[mt][j][2 * h], c), acc[mt][j][2 * h + 1] = __fmul_rn(acc[mt][j][2 * h + 1], c);
      }
    for (int pass = 0; pass < n_pass; ++pass) {
      if ((shared ? nt_max : nt_of[pass]) == 0) continue;
      int r_lo, r_hi;
      pass_rows(pass, r_lo, r_hi);
      const int vs = mma_v_stride(hd), vsw = mma_vw_stride(hd);
      load(a.v_cache, true, pass);
      __syncthreads();
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        if (16 * mt >= r_hi || 16 * mt + 16 <= r_lo) continue;  // (uniform)
        float part[1][kNj][4];  // (one m-tile's)
        zero_frags(part);
        for (int kk = 0; kk < kTile / 8; ++kk) {
          const int c0 = 8 * kk;
          const float* pr = sc + (16 * mt + g) * kMmaScStride + c0 + 2 * t;
          // A (16 x 8): rows g, g + 8 x the weights of columns 2t, 2t + 1 (k positions t, t + 4)
          const float2 pa = *reinterpret_cast<const float2*>(pr),
                       pb = *reinterpret_cast<const float2*>(pr + 8 * kMmaScStride);
          const float pw[4] = {pa.x, pb.x, pa.y, pb.y};
          uint32_t ah[4] = {}, al[4] = {};
          if (!quant) {
#pragma unroll
            for (int e = 0; e < 4; ++e) attn_split_tf32(pw[e], ah[e], al[e]);
          }
#pragma unroll
          for (int j = 0; j < kNj; ++j) {
            if (j >= nj) break;
            const int d0 = dw0 + 8 * j;
            if (quant) {  // the weights times the V block's scale of columns 2t and 2t + 1
              const int b = d0 / 32;
              const float s0 = bscale[(c0 + 2 * t) * nb + b], s1 = bscale[(c0 + 2 * t + 1) * nb + b];
              attn_split_tf32(__fmul_rn(pw[0], s0), ah[0], al[0]);
              attn_split_tf32(__fmul_rn(pw[1], s0), ah[1], al[1]);
              attn_split_tf32(__fmul_rn(pw[2], s1), ah[2], al[2]);
              attn_split_tf32(__fmul_rn(pw[3], s1), ah[3], al[3]);
            }
            // B (8 x 8): V rows (columns of the tile) 2t, 2t + 1 x dims d0 + g
            uint32_t bf[2], bl[2] = {0u, 0u};
            if (f32) {
              attn_split_tf32(tile[(c0 + 2 * t) * vs + d0 + g], bf[0], bl[0]);
              attn_split_tf32(tile[(c0 + 2 * t + 1) * vs + d0 + g], bf[1], bl[1]);
            } else {
              tf32_pair(tile_w[(c0 / 2 + t) * vsw + d0 + g], bf16, bf[0], bf[1]);
            }
            mma_m16n8k8_tf32(part[0][j], ah, bf, part[0][j]);
            mma_m16n8k8_tf32(part[0][j], al, bf, part[0][j]);
            if (f32) mma_m16n8k8_tf32(part[0][j], ah, bl, part[0][j]);
          }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = 16 * mt + g + 8 * h;
          if (row < r_lo || row >= r_hi || !row_live(row)) continue;
#pragma unroll
          for (int j = 0; j < kNj; ++j)
            if (j < nj)
              acc[mt][j][2 * h] = __fadd_rn(acc[mt][j][2 * h], part[0][j][2 * h]),
              acc[mt][j][2 * h + 1] = __fadd_rn(acc[mt][j][2 * h + 1], part[0][j][2 * h + 1]);
        }
      }
      __syncthreads();  // the tile is rewritten by the next pass
    }
    __syncthreads();  // sc / slot_of / nt_of are rewritten by the next tile
  }
  // a row that saw no slot in this split leaves max -inf, sum 0, out 0
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = 16 * mt + g + 8 * h;
      if (row >= R || tl0 + row / G >= a.n_tok) continue;
      float* pt = a.part + (((int64_t)(tl0 + row / G) * a.n_head + j0 + row % G) * a.n_split + z) * (hd + 2);
#pragma unroll
      for (int j = 0; j < kNj; ++j)
        if (j < nj) pt[dw0 + 8 * j + 2 * t] = acc[mt][j][2 * h], pt[dw0 + 8 * j + 2 * t + 1] = acc[mt][j][2 * h + 1];
      if (warp == 0 && t == 0) pt[hd] = run_max[row], pt[hd + 1] = run_sum[row];
    }
}

}  // namespace fwd
}  // namespace cuda
}  // namespace dfl
