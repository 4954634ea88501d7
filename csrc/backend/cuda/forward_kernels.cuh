// forward_kernels.cuh — the CUDA twins of csrc/backend/cpu/cpu_backend.cpp's ops
// (every op but matmul, which is matmul_kernels.cuh).
//
// Each kernel computes a token's values from that token's inputs alone, in a
// fixed order (a CTA reduces one row, one head or one channel), so results do
// not depend on the batch.  They agree with the CPU within f32 rounding: the
// CPU sums some norms in double and quantises activations for K-quant matmuls;
// tests state the tolerances.  Written against the small set of intrinsics the
// CPU emulator (csrc/backend/cuda/emu) provides, so CI runs this source too.
#pragma once
#include "common.cuh"
#include "formats.cuh"
#include "model/rope.h"

namespace dfl {
namespace cuda {
namespace fwd {

__device__ __forceinline__ float silu_f(float x) { return x / (1.f + expf(-x)); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float softplus_f(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// Sum of v over the warp (an xor butterfly: every lane gets the same total).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum of v over the CTA (blockDim.x a multiple of 32, <= 1024); every thread
// gets the total.  `red` is 32 floats of shared memory; the summation order
// is fixed by the CTA shape alone.
__device__ __forceinline__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // `red` may still be read by a previous call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = 0.f;
  for (int w = 0; w < nw; ++w) t += red[w];
  return t;
}

__device__ __forceinline__ float block_max(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = red[0];
  for (int w = 1; w < nw; ++w) t = fmaxf(t, red[w]);
  return t;
}

// ---------------------------------------------------------------- embed
// x[t] = row tokens[t] of the table; one CTA per token, 8 values per thread step.
template <class F>
__global__ void embed_kernel(const uint8_t* __restrict__ table, int64_t row_bytes, int64_t cols,
                             const int32_t* __restrict__ tokens, float* __restrict__ x) {
  const int t = blockIdx.x;
  const uint8_t* row = table + (int64_t)tokens[t] * row_bytes;
  float* xt = x + (int64_t)t * cols;
  for (int64_t k = (int64_t)threadIdx.x * 8; k < cols; k += (int64_t)blockDim.x * 8) {
    float v[8];
    deq8<F>(row, k, v);
    for (int i = 0; i < 8; ++i) xt[k + i] = v[i];
  }
}

// ---------------------------------------------------------------- rmsnorm
// One CTA per row (in place allowed: each thread rewrites only what it read).
__global__ void rmsnorm_kernel(const float* x, const float* __restrict__ w, int dim, float eps, float* y) {
  DFL_STATIC_SMEM(float, red, [32]);
  const float* xr = x + (int64_t)blockIdx.x * dim;
  float* yr = y + (int64_t)blockIdx.x * dim;
  float ss = 0.f;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
  ss = block_sum(ss, red);
  const float scale = 1.f / sqrtf(ss / (float)dim + eps);
  for (int i = threadIdx.x; i < dim; i += blockDim.x) yr[i] = w ? xr[i] * scale * w[i] : xr[i] * scale;
}

// The same for rows of dim a multiple of 4 (up to 16384): thread i takes values 4i..4i+3, then
// 4(i + width).., at most PV such quads, and holds them in registers between the two passes; the CTA
// is as wide as that needs.  An AR step's norm is one row, which the loop above walks 20 loads deep
// on 256 threads, twice.  The summation order follows from dim alone (the launch picks PV and the
// width from it), so a row's result does not depend on the batch, nor on whether the rows are
// 16-byte aligned (float4 loads) or not (four scalar loads, the same values in the same order).
__device__ __forceinline__ float4 ld_quad(const float* p, bool vec) {
  return vec ? *reinterpret_cast<const float4*>(p) : make_float4(p[0], p[1], p[2], p[3]);
}
__device__ __forceinline__ void st_quad(float* p, float4 v, bool vec) {
  if (vec) {
    *reinterpret_cast<float4*>(p) = v;
  } else {
    p[0] = v.x, p[1] = v.y, p[2] = v.z, p[3] = v.w;
  }
}
// The quad kernels' norm of one row held in registers (v: the thread's quads, zeros past the row): the sum of
// squares in the thread's quad order then block_sum, the scale, y = v * scale (* w).  The order follows from
// dim and the CTA width alone, so rmsnorm and add_rmsnorm give the same bits.
template <int PV>
__device__ __forceinline__ void rmsnorm_quads(const float4 (&v)[PV], const float* __restrict__ w, int dim, float eps,
                                              float* yr, bool vec, float* red) {
  const int nq = dim / 4;
  float ss = 0.f;
#pragma unroll
  for (int p = 0; p < PV; ++p) {
    ss += v[p].x * v[p].x;
    ss += v[p].y * v[p].y;
    ss += v[p].z * v[p].z;
    ss += v[p].w * v[p].w;
  }
  ss = block_sum(ss, red);
  const float scale = 1.f / sqrtf(ss / (float)dim + eps);
#pragma unroll
  for (int p = 0; p < PV; ++p) {
    const int i = threadIdx.x + p * blockDim.x;
    if (i >= nq) break;
    float4 o = make_float4(v[p].x * scale, v[p].y * scale, v[p].z * scale, v[p].w * scale);
    if (w) {
      const float4 wv = ld_quad(w + 4 * i, vec);
      o = make_float4(o.x * wv.x, o.y * wv.y, o.z * wv.z, o.w * wv.w);
    }
    st_quad(yr + 4 * i, o, vec);
  }
}

template <int PV>
__global__ void rmsnorm_quad_kernel(const float* x, const float* __restrict__ w, int dim, float eps, float* y) {
  DFL_STATIC_SMEM(float, red, [32]);
  const int nq = dim / 4;
  const float* xr = x + (int64_t)blockIdx.x * dim;
  float* yr = y + (int64_t)blockIdx.x * dim;
  const bool vec = ((reinterpret_cast<uintptr_t>(xr) | reinterpret_cast<uintptr_t>(yr) |
                     reinterpret_cast<uintptr_t>(w)) & 15) == 0;
  float4 v[PV];
#pragma unroll
  for (int p = 0; p < PV; ++p) {
    const int i = threadIdx.x + p * blockDim.x;
    v[p] = i < nq ? ld_quad(xr + 4 * i, vec) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  rmsnorm_quads<PV>(v, w, dim, eps, yr, vec, red);
}

// x += r, then rmsnorm_quad_kernel's steps on the sums: the bits of add_kernel then rmsnorm_quad_kernel, with
// one read of x (AR steps run this after every attention / delta-net sublayer).
template <int PV>
__global__ void add_rmsnorm_quad_kernel(float* x, const float* __restrict__ r, const float* __restrict__ w, int dim,
                                        float eps, float* y) {
  DFL_STATIC_SMEM(float, red, [32]);
  const int nq = dim / 4;
  float* xr = x + (int64_t)blockIdx.x * dim;
  const float* rr = r + (int64_t)blockIdx.x * dim;
  float* yr = y + (int64_t)blockIdx.x * dim;
  const bool vec = ((reinterpret_cast<uintptr_t>(xr) | reinterpret_cast<uintptr_t>(rr) |
                     reinterpret_cast<uintptr_t>(yr) | reinterpret_cast<uintptr_t>(w)) & 15) == 0;
  float4 v[PV];
#pragma unroll
  for (int p = 0; p < PV; ++p) {
    const int i = threadIdx.x + p * blockDim.x;
    v[p] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (i >= nq) continue;
    const float4 a = ld_quad(xr + 4 * i, vec), b = ld_quad(rr + 4 * i, vec);
    v[p] = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
    st_quad(xr + 4 * i, v[p], vec);
  }
  rmsnorm_quads<PV>(v, w, dim, eps, yr, vec, red);
}

// ---------------------------------------------------------------- elementwise
__global__ void add_kernel(float* x, const float* __restrict__ y, int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    x[i] += y[i];
}
__global__ void scale_kernel(float* x, float s, int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    x[i] *= s;
}
__global__ void swiglu_kernel(float* g, const float* __restrict__ u, int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    g[i] = silu_f(g[i]) * u[i];
}
// DFlash2's grouped dynamic causal convolution (Backend::grouped_conv): one thread per (row, channel), the
// CPU's operations in its order (coefficient summed first, taps t = 0.. added one by one).
__global__ void grouped_conv_kernel(const float* __restrict__ u, const float* __restrict__ base,
                                    const float* __restrict__ delta, int side, int n, int H, int T, int G,
                                    float* __restrict__ out) {
  const int gs = H / G;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < (int64_t)n * H;
       e += (int64_t)gridDim.x * blockDim.x) {
    const int i = (int)(e / H), c = (int)(e % H);
    const float* d = delta + ((int64_t)i * 2 + side) * T * G;
    float acc = 0.f;
    for (int t = 0; t < T && t <= i; ++t) {
      const float coef = __fadd_rn(base[((int64_t)side * T + t) * H + c], d[(int64_t)t * G + c / gs]);
      const float term = __fmul_rn(coef, u[(int64_t)(i - t) * H + c]);
      acc = t == 0 ? term : __fadd_rn(acc, term);
    }
    out[e] = acc;
  }
}

// ---------------------------------------------------------------- KV rows
// Conversions as csrc/quant/quant.cpp::quantize_row (round to nearest even
// for f16/bf16, ggml's reference rounding for Q8_0/Q4_0).
__device__ __forceinline__ uint32_t f32_to_bf16_bits(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
// One 16-bit store (every caller's address is even: f16 rows, and the 18 / 34-byte Q4_0 / Q8_0 blocks
// start at even offsets of 2-byte aligned rows).
__device__ __forceinline__ void store_u16(uint8_t* p, uint32_t h) { *reinterpret_cast<uint16_t*>(p) = (uint16_t)h; }

// Writes values v[0..len) (len a multiple of 32 for the block formats) as a
// row of `kvt` at dst; the CTA's threads split the work, reading v from shared memory.
__device__ void store_kv(DType kvt, const float* v, int len, uint8_t* dst) {
  switch (kvt) {
    case DType::F32:
      for (int i = threadIdx.x; i < len; i += blockDim.x) reinterpret_cast<float*>(dst)[i] = v[i];
      return;
    case DType::F16:
      for (int i = threadIdx.x; i < len; i += blockDim.x) store_u16(dst + 2 * i, f32_to_f16_bits(v[i]));
      return;
    case DType::BF16:
      for (int i = threadIdx.x; i < len; i += blockDim.x) store_u16(dst + 2 * i, f32_to_bf16_bits(v[i]));
      return;
    case DType::Q8_0:
      for (int b = threadIdx.x; b < len / 32; b += blockDim.x) {
        const float* x = v + 32 * b;
        uint8_t* o = dst + (int64_t)b * sizeof(block_q8_0);
        float amax = 0.f;
        for (int j = 0; j < 32; ++j) amax = fmaxf(amax, fabsf(x[j]));
        const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        store_u16(o + kQ8_0_d, f32_to_f16_bits(d));
        for (int j = 0; j < 32; ++j) o[kQ8_0_qs + j] = (uint8_t)(int8_t)rintf(x[j] * id);
      }
      return;
    case DType::Q4_0:
      for (int b = threadIdx.x; b < len / 32; b += blockDim.x) {
        const float* x = v + 32 * b;
        uint8_t* o = dst + (int64_t)b * sizeof(block_q4_0);
        float amax = 0.f, vmax = 0.f;
        for (int j = 0; j < 32; ++j)
          if (fabsf(x[j]) > amax) { amax = fabsf(x[j]); vmax = x[j]; }
        const float d = vmax / -8.f, id = d != 0.f ? 1.f / d : 0.f;
        store_u16(o + kQ4_0_d, f32_to_f16_bits(d));
        for (int j = 0; j < 16; ++j) {
          // rounded twice, as the CPU's quantiser: a fused x*id+8.5 truncates differently at .5 edges
          int q0 = (int)__fadd_rn(__fmul_rn(x[j], id), 8.5f), q1 = (int)__fadd_rn(__fmul_rn(x[j + 16], id), 8.5f);
          q0 = q0 < 0 ? 0 : (q0 > 15 ? 15 : q0);
          q1 = q1 < 0 ? 0 : (q1 > 15 ? 15 : q1);
          o[kQ4_0_qs + j] = (uint8_t)(q0 | (q1 << 4));
        }
      }
      return;
    default: return;  // rejected on the host
  }
}

// Element i of a KV head row of type kvt (i < head_dim).
__device__ __forceinline__ float kv_elem(DType kvt, const uint8_t* row, int i) {
  switch (kvt) {
    case DType::F32: return reinterpret_cast<const float*>(row)[i];
    // K / V rows and their blocks (34 and 18 bytes) start at even offsets: one 16-bit load a value or scale
    case DType::F16: return f16_bits_to_f32(*reinterpret_cast<const uint16_t*>(row + 2 * i));
    case DType::BF16: return bf16_bits_to_f32(*reinterpret_cast<const uint16_t*>(row + 2 * i));
    case DType::Q8_0: {
      const uint8_t* b = row + (i / 32) * sizeof(block_q8_0);
      return f16_bits_to_f32(*reinterpret_cast<const uint16_t*>(b)) * (float)(int8_t)b[kQ8_0_qs + (i & 31)];
    }
    case DType::Q4_0: {
      const uint8_t* b = row + (i / 32) * sizeof(block_q4_0);
      const int j = i & 31;
      const uint32_t q = b[kQ4_0_qs + (j & 15)];
      return f16_bits_to_f32(*reinterpret_cast<const uint16_t*>(b)) * (float)((int)(j < 16 ? (q & 15u) : (q >> 4)) - 8);
    }
    default: return 0.f;
  }
}

// ---------------------------------------------------------------- attention: store
// grid (n, n_head + 2 * n_head_kv), blockDim = head_dim rounded up to 32.
// y = 0..n_head-1: q heads (RMSNorm, RoPE, in place in qg, q_stride floats
// apart); then k heads (RMSNorm, RoPE, in place, and written to the cache);
// then v heads (cache).
struct StoreArgs {
  float* qg;
  float* kk;
  const float* vv;
  uint8_t* k_cache;
  uint8_t* v_cache;
  const float* q_norm;
  const float* k_norm;
  const int32_t* pos;
  const int32_t* slot0;  // the plan's kv_slot0 (on the device: the same launch bytes every AR step)
  int n_head, n_head_kv, head_dim, q_stride;
  int64_t kv_row, head_bytes;
  float eps;
  RopeSpec rope;
  DType kvt;
};

__global__ void attn_store_kernel(StoreArgs a) {
  DFL_STATIC_SMEM(float, red, [32]);
  DFL_STATIC_SMEM(float, h, [1024]);
  const int t = blockIdx.x, y = blockIdx.y, hd = a.head_dim;
  const int kind = y < a.n_head ? 0 : (y < a.n_head + a.n_head_kv ? 1 : 2);
  float* src;
  const float* norm;
  int kvh = 0;
  if (kind == 0) {
    src = a.qg + ((int64_t)t * a.n_head + y) * a.q_stride;
    norm = a.q_norm;
  } else if (kind == 1) {
    kvh = y - a.n_head;
    src = a.kk + ((int64_t)t * a.n_head_kv + kvh) * hd;
    norm = a.k_norm;
  } else {
    kvh = y - a.n_head - a.n_head_kv;
    src = const_cast<float*>(a.vv) + ((int64_t)t * a.n_head_kv + kvh) * hd;
    norm = nullptr;
  }
  const int i = threadIdx.x;
  if (i < hd) h[i] = src[i];
  __syncthreads();
  if (kind < 2) {
    float ss = block_sum(i < hd ? h[i] * h[i] : 0.f, red);
    const float scale = 1.f / sqrtf(ss / (float)hd + a.eps);
    float v = i < hd ? h[i] * scale * norm[i] : 0.f;
    __syncthreads();
    if (i < hd) h[i] = v;
    __syncthreads();
    // NeoX RoPE on the first n_rot dims: pairs (p, p + n_rot/2); angles in double as the CPU does.
    const int half = a.rope.n_rot / 2;
    float r = i < hd ? h[i] : 0.f;
    if (i < a.rope.n_rot) {
      const int p = i < half ? i : i - half;
      float c, s;
      rope_cos_sin(a.rope, p, a.pos[t], &c, &s);
      const float x0 = h[p], x1 = h[p + half];
      r = i < half ? x0 * c - x1 * s : x0 * s + x1 * c;
    }
    __syncthreads();
    if (i < hd) {
      h[i] = r;
      src[i] = r;
    }
    __syncthreads();
  }
  if (kind == 0) return;
  uint8_t* cache = kind == 1 ? a.k_cache : a.v_cache;
  store_kv(a.kvt, h, hd, cache + (int64_t)(*a.slot0 + t) * a.kv_row + (int64_t)kvh * a.head_bytes);
}

// ---------------------------------------------------------------- attention
// Split-K flash attention in two kernels.  A token's visible slots (a prefix,
// then listed extra slots) are cut into splits of kSplit consecutive visible
// indices — fixed boundaries, so a token's arithmetic depends only on its own
// visible set, never on the batch.
//
// attention_split_kernel: grid (token groups, KV heads x head groups, splits),
// 128 threads.  A CTA takes `rows` = tokens x query heads of one KV head
// (AttnArgs::tok_per_cta x heads_per_cta): the tokens of a verify or prefill
// share most of their slots and the heads of a KV group all of them, so each
// K / V row comes from L2 once per CTA instead of once per (token, head).  A
// split is walked in tiles of kTile visible indices; for each row:
//   scores   a warp per (token, slot) — per slot when every token's slots of the
//            tile are the same prefix slots (prefill, a chain's prefix): the K
//            row is read once for all the rows that see it — lane l sums
//            k[i] q[i] for i = l, l+32, ... in order (fma), then an xor
//            butterfly (16 .. 1); times the scale;
//   softmax  a warp per row: the tile max (exact), p = exp(score - new max),
//            the tile's p summed lane-wise (p[l] + p[l+32]) then by butterfly;
//            sum = sum * corr + tile sum, corr = exp(old max - new max);
//   output   each thread owns dims d = tid, tid + 128, ...: out = out * corr,
//            then out = fma(p_s, v_s[d], out) over the tile's slots in order;
//            the slots' V values are loaded 16 at a time, once for a token's G
//            rows (once for every row when the tile's slots are shared).
// The partial (max, sum, unnormalised output) goes to scratch;
// attention_combine_kernel merges a token's partials and applies the gate.
// Every row takes exactly these steps whatever else shares its CTA, so how
// rows are grouped (by batch shape and device size, backend.cu) never changes
// a bit.  One code path for every context length: short ones have one split.
struct AttnArgs {
  const float* qg;
  const uint8_t* k_cache;
  const uint8_t* v_cache;
  float* o;
  const int32_t* n_prefix;
  const int32_t* extra_begin;
  const int32_t* extra_count;
  const int32_t* extra_slots;
  float* part;  // [tokens][n_head][n_split][head_dim + 2]: out, max, sum
  int t0;       // first token of this launch
  int n_tok;    // tokens of this launch
  int n_split;
  int n_head, n_head_kv, head_dim, q_stride;
  int tok_per_cta, heads_per_cta;  // a CTA's rows: rows = tok_per_cta x heads_per_cta <= attn_max_rows(dims)
  int64_t kv_row, head_bytes;
  float scale;
  DType kvt;
  bool gated;  // output times sigmoid(gate), the gate stored after q in each head's q_stride
};
constexpr int kAttnThreads = 128, kTile = 64, kMaxHeadDim = 512, kSplit = 512, kVGather = 16;

// Rows a CTA can hold for kD = ceil(head_dim / 128) dims a thread: its
// accumulators (rows x kD a thread) stay in registers.
__host__ __device__ constexpr int attn_max_rows(int kD) { return kD == 1 ? 32 : kD == 2 ? 24 : kD == 3 ? 16 : 12; }
// Dynamic shared memory of a CTA: q of every row, the tile's scores, slots and
// each row's running max / sum / correction.
inline size_t attn_smem_bytes(int rows, int toks, int head_dim) {
  return (size_t)rows * head_dim * 4 + (size_t)rows * kTile * 4 + (size_t)toks * kTile * 4 + (size_t)rows * 3 * 4 +
         (size_t)toks * 4 * 2;
}

// The warp's 32 per-row sums (v[r] in every lane) reduced so that lane r gets row r's total by the same
// additions as warp_sum's xor butterfly (16, 8, 4, 2, 1) gives each row: at each level a lane keeps half of
// its rows, adds the partner's values of them and sends the other half (31 shuffles for 32 rows instead of 160).
template <int O>  // one level: 2 O rows in, O out (in place, indices all constants)
__device__ __forceinline__ void sum_rows_level(float* w) {
  const bool up = (threadIdx.x & O) != 0;
#pragma unroll
  for (int i = 0; i < O; ++i) {
    const float send = up ? w[i] : w[i + O], keep = up ? w[i + O] : w[i];
    w[i] = __fadd_rn(keep, __shfl_xor_sync(0xffffffffu, send, O));
  }
}
__device__ __forceinline__ float warp_sum_rows(float (&v)[32]) {
  sum_rows_level<16>(v);
  sum_rows_level<8>(v);
  sum_rows_level<4>(v);
  sum_rows_level<2>(v);
  sum_rows_level<1>(v);
  return v[0];
}

// Shared by attention_split_kernel and attention_mma_kernel (attention_mma.cuh).
// The end (exclusive) of the visible indices any of the CTA's tokens has in the split starting at s_begin:
// the CTA walks tiles up to it.
__device__ __forceinline__ int attn_split_stop(const AttnArgs& a, int tl0, int TT, int s_begin) {
  int s_stop = s_begin;
  for (int tt = 0; tt < TT; ++tt) {
    if (tl0 + tt >= a.n_tok) break;
    const int t = a.t0 + tl0 + tt;
    s_stop = max(s_stop, min(a.n_prefix[t] + a.extra_count[t], s_begin + kSplit));
  }
  return s_stop;
}

// Tile s0 of each of the CTA's tokens: its slots (slot_of[tt][s]), how many (nt_of, 0 for a token past the
// launch) and whether any is not the prefix slot s0 + s (own_of: then the tokens' slots differ).  The whole CTA
// calls it; a barrier follows before they are read.
__device__ __forceinline__ void attn_tile_slots(const AttnArgs& a, int tl0, int TT, int s_begin, int s0,
                                                int32_t* slot_of, int32_t* nt_of, int32_t* own_of) {
  for (int tt = 0; tt < TT; ++tt) {
    const bool live = tl0 + tt < a.n_tok;
    const int t = a.t0 + min(tl0 + tt, a.n_tok - 1);
    const int n_prefix = a.n_prefix[t], n_vis = n_prefix + a.extra_count[t];
    const int nt = live ? max(0, min(kTile, min(n_vis, s_begin + kSplit) - s0)) : 0;
    const int32_t* extra = a.extra_slots + a.extra_begin[t];
    for (int s = threadIdx.x; s < nt; s += blockDim.x)
      slot_of[tt * kTile + s] = s0 + s < n_prefix ? s0 + s : extra[s0 + s - n_prefix];
    if (threadIdx.x == 0) nt_of[tt] = nt, own_of[tt] = nt > 0 && s0 + nt > n_prefix;
  }
}

// One row's softmax step over a tile's nt > 0 scores sr[0 .. nt) (a warp): the tile max (exact), the
// weights p = exp(score - new max) written back over sr[0 .. 64) (0 from nt on), summed lane-wise then by
// butterfly; lane 0 sets sum = sum * corr + tile sum, corr = exp(old max - new max) and the new max.
__device__ __forceinline__ void attn_softmax_row(float* sr, int nt, float& run_max, float& run_sum, float& corr) {
  const int lane = threadIdx.x & 31;
  const float x0 = lane < nt ? sr[lane] : -INFINITY, x1 = lane + 32 < nt ? sr[lane + 32] : -INFINITY;
  float tmax = fmaxf(x0, x1);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, o));
  const float old_max = run_max, new_max = fmaxf(old_max, tmax);
  const float c = expf(old_max - new_max);  // 0 on the row's first tile (old max -inf)
  const float p0 = lane < nt ? expf(x0 - new_max) : 0.f, p1 = lane + 32 < nt ? expf(x1 - new_max) : 0.f;
  sr[lane] = p0;
  sr[lane + 32] = p1;
  float psum = __fadd_rn(p0, p1);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) psum = __fadd_rn(psum, __shfl_xor_sync(0xffffffffu, psum, o));
  __syncwarp();  // every lane has read run_max before lane 0 rewrites it (racecheck's hazard)
  if (lane == 0) {
    run_sum = __fadd_rn(__fmul_rn(run_sum, c), psum);
    run_max = new_max;
    corr = c;
  }
}

template <int kD>
__global__ void __launch_bounds__(kAttnThreads, 1) attention_split_kernel(AttnArgs a) {
  DFL_LAUNCH_BOUND(kAttnThreads);
  constexpr int kRows = attn_max_rows(kD);
  const int TT = a.tok_per_cta, G = a.heads_per_cta, R = TT * G, hd = a.head_dim;
  const int gs = a.n_head / a.n_head_kv, hgroups = gs / G;
  const int m = blockIdx.y / hgroups, j0 = m * gs + (blockIdx.y % hgroups) * G;  // KV head, first query head
  const int tl0 = blockIdx.x * TT, z = blockIdx.z;                               // first local token, split
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  DFL_DYNAMIC_SMEM(float, smem);
  float* q = smem;                                              // [R][hd]
  float* sc = q + R * hd;                                       // [R][kTile]
  int32_t* slot_of = reinterpret_cast<int32_t*>(sc + R * kTile);  // [TT][kTile]
  float* run_max = reinterpret_cast<float*>(slot_of + TT * kTile);  // [R]
  float* run_sum = run_max + R;                                 // [R]
  float* corr = run_sum + R;                                    // [R]
  int32_t* nt_of = reinterpret_cast<int32_t*>(corr + R);        // [TT]: this tile's slots of each token
  int32_t* own_of = nt_of + TT;  // [TT]: 1 if a token's slots of this tile are not just prefix slots s0, s0 + 1, ...
  // a row r is token tl0 + r / G (local to the launch), head j0 + r % G
  auto tok_of = [&](int r) { return tl0 + r / G; };
  for (int r = 0; r < R; ++r) {
    const int tl = min(tok_of(r), a.n_tok - 1);  // rows past the launch's tokens read the last, write nothing
    const float* qh = a.qg + ((int64_t)(a.t0 + tl) * a.n_head + j0 + r % G) * a.q_stride;
    for (int d = tid; d < hd; d += kAttnThreads) q[r * hd + d] = qh[d];
  }
  for (int r = tid; r < R; r += kAttnThreads) run_max[r] = -INFINITY, run_sum[r] = 0.f;
  const int s_begin = z * kSplit, s_stop = attn_split_stop(a, tl0, TT, s_begin);
  float acc[kRows][kD];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int e = 0; e < kD; ++e) acc[r][e] = 0.f;
  __syncthreads();
  for (int s0 = s_begin; s0 < s_stop; s0 += kTile) {
    attn_tile_slots(a, tl0, TT, s_begin, s0, slot_of, nt_of, own_of);
    __syncthreads();
    // the tile's slots shared by every token (index s is slot s0 + s for all): K and V rows are then read once
    // for all the CTA's rows; nt_max is the longest token's count
    bool shared = true;
    int nt_max = 0;
    for (int tt = 0; tt < TT; ++tt) shared = shared && !own_of[tt], nt_max = max(nt_max, nt_of[tt]);
    // scores: a warp per (token, slot), the K row read once for the token's G heads (per slot when shared:
    // once for every row that sees it, the rows' butterflies done as one, warp_sum_rows); a warp takes two
    // items at a time, their K rows' loads in flight before any one's math (when shared, a row's q values
    // are read from shared memory once for both)
    constexpr int kWarps = kAttnThreads / 32, kPair = 2;
    const int n_items = shared ? kTile : TT * kTile;  // (token, slot) items, or slots when shared
    for (int it0 = warp; it0 < n_items; it0 += kWarps * kPair) {
      float kv[kPair][4 * kD];  // head_dim <= 128 kD: a lane's elements lane + 32 c, c < 4 kD
      bool live[kPair];
#pragma unroll
      for (int u = 0; u < kPair; ++u) {
        const int it = it0 + u * kWarps, tt = shared ? 0 : it / kTile, s = it % kTile;
        live[u] = it < n_items && s < (shared ? nt_max : nt_of[tt]);
        const int slot = !live[u] ? 0 : shared ? s0 + s : slot_of[tt * kTile + s];
        const uint8_t* kr = a.k_cache + (int64_t)slot * a.kv_row + (int64_t)m * a.head_bytes;
#pragma unroll
        for (int c = 0; c < 4 * kD; ++c)
          kv[u][c] = live[u] && lane + 32 * c < hd ? kv_elem(a.kvt, kr, lane + 32 * c) : 0.f;
      }
      if (shared) {  // every row's lane sums for both items (a row's q values read once for the pair), then
                     // one transposed butterfly an item: lane r gets row r's total
        float v[kPair][32];
#pragma unroll
        for (int r = 0; r < 32; ++r) {
#pragma unroll
          for (int u = 0; u < kPair; ++u) v[u][r] = 0.f;
          if (r >= kRows || r >= R) continue;
          const float* qr = q + r * hd;
          float qv[4 * kD];
#pragma unroll
          for (int c = 0; c < 4 * kD; ++c) qv[c] = lane + 32 * c < hd ? qr[lane + 32 * c] : 0.f;
#pragma unroll
          for (int u = 0; u < kPair; ++u) {
            if (!live[u] || (it0 + u * kWarps) % kTile >= nt_of[r / G]) continue;  // (a row whose token does not see s)
            float d = 0.f;
#pragma unroll
            for (int c = 0; c < 4 * kD; ++c)
              if (lane + 32 * c < hd) d = fmaf(kv[u][c], qv[c], d);
            v[u][r] = d;
          }
        }
#pragma unroll
        for (int u = 0; u < kPair; ++u) {
          if (!live[u]) continue;  // warp-uniform
          const int s = (it0 + u * kWarps) % kTile;
          const float tot = warp_sum_rows(v[u]);  // (v[u] is consumed)
          if (lane < R && s < nt_of[lane / G]) sc[lane * kTile + s] = __fmul_rn(tot, a.scale);
        }
        continue;
      }
#pragma unroll
      for (int u = 0; u < kPair; ++u) {
        if (!live[u]) continue;  // warp-uniform: the whole warp takes an item
        const int it = it0 + u * kWarps, tt = it / kTile, s = it % kTile;
        for (int r = tt * G; r < (tt + 1) * G; ++r) {
          const float* qr = q + r * hd;
          float d = 0.f;
#pragma unroll
          for (int c = 0; c < 4 * kD; ++c)
            if (lane + 32 * c < hd) d = fmaf(kv[u][c], qr[lane + 32 * c], d);
#pragma unroll
          for (int o = 16; o > 0; o >>= 1) d = __fadd_rn(d, __shfl_xor_sync(0xffffffffu, d, o));
          if (lane == 0) sc[r * kTile + s] = __fmul_rn(d, a.scale);
        }
      }
    }
    __syncthreads();
    // softmax statistics: a warp per row (one that sees nothing in this tile is left as it is)
    for (int r = warp; r < R; r += kAttnThreads / 32)
      if (const int nt = nt_of[r / G]; nt > 0) attn_softmax_row(sc + r * kTile, nt, run_max[r], run_sum[r], corr[r]);
    __syncthreads();
    // output: each thread its dims of every row, slots in order.  First each row's correction (a row that
    // sees nothing in this tile is left as it is), then the slots 16 at a time: their V values loaded once for
    // a token's G rows (once for all rows when shared), each row's fmas in slot order.  The loads sit outside
    // the unrolled row loop (one copy of kv_elem's format switch, not one a row: nvcc took minutes over those)
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r >= R) break;
      if (nt_of[r / G] == 0) continue;
      const float c = corr[r];
#pragma unroll
      for (int e = 0; e < kD; ++e)
        if (tid + e * kAttnThreads < hd) acc[r][e] = __fmul_rn(acc[r][e], c);
    }
    const uint8_t* vbase = a.v_cache + (int64_t)m * a.head_bytes;
    for (int s = 0; s < nt_max; s += kVGather) {
      for (int tv = 0; tv < (shared ? 1 : TT); ++tv) {  // the token whose V rows are loaded (all when shared)
        const int lim = shared ? nt_max : nt_of[tv];
        if (s >= lim) continue;
        const int32_t* so = slot_of + tv * kTile;
        float vv[kD][kVGather];
#pragma unroll
        for (int u = 0; u < kVGather; ++u) {
          const bool in = s + u < lim;
          const int slot = !in ? 0 : shared ? s0 + s + u : so[s + u];
#pragma unroll
          for (int e = 0; e < kD; ++e) {
            const int d = tid + e * kAttnThreads;
            vv[e][u] = in && d < hd ? kv_elem(a.kvt, vbase + (int64_t)slot * a.kv_row, d) : 0.f;
          }
        }
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (r >= R) break;
          const int tt = r / G, nt = nt_of[tt];
          if ((!shared && tt != tv) || s >= nt) continue;
          // the row's 16 weights as four 16-byte loads (head_dim % 32 == 0 and s % 16 == 0 keep them aligned;
          // those past nt are read, never used)
          float pw[kVGather];
#pragma unroll
          for (int k = 0; k < kVGather / 4; ++k) {
            const float4 p4 = *reinterpret_cast<const float4*>(sc + r * kTile + s + 4 * k);
            pw[4 * k] = p4.x, pw[4 * k + 1] = p4.y, pw[4 * k + 2] = p4.z, pw[4 * k + 3] = p4.w;
          }
          const int nu = min(kVGather, nt - s);
#pragma unroll
          for (int e = 0; e < kD; ++e) {
            if (tid + e * kAttnThreads >= hd) break;
#pragma unroll
            for (int u = 0; u < kVGather; ++u)
              if (u < nu) acc[r][e] = fmaf(pw[u], vv[e][u], acc[r][e]);
          }
        }
      }
    }
    __syncthreads();  // sc / slot_of / nt_of are rewritten by the next tile
  }
  // a row that saw no slot in this split leaves max -inf, sum 0, out 0
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (r >= R) break;
    const int tl = tok_of(r);
    if (tl >= a.n_tok) break;
    float* pt = a.part + (((int64_t)tl * a.n_head + j0 + r % G) * a.n_split + z) * (hd + 2);
#pragma unroll
    for (int e = 0; e < kD; ++e) {
      const int d = tid + e * kAttnThreads;
      if (d >= hd) break;
      pt[d] = acc[r][e];
    }
    if (tid == 0) {
      pt[hd] = run_max[r];
      pt[hd + 1] = run_sum[r];
    }
  }
}

// grid (tokens, n_head), 128 threads: o = sum_z out_z e^(max_z - M) / sum_z sum_z e^(max_z - M).
__global__ void __launch_bounds__(kAttnThreads) attention_combine_kernel(AttnArgs a) {
  DFL_LAUNCH_BOUND(kAttnThreads);
  const int tl = blockIdx.x, t = a.t0 + tl, j = blockIdx.y, hd = a.head_dim;
  const float* base = a.part + ((int64_t)tl * a.n_head + j) * a.n_split * (hd + 2);
  float M = -INFINITY;
  for (int z = 0; z < a.n_split; ++z) M = fmaxf(M, base[z * (hd + 2) + hd]);
  float L = 0.f;
  for (int z = 0; z < a.n_split; ++z) {
    const float mz = base[z * (hd + 2) + hd];
    if (mz != -INFINITY) L += base[z * (hd + 2) + hd + 1] * expf(mz - M);
  }
  const float inv = 1.f / L;
  const float* qh = a.qg + ((int64_t)t * a.n_head + j) * a.q_stride;
  float* ot = a.o + ((int64_t)t * a.n_head + j) * hd;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float v = 0.f;
    for (int z = 0; z < a.n_split; ++z) {
      const float mz = base[z * (hd + 2) + hd];
      if (mz != -INFINITY) v += base[z * (hd + 2) + d] * expf(mz - M);
    }
    ot[d] = a.gated ? v * inv * sigmoid_f(qh[hd + d]) : v * inv;
  }
}

// ---------------------------------------------------------------- top-k
// grid n_rows, kTopkThreads threads; the order is the CPU's topk_logprobs: value descending, ties to the
// lower id.  One read of the row fills each thread's buffer with the best kTopkBuf elements of its stripe
// (i = tid, tid + blockDim.x, ...), a second one sums the log-sum-exp, then k rounds each pick the best
// buffer head of the CTA; the thread whose head was picked pops it and, when its buffer runs empty,
// refills it from its stripe with the elements strictly after the last one it gave (rare: a stripe holding
// more than kTopkBuf of the row's top k).  The first record's kernel re-read the whole row (1 MB at the
// 27B's vocabulary) in each of the k rounds.
constexpr int kTopkThreads = 1024;
constexpr int kTopkBuf = 4;
constexpr int kTopkNone = 0x7fffffff;  // an empty slot: (-inf, kTopkNone) comes after every element

// (v, i) is picked before (w, j)
__device__ __forceinline__ bool topk_before(float v, int i, float w, int j) { return v > w || (v == w && i < j); }

// The best kTopkBuf elements of the thread's stripe strictly after (pv, pi), best first.
__device__ __forceinline__ void topk_fill(const float* __restrict__ row, int n_cols, float pv, int pi,
                                          float (&bv)[kTopkBuf], int (&bi)[kTopkBuf]) {
#pragma unroll
  for (int s = 0; s < kTopkBuf; ++s) bv[s] = -INFINITY, bi[s] = kTopkNone;
  for (int i = threadIdx.x; i < n_cols; i += blockDim.x) {
    float v = row[i];
    // NaN is never after anything, so never picked (as the CPU)
    if (!(v < pv || (v == pv && i > pi)) || !topk_before(v, i, bv[kTopkBuf - 1], bi[kTopkBuf - 1])) continue;
    int id = i;
#pragma unroll
    for (int s = 0; s < kTopkBuf; ++s)
      if (topk_before(v, id, bv[s], bi[s])) {
        const float tv = bv[s];
        const int ti = bi[s];
        bv[s] = v, bi[s] = id, v = tv, id = ti;
      }
  }
}

__global__ void __launch_bounds__(kTopkThreads)
    row_topk_kernel(const float* __restrict__ rows, int n_cols, int k, int32_t* ids, float* logp) {
  DFL_LAUNCH_BOUND(kTopkThreads);
  DFL_STATIC_SMEM(float, red, [32]);
  DFL_STATIC_SMEM(float, rv, [32]);
  DFL_STATIC_SMEM(int, ri, [32]);
  const float* row = rows + (int64_t)blockIdx.x * n_cols;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
  float bv[kTopkBuf];
  int bi[kTopkBuf];
  topk_fill(row, n_cols, INFINITY, -1, bv, bi);
  float lse = 0.f;
  if (logp) {  // null: the ids alone
    const float mx = block_max(bv[0], red);  // a stripe's best is its largest value: the row's max
    float sum = 0.f;
    for (int i = tid; i < n_cols; i += blockDim.x) sum += expf(row[i] - mx);
    sum = block_sum(sum, red);
    lse = mx + logf(sum);
  }
  int popped = 0;
  for (int r = 0; r < k; ++r) {
    float gv = bv[0];
    int gi = bi[0];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, gv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, gi, o);
      if (topk_before(ov, oi, gv, gi)) gv = ov, gi = oi;
    }
    __syncthreads();  // rv / ri of the previous round are read
    if (lane == 0) rv[warp] = gv, ri[warp] = gi;
    __syncthreads();
    gv = rv[0];
    gi = ri[0];
    for (int w = 1; w < nw; ++w)
      if (topk_before(rv[w], ri[w], gv, gi)) gv = rv[w], gi = ri[w];
    if (tid == 0) {
      ids[(int64_t)blockIdx.x * k + r] = gi;
      if (logp) logp[(int64_t)blockIdx.x * k + r] = gv - lse;
    }
    if (gi != kTopkNone && bi[0] == gi) {  // ids are unique: this thread's head was picked
#pragma unroll
      for (int s = 0; s + 1 < kTopkBuf; ++s) bv[s] = bv[s + 1], bi[s] = bi[s + 1];
      bv[kTopkBuf - 1] = -INFINITY, bi[kTopkBuf - 1] = kTopkNone;
      if (++popped == kTopkBuf) {
        topk_fill(row, n_cols, gv, gi, bv, bi);
        popped = 0;
      }
    }
  }
}

// ---------------------------------------------------------------- delta-net: conv
// One thread per channel walks the chunk's tokens in order.  Token t starts
// from its parent's window: the running one when the parent is t-1, the
// committed window for -1, else node_conv[parent] (written earlier by this
// same thread).  Verify keeps every token's window in node_conv (scratch for
// its children) and its input row in node_upd (GdnNodeLayout::xin, kept for
// commit); a committing chunk writes the last window back to conv.
struct ConvArgs {
  float* mm;             // [n][C]: inputs, overwritten with silu(conv)
  const float* w;        // [C][K]
  float* conv;           // [(K-1)][C] committed
  float* node_conv;      // [n][(K-1)][C] or null (commit)
  float* node_upd;       // [n][upd_stride] or null (commit)
  const int32_t* parent;
  int n, C, K;
  int64_t upd_stride;
};
constexpr int kMaxConvK = 8;

// One token of a channel: its output silu(w . [window, xin]) and the window moved on by xin.  Both conv
// kernels take it, so a token gets the same bits from either.
__device__ __forceinline__ float conv_step(const float (&wc)[kMaxConvK], float (&win)[kMaxConvK], int K, float xin) {
  float acc = 0.f;
  for (int k = 0; k < K - 1; ++k) acc += wc[k] * win[k];
  acc += wc[K - 1] * xin;
  for (int k = 0; k < K - 2; ++k) win[k] = win[k + 1];
  win[K - 2] = xin;
  return silu_f(acc);
}

__global__ void conv_kernel(ConvArgs a) {
  const int ch = blockIdx.x * blockDim.x + threadIdx.x;
  if (ch >= a.C) return;
  const int K = a.K;
  const int64_t cs = (int64_t)(K - 1) * a.C;
  float win[kMaxConvK], wc[kMaxConvK];
  for (int k = 0; k < K; ++k) wc[k] = a.w[(int64_t)ch * K + k];
  for (int k = 0; k < K - 1; ++k) win[k] = a.conv[(int64_t)k * a.C + ch];
  for (int t = 0; t < a.n; ++t) {
    const int par = a.parent[t];
    if (par != t - 1) {  // (commit chunks are chains: never taken)
      const float* src = par < 0 ? a.conv : a.node_conv + par * cs;
      for (int k = 0; k < K - 1; ++k) win[k] = src[(int64_t)k * a.C + ch];
    }
    float* mt = a.mm + (int64_t)t * a.C;
    const float xin = mt[ch];
    if (a.node_upd) a.node_upd[t * a.upd_stride + ch] = xin;
    mt[ch] = conv_step(wc, win, K, xin);
    if (a.node_conv)
      for (int k = 0; k < K - 1; ++k) a.node_conv[t * cs + (int64_t)k * a.C + ch] = win[k];
  }
  if (!a.node_conv)
    for (int k = 0; k < K - 1; ++k) a.conv[(int64_t)k * a.C + ch] = win[k];
}

// A committing chain (every token's parent the one before; no node windows): conv_kernel's steps with the
// chunk's tokens split among the CTA's warps, so a 512-token prefill chunk is not 512 dependent steps a
// thread.  Lane = channel (32 a CTA); warp w takes tokens [w T, (w + 1) T) and starts from the K - 1
// inputs before its first token (the committed window where they precede the chunk), read before the
// barrier because the warps overwrite their inputs with outputs; the chunk's last warp writes the
// committed window back.
constexpr int kConvChainWarps = 4;
__global__ void __launch_bounds__(32 * kConvChainWarps) conv_chain_kernel(ConvArgs a) {
  DFL_LAUNCH_BOUND(32 * kConvChainWarps);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, ch = blockIdx.x * 32 + lane, K = a.K;
  const int T = (a.n + kConvChainWarps - 1) / kConvChainWarps, t0 = warp * T, t1 = min(a.n, t0 + T);
  const bool live = ch < a.C && t0 < t1;  // (a thread with no work still meets the barrier)
  float win[kMaxConvK], wc[kMaxConvK];
  if (live) {
    for (int k = 0; k < K; ++k) wc[k] = a.w[(int64_t)ch * K + k];
    for (int k = 0; k < K - 1; ++k) {  // win[k]: the input of token t0 - (K - 1) + k
      const int t = t0 - (K - 1) + k;
      win[k] = t < 0 ? a.conv[(int64_t)(t + K - 1) * a.C + ch] : a.mm[(int64_t)t * a.C + ch];
    }
  }
  __syncthreads();
  if (!live) return;
  for (int t = t0; t < t1; ++t) {
    float* mt = a.mm + (int64_t)t * a.C;
    const float xin = mt[ch];
    if (a.node_upd) a.node_upd[t * a.upd_stride + ch] = xin;
    mt[ch] = conv_step(wc, win, K, xin);
  }
  if (t1 == a.n)
    for (int k = 0; k < K - 1; ++k) a.conv[(int64_t)k * a.C + ch] = win[k];
}

// ---------------------------------------------------------------- delta-net: rule
// Per token, for each value head (its key head's q and k L2-normalised, q also
// scaled by 1/sqrt(dk)):
//   S *= exp(g);  u = S^T k;  S += k (beta (v - u))^T;  out = S^T q
// then out gets the gated RMSNorm (ssm_norm, silu(z)).
//
// delta_kernel: grid (nv value heads, dv / 32 column blocks), 128 threads.  A
// CTA owns 32 columns of one head's state S (dk x dv), 4 threads a column:
// thread r holds rows r dk/4 .. (r + 1) dk/4 - 1 in registers for the whole
// chunk and walks its tokens in the plan's order (gdn_walk_order: a tree's
// preorder), each from its parent's state (the committed state for -1; a
// shared-memory stash slot or node_rec of the parent when that is not the
// token before it in the walk).  Only the state update is serial.  What a
// token needs that does not depend on the state -- normalised q and k, beta,
// the decay, its v, where its state comes from and goes -- is computed ahead,
// a window of 16 tokens at a time, by the CTA's warps into shared memory, and
// the gated RMSNorm runs after the chunk (gated_norm_kernel, one warp per
// token and head).  So a token's step is its FMAs, float4 reads of q and k
// (swizzled: one wavefront a warp) and two 4-lane butterflies, with no barrier
// and no global load but its state's.  Every sum has one order, fixed by the
// shapes alone (a thread's rows into four partial sums, row m into sum m mod 4,
// each in row order; the four pairwise; the butterfly), so a token's result
// does not depend on n.  The emulator's memory trace had the old step (rows
// r, r + 4, ..., read one float at a time, one 32-fma chain per sum) at 96
// wavefronts a token a warp: a 23-node verify's delta-net shared-memory bound
// at 3.2x its DRAM time (bench/results/emu-memtrace-forward-stash.json).
//
// The state update is written with explicit roundings (S = S * decay, then
// S = fma(k, delta, S)) so that delta_commit_kernel, replaying a node's stored
// (k, delta, decay), reproduces it bit for bit whatever the compiler would
// contract.  In verify mode a node's state goes to node_rec only when `keep`
// says a later node or the commit needs it (node_rec_kept): a chain writes one
// state per layer, not one per node.
// The recurrent state's storage: f32, or bf16 / f16 rounded to nearest even
// (DType ids; the state is computed in f32 and rounded after every token).
__device__ __forceinline__ uint32_t f32_to_bf16_bits_rn(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}
__device__ __forceinline__ float ld_state(const void* p, int64_t i, int type) {
  if (type == (int)DType::BF16) return bf16_bits_to_f32(static_cast<const uint16_t*>(p)[i]);
  if (type == (int)DType::F16) return f16_bits_to_f32(static_cast<const uint16_t*>(p)[i]);
  return static_cast<const float*>(p)[i];
}
__device__ __forceinline__ void st_state(void* p, int64_t i, float v, int type) {
  if (type == (int)DType::BF16) static_cast<uint16_t*>(p)[i] = (uint16_t)f32_to_bf16_bits_rn(v);
  else if (type == (int)DType::F16) static_cast<uint16_t*>(p)[i] = (uint16_t)f32_to_f16_bits(v);
  else static_cast<float*>(p)[i] = v;
}
__device__ __forceinline__ float round_state(float v, int type) {
  if (type == (int)DType::BF16) return bf16_bits_to_f32(f32_to_bf16_bits_rn(v));
  if (type == (int)DType::F16) return f16_bits_to_f32(f32_to_f16_bits(v));
  return v;
}

constexpr int kDeltaCols = 32, kDeltaSplit = 4, kDeltaWindow = 16;
constexpr int kDeltaThreads = kDeltaCols * kDeltaSplit;
// A tree verify's kept states (the parents a later node in the walk starts from) stay in the CTA's shared
// memory, up to kDeltaStashMax at once, instead of a round trip through node_rec in device memory: a slot is
// one CTA's columns of one state, each thread's own values (no barrier).  The 27B's states are 144 MiB a
// node over its 48 delta-net layers.
constexpr int kDeltaStashMax = 4;
// A window token's step, worked out by the window's preparation so that the serial walk reads no global memory
// but its state: the token, where its starting state is (kDeltaInHand: the state the walk holds, i.e. its
// parent was the token before it; kDeltaCommitted: the committed state; a stash slot >= 0; kDeltaNodeRec: its
// parent's node_rec), the parent, and where its own state goes (kDeltaNotKept, a stash slot, or kDeltaNodeRec).
constexpr int kDeltaInHand = -3, kDeltaNodeRec = -2, kDeltaCommitted = -1, kDeltaNotKept = -4;
struct alignas(16) DeltaStep {  // (one 16-byte shared load a step)
  int t, from, par, to;
};

constexpr size_t delta_static_smem_bytes(int dk) {  // delta_kernel's static arrays
  return (2 * (size_t)kDeltaWindow * dk + (size_t)kDeltaWindow * kDeltaCols + 2 * kDeltaWindow) * sizeof(float) +
         (size_t)kDeltaWindow * sizeof(DeltaStep);
}
constexpr size_t delta_stash_slot_bytes(int dk) { return (size_t)dk * kDeltaCols * sizeof(float); }

struct DeltaArgs {
  const float* mm;       // [n][Cconv] conv outputs: q (nk*dk) | k (nk*dk) | v (nv*dv)
  const float* beta;     // [n][nv]
  const float* alpha;    // [n][nv]
  const float* dt_bias, *ssm_a;
  void* rec;             // [nv][dk][dv] committed, of state_type
  void* node_rec;        // [n][nv][dk][dv] of state_type, or null (commit)
  const int32_t* keep;   // [n]: nonzero when node_rec must hold the node's state (verify)
  float* node_upd;       // [n][upd_stride]: k at k_off, delta at delta_off, decay at decay_off; null (commit)
  const int32_t* parent;
  const int32_t* walk;   // [n]: the order the tokens are stepped in (gdn_walk_order: a tree's preorder)
  const int32_t* stash;  // [n]: the shared-memory slot a kept node's state goes to, -1: node_rec (delta_stash)
  float* y;              // [n][nv*dv]: out, before gated_norm_kernel
  int n, nk, nv, dv, Cconv;
  float eps;
  int64_t upd_stride, k_off, delta_off, decay_off;
  int state_type;        // DType id: F32, BF16 or F16
};

// Where row i of a window token's normalised q / k sits in shared memory (in floats).  Thread r of a column
// owns rows r RPT .. r RPT + RPT - 1 and reads them as float4 chunks q = 0 .. RPT / 4 - 1; chunk q of block r
// is stored at chunk (q + r) mod (RPT / 4) of the block, so the four threads' float4 loads of one step fall in
// four different bank quads (one wavefront for the warp; unswizzled, all four would sit in banks 0..3).
template <int DK>
__device__ __forceinline__ int delta_chunk(int r, int q) {  // thread r's chunk q, in float4s
  constexpr int NQ = DK / kDeltaSplit / 4;
  return r * NQ + (q + r) % NQ;
}
template <int DK>
__device__ __forceinline__ int delta_row_slot(int i) {
  constexpr int RPT = DK / kDeltaSplit;
  return 4 * delta_chunk<DK>(i / RPT, (i % RPT) / 4) + (i & 3);
}

template <int DK>
__global__ void __launch_bounds__(kDeltaThreads) delta_kernel(DeltaArgs a) {
  DFL_LAUNCH_BOUND(kDeltaThreads);
  constexpr int R = kDeltaSplit, RPT = DK / R, NQ = RPT / 4, W = kDeltaWindow, kWarps = kDeltaThreads / 32;
  constexpr int LV = DK / 32;  // a lane's values of q and of k in the window's preparation
  static_assert(RPT % 4 == 0, "a thread's rows come in float4 chunks");
  DFL_STATIC_SMEM(float4, qn, [W][DK / 4]);  // rows at delta_row_slot
  DFL_STATIC_SMEM(float4, kn, [W][DK / 4]);
  DFL_STATIC_SMEM(float, vw, [W][kDeltaCols]);
  DFL_STATIC_SMEM(float, beta_w, [W]);
  DFL_STATIC_SMEM(float, decay_w, [W]);
  DFL_STATIC_SMEM(DeltaStep, step_w, [W]);
  DFL_DYNAMIC_SMEM(float, stash);  // [slot][RPT][kDeltaThreads]: kept states (a tree verify's launch only)
  auto stashed = [&](int slot, int m) -> float& {
    return stash[((int64_t)slot * RPT + m) * kDeltaThreads + threadIdx.x];
  };
  const int h = blockIdx.x, kh = h % a.nk, dv = a.dv, col0 = blockIdx.y * kDeltaCols;
  const int r = threadIdx.x % R, jl = threadIdx.x / R, j = col0 + jl;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t rs = (int64_t)a.nv * DK * dv, hoff = (int64_t)h * DK * dv;
  const int64_t mine = hoff + (int64_t)r * RPT * dv + j;  // this thread's first state element; row m at + m dv
  const float qscale = 1.f / sqrtf((float)DK);
  float s[RPT];
#pragma unroll
  for (int m = 0; m < RPT; ++m) s[m] = ld_state(a.rec, mine + (int64_t)m * dv, a.state_type);
  for (int t0 = 0; t0 < a.n; t0 += W) {
    const int nw = a.n - t0 < W ? a.n - t0 : W;
    __syncthreads();  // the previous window's values are read no more
    for (int tl = warp; tl < nw; tl += kWarps) {
      const int w = t0 + tl, t = a.walk[w];  // the window holds the walk's next tokens
      const float* mt = a.mm + (int64_t)t * a.Cconv;
      float qv[LV], kv[LV], sq = 0.f, sk = 0.f;
#pragma unroll
      for (int x = 0; x < LV; ++x) {
        qv[x] = mt[kh * DK + lane + 32 * x];
        kv[x] = mt[a.nk * DK + kh * DK + lane + 32 * x];
        sq = fmaf(qv[x], qv[x], sq);
        sk = fmaf(kv[x], kv[x], sk);
      }
      sq = warp_sum(sq);
      sk = warp_sum(sk);
      const float iq = 1.f / fmaxf(sqrtf(sq), a.eps), ik = 1.f / fmaxf(sqrtf(sk), a.eps);
      float* upd = a.node_upd ? a.node_upd + t * a.upd_stride : nullptr;
#pragma unroll
      for (int x = 0; x < LV; ++x) {
        const int i = lane + 32 * x;
        const float kx = kv[x] * ik;
        reinterpret_cast<float*>(qn[tl])[delta_row_slot<DK>(i)] = qv[x] * iq * qscale;
        reinterpret_cast<float*>(kn[tl])[delta_row_slot<DK>(i)] = kx;
        if (upd && h < a.nk && blockIdx.y == 0) upd[a.k_off + kh * DK + i] = kx;
      }
      vw[tl][lane] = mt[2 * a.nk * DK + h * dv + col0 + lane];
      if (lane == 0) {
        beta_w[tl] = sigmoid_f(a.beta[(int64_t)t * a.nv + h]);
        decay_w[tl] = expf(a.ssm_a[h] * softplus_f(a.alpha[(int64_t)t * a.nv + h] + a.dt_bias[h]));
        if (upd && blockIdx.y == 0) upd[a.decay_off + h] = decay_w[tl];
        const int par = a.parent[t];
        const int from = par == (w > 0 ? a.walk[w - 1] : -1) ? kDeltaInHand
                         : par < 0                           ? kDeltaCommitted
                         : a.stash[par] >= 0                 ? a.stash[par]
                                                             : kDeltaNodeRec;
        const int to = !a.node_rec || !a.keep[t] ? kDeltaNotKept : a.stash[t] >= 0 ? a.stash[t] : kDeltaNodeRec;
        step_w[tl] = DeltaStep{t, from, par, to};
      }
    }
    __syncthreads();
    for (int tl = 0; tl < nw; ++tl) {
      const DeltaStep st = step_w[tl];
      const int t = st.t;
      if (st.from >= 0) {
#pragma unroll
        for (int m = 0; m < RPT; ++m) s[m] = stashed(st.from, m);
      } else if (st.from != kDeltaInHand) {
        const void* src = st.from == kDeltaCommitted ? a.rec : a.node_rec;
        const int64_t base = (st.from == kDeltaCommitted ? 0 : st.par * rs) + mine;
#pragma unroll
        for (int m = 0; m < RPT; ++m) s[m] = ld_state(src, base + (int64_t)m * dv, a.state_type);
      }
      // u = S^T k and out = S^T q over the thread's rows: four partial sums (row m into sum m mod 4), each in
      // row order, added pairwise, then the 4-lane butterfly; four chains of RPT / 4 fmas instead of one of RPT
      const float decay = decay_w[tl];
      float4 kc[NQ];
      float u4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int q = 0; q < NQ; ++q) {
        kc[q] = kn[tl][delta_chunk<DK>(r, q)];
        const float ke[4] = {kc[q].x, kc[q].y, kc[q].z, kc[q].w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[4 * q + e] = __fmul_rn(s[4 * q + e], decay);
          u4[e] = fmaf(s[4 * q + e], ke[e], u4[e]);
        }
      }
      float u = __fadd_rn(__fadd_rn(u4[0], u4[1]), __fadd_rn(u4[2], u4[3]));
      u = __fadd_rn(u, __shfl_xor_sync(0xffffffffu, u, 1));
      u = __fadd_rn(u, __shfl_xor_sync(0xffffffffu, u, 2));
      const float delta = __fmul_rn(beta_w[tl], __fsub_rn(vw[tl][jl], u));
      float o4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int q = 0; q < NQ; ++q) {
        const float4 qc = qn[tl][delta_chunk<DK>(r, q)];
        const float ke[4] = {kc[q].x, kc[q].y, kc[q].z, kc[q].w}, qe[4] = {qc.x, qc.y, qc.z, qc.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[4 * q + e] = fmaf(ke[e], delta, s[4 * q + e]);
          o4[e] = fmaf(s[4 * q + e], qe[e], o4[e]);
        }
      }
      float out = __fadd_rn(__fadd_rn(o4[0], o4[1]), __fadd_rn(o4[2], o4[3]));
      out = __fadd_rn(out, __shfl_xor_sync(0xffffffffu, out, 1));
      out = __fadd_rn(out, __shfl_xor_sync(0xffffffffu, out, 2));
      if (r == 0) {
        a.y[(int64_t)t * a.nv * dv + h * dv + j] = out;
        if (a.node_upd) a.node_upd[t * a.upd_stride + a.delta_off + h * dv + j] = delta;
      }
      if (a.state_type != (int)DType::F32) {
#pragma unroll
        for (int m = 0; m < RPT; ++m) s[m] = round_state(s[m], a.state_type);
      }
      if (st.to >= 0) {  // (already rounded to the state type: read back, the same values node_rec would give)
#pragma unroll
        for (int m = 0; m < RPT; ++m) stashed(st.to, m) = s[m];
      } else if (st.to == kDeltaNodeRec) {
#pragma unroll
        for (int m = 0; m < RPT; ++m) st_state(a.node_rec, t * rs + mine + (int64_t)m * dv, s[m], a.state_type);
      }
    }
  }
  if (!a.node_rec) {
#pragma unroll
    for (int m = 0; m < RPT; ++m) st_state(a.rec, mine + (int64_t)m * dv, s[m], a.state_type);
  }
}

// y[t][h] <- RMSNorm(y[t][h]) * ssm_norm * silu(z[t][h]); grid (n, nv), one warp each.
__global__ void gated_norm_kernel(float* y, const float* __restrict__ z, const float* __restrict__ w, int nv, int dv,
                                  float eps) {
  const int64_t base = ((int64_t)blockIdx.x * nv + blockIdx.y) * dv;
  float ss = 0.f;
  for (int i = threadIdx.x; i < dv; i += 32) ss += y[base + i] * y[base + i];
  ss = warp_sum(ss);
  const float scale = 1.f / sqrtf(ss / (float)dv + eps);
  for (int i = threadIdx.x; i < dv; i += 32) y[base + i] = y[base + i] * scale * w[i] * silu_f(z[base + i]);
}

// ---------------------------------------------------------------- commit
// The commit plan (begin_commit) is on the device, [base | m | path[m]], so a
// commit's launches do not depend on the path.

// K/V rows: slot base + k <- slot base + path[k], k ascending.  A thread moves
// one 2-byte unit of every row in that order, so a row is read before any
// later move overwrites it (path[k] >= k).  grid (units / 256, 2: K then V).
struct KvCommitArgs {
  uint8_t* k_cache;
  uint8_t* v_cache;
  int64_t kv_row;
  const int32_t* commit;
};

__global__ void kv_commit_kernel(KvCommitArgs a) {
  const int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (2 * u >= a.kv_row) return;
  uint8_t* cache = blockIdx.y ? a.v_cache : a.k_cache;
  const int base = a.commit[0], m = a.commit[1];
  for (int k = 0; k < m; ++k) {
    const int from = a.commit[2 + k];
    if (from == k) continue;
    const uint16_t v = *reinterpret_cast<const uint16_t*>(cache + (int64_t)(base + from) * a.kv_row + 2 * u);
    *reinterpret_cast<uint16_t*>(cache + (int64_t)(base + k) * a.kv_row + 2 * u) = v;
  }
}

// rec <- the path's updates applied in order, each exactly as delta_kernel
// applied it: S = S * decay; S = fma(k, delta, S).  One thread per state
// element (grid: value heads x element blocks).
struct DeltaCommitArgs {
  void* rec;               // [nv][dk][dv] of state_type
  const float* node_upd;   // [nodes][upd_stride]
  int64_t upd_stride, k_off, delta_off, decay_off;
  const int32_t* commit;
  int nk, dk, dv, state_type;
};

// conv <- the last K-1 inputs of (committed window, the path's conv inputs):
// one thread per channel; only the path's last K-1 nodes can reach it.
struct ConvCommitArgs {
  float* conv;             // [(K-1)][C]
  const float* node_upd;   // the nodes' conv inputs, node i's at node_upd + i * upd_stride
  int64_t upd_stride;
  const int32_t* commit;
  int C, W;                // W = K-1
};

__global__ void conv_commit_kernel(ConvCommitArgs a) {
  const int ch = blockIdx.x * blockDim.x + threadIdx.x;
  if (ch >= a.C) return;
  const int m = a.commit[1];
  const int32_t* path = a.commit + 2;
  float win[kMaxConvK];
  for (int r = 0; r < a.W; ++r) {
    const int src = r + m;
    win[r] = src < a.W ? a.conv[(int64_t)src * a.C + ch] : a.node_upd[(int64_t)path[src - a.W] * a.upd_stride + ch];
  }
  for (int r = 0; r < a.W; ++r) a.conv[(int64_t)r * a.C + ch] = win[r];
}

__global__ void delta_commit_kernel(DeltaCommitArgs a) {
  const int h = blockIdx.y, kh = h % a.nk;
  const int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, hs = (int64_t)a.dk * a.dv;
  if (e >= hs) return;
  const int i = (int)(e / a.dv), j = (int)(e % a.dv);
  const int64_t at = (int64_t)h * hs + e;
  const int m = a.commit[1];
  const int32_t* path = a.commit + 2;
  float s = ld_state(a.rec, at, a.state_type);
  for (int p = 0; p < m; ++p) {
    const float* upd = a.node_upd + (int64_t)path[p] * a.upd_stride;
    s = __fmul_rn(s, upd[a.decay_off + h]);
    s = fmaf(upd[a.k_off + kh * a.dk + i], upd[a.delta_off + (int64_t)h * a.dv + j], s);
    s = round_state(s, a.state_type);
  }
  st_state(a.rec, at, s, a.state_type);
}

}  // namespace fwd
}  // namespace cuda
}  // namespace dfl
