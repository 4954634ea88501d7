// matmul_exact.cu — K-quant weights (Q4_K, Q5_K, Q6_K) times int8 activations on
// the int8 tensor cores (mma.m16n8k32, mma.cuh), in the CPU's arithmetic bit for
// bit (csrc/quant/gemm_kquant.cpp, `reference`):
//   activations: the CPU's quantize_act_row with 256-value blocks (scale
//                amax / 127, q = rint(x / scale), 16-value sums);
//   per super-block i, in k order, for each output:
//     isum = sum_j scale_j * (q . xq over sub-block j)   exact int32 (the mma's sums)
//     msum = sum_g m_g * bsum_g                          exact int32
//     acc  = fma(d_i * xd_i, float(isum), acc);  accm = fma(dm_i * xd_i, float(msum), accm)
//   out = acc - accm.
// Integer sums are exact in any order, so the instruction's internal order cannot
// change a result, and each output's float steps run in one lane in k order:
// a token's result is the same for every n (AR, verify, prefill) and the same as
// the CPU backend's.  The kernels that share that arithmetic:
//   n <= 8:     kquant_dp4a_kernel / kquant_splitk_kernel, a matvec (8 lanes per
//               row, dp4a) that streams the weights once for AR steps and small
//               verifies (and verifies of few-row weights, 8 tokens a pass);
//   9..64:      kquant_mma_stream_kernel, a warp = 16 rows x up to 32 tokens on the
//               tensor cores with the next super-block's loads in flight, so a
//               verify reads each weight once from DRAM;
//   more:       kquant_gemm_kernel, a CTA = 128 rows x 64 tokens from tiles copied
//               into shared memory (cp.async, double-buffered): prefill chunks.
// kquant_mma_kernel (one warp = 16 rows x up to 64 tokens in rounds of 4 super-blocks,
// operands straight from global memory) is what the first GPU record timed; it is
// kept for comparison (set_mma_split(-1)).
// Q8_0 / Q4_0 have their own pair further down (8 float chains by block index).
// The CUDA backend takes them for every K-quant, Q8_0 and Q4_0 matmul (backend.cu).
//
// Speed: the first H100 record (bench/results/gpu-20261127-0552.md) timed the
// matvec at up to 1.8 TB/s and kquant_mma_kernel on verifies at 0.3-0.4 TB/s,
// hence the streaming kernel, and at 17-28 GB/s on prefill chunks, hence the tiled one.
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <utility>
#include <type_traits>

#include "formats.cuh"
#include "launch.cuh"
#include "matmul_exact.cuh"
#include "mma.cuh"

namespace dfl {
namespace cuda {

namespace {

constexpr int kQK = 256;
constexpr int kWarpsPerCta = 4;
constexpr int kMaxTokTiles = 8;  // token tiles of 8 per warp: up to 64 tokens per weight pass
template <DType T>
constexpr int kBlockBytes = T == DType::Q4_K ? (int)sizeof(block_q4_K)
                            : T == DType::Q5_K ? (int)sizeof(block_q5_K) : (int)sizeof(block_q6_K);

// 4 bytes of a row: Q4_K/Q5_K blocks (144, 176 bytes) keep rows 16-byte aligned,
// Q6_K's 210-byte blocks only 2-byte aligned (two 2-byte loads).
template <DType T>
__device__ __forceinline__ uint32_t ld_u32_row(const uint8_t* p) {
  if constexpr (T == DType::Q6_K) return ld_u16(p) | ld_u16(p + 2) << 16;
  return __ldg(reinterpret_cast<const unsigned int*>(p));
}
__device__ __forceinline__ uint32_t ld_u32_act(const int8_t* p) {  // activations: 4-byte aligned
  return *reinterpret_cast<const uint32_t*>(p);
}
__device__ __forceinline__ uint32_t bcast4(int v) { return (uint32_t)(uint8_t)v * 0x01010101u; }
// One output's float steps over a round's super-blocks s = 0 .. steps - 1 (consecutive in k), as the CPU
// takes them: acc = fma(d_s * xd_s, isum_s, acc), accm = fma(dm_s * xd_s, msum_s, accm).  The split-K kernels'
// round exchanges lay d / dm and the sums out at strides of their own.
__device__ __forceinline__ void round_float_steps(float& acc, float& accm, const float* d, const float* dm,
                                                  int d_stride, const int* isum, const int* msum, int sum_stride,
                                                  const float* xd_round, int steps) {
  for (int s = 0; s < steps; ++s) {
    const float xdi = xd_round[s];
    acc = fmaf(__fmul_rn(d[s * d_stride], xdi), (float)isum[s * sum_stride], acc);
    accm = fmaf(__fmul_rn(dm[s * d_stride], xdi), (float)msum[s * sum_stride], accm);
  }
}
// 8 bytes from a 2-byte aligned address (Q6_K's 210-byte blocks): three aligned words and two funnel
// shifts.  The third word is read even when unused (4-aligned p): the caller's chunks end at least 4 bytes
// before their block does (Q6_K's ql / qh chunks end by byte 192 of 210).
__device__ __forceinline__ uint2 ld8_a2(const uint8_t* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const uint32_t sh = (uint32_t)(a & 3u) * 8u;
  const unsigned int* wp = reinterpret_cast<const unsigned int*>(a & ~(uintptr_t)3);
  const uint32_t w0 = __ldg(wp), w1 = __ldg(wp + 1), w2 = __ldg(wp + 2);
  return make_uint2(__funnelshift_r(w0, w1, sh), __funnelshift_r(w1, w2, sh));
}

// The CPU's quantize_act_row (block 256): one warp per (token, block), 8 values a lane.  A lane's 8 floats
// come as two 16-byte loads and its 8 quants go out as one 8-byte store (eight scalar loads a lane, each warp
// instruction touching 32 sectors for 128 bytes, had cost 8x the sectors in the emulator's memory trace).
__global__ void quantize_act_kernel(const float* __restrict__ x, int64_t cols, int n, int8_t* __restrict__ q,
                                    float* __restrict__ d, int16_t* __restrict__ bsum) {
  const int lane = threadIdx.x & 31;
  const int64_t nb = cols / kQK;
  const int64_t item = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (item >= (int64_t)n * nb) return;  // whole warps only
  const int64_t tok = item / nb, b = item % nb;
  const float* xp = x + tok * cols + b * kQK + 8 * lane;  // (16-byte aligned: matmul_exact_quantize)
  const float4 lo = *reinterpret_cast<const float4*>(xp), hi = *reinterpret_cast<const float4*>(xp + 4);
  const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  float amax = 0.f;
  for (int k = 0; k < 8; ++k) amax = fmaxf(amax, fabsf(v[k]));
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float dv = __fdiv_rn(amax, 127.f);
  const float id = dv > 0.f ? __fdiv_rn(1.f, dv) : 0.f;
  int sum = 0;
  int8_t* qp = q + tok * cols + b * kQK + 8 * lane;
  uint32_t packed[2] = {0u, 0u};
  for (int k = 0; k < 8; ++k) {
    const int qi = (int)rintf(__fmul_rn(v[k], id));
    packed[k >> 2] |= (uint32_t)(uint8_t)(int8_t)qi << (8 * (k & 3));
    sum += qi;
  }
  *reinterpret_cast<uint2*>(qp) = make_uint2(packed[0], packed[1]);
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);  // lanes 2m, 2m+1 hold group m's 16 values
  if ((lane & 1) == 0) bsum[tok * (cols / 16) + b * 16 + lane / 2] = (int16_t)sum;
  if (lane == 0) d[tok * nb + b] = dv;
}

// One row's super-block as the tensor-core kernel needs it: the integer scales
// (Q4_K/Q5_K: one per 32-value sub-block; Q6_K: one per 16-value group), the
// offsets' integer weights (Q4_K/Q5_K: a min per sub-block; Q6_K: the group
// scale again, its offset being 32 * scale), and the float scales.
template <DType T>
struct SuperBlockScales {
  int sc[T == DType::Q6_K ? 16 : 8];
  int mn[8];  // Q4_K/Q5_K only
  float d, dm;
  __device__ __forceinline__ void load(const uint8_t* blk) {
    if constexpr (T == DType::Q6_K) {
#pragma unroll
      for (int g = 0; g < 16; ++g) sc[g] = (int)(int8_t)ld_u8(blk + kQ6_K_scales + g);
      d = dm = ld_f16(blk + kQ6_K_d);
    } else {  // d, dmin, scales[12]: a 16-byte aligned header
      const uint4 hdr = ld16(blk);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        uint32_t s, m;
        kq_scale_min_bits(hdr, j, s, m);
        sc[j] = (int)s;
        mn[j] = (int)m;
      }
      d = f16_bits_to_f32(hdr.x);
      dm = f16_bits_to_f32(hdr.x >> 16);
    }
  }
};

// Quants 4l..4l+3 of sub-block j (values 32j..32j+31) of one super-block, packed
// as 4 int8 (unsigned values, all < 64, so the s8 instruction reads them right).
template <DType T>
__device__ __forceinline__ uint32_t quants4(const uint8_t* blk, int j, int l) {
  if constexpr (T == DType::Q6_K) {
    // value 128h + 32s + l: low bits from ql[64h + 32(s & 1) + l] (high nibble for s >= 2),
    // high bits (qh[32h + l] >> 2s) & 3
    const int h = j >> 2, s = j & 3;
    const uint32_t ql = ld_u32_row<T>(blk + kQ6_K_ql + 64 * h + 32 * (s & 1) + 4 * l);
    const uint32_t qh = ld_u32_row<T>(blk + kQ6_K_qh + 32 * h + 4 * l);
    return ((ql >> (s >= 2 ? 4 : 0)) & 0x0f0f0f0fu) | (((qh >> (2 * s)) & 0x03030303u) << 4);
  } else {
    // value 64c + 32h + l is nibble h of qs[32c + l] (+16 from qh bit 2c + h for Q5_K)
    constexpr bool Q5 = T == DType::Q5_K;
    const int c = j >> 1, h = j & 1;
    const uint32_t qs = ld_u32_row<T>(blk + (Q5 ? kQ5_K_qs : kQ4_K_qs) + 32 * c + 4 * l);
    uint32_t v = (qs >> (4 * h)) & 0x0f0f0f0fu;
    if (Q5) v |= ((ld_u32_row<T>(blk + kQ5_K_qh + 4 * l) >> j) & 0x01010101u) << 4;
    return v;
  }
}

// y[t][r] for the CTA's 16 rows and 8 kTokTiles tokens.  Its warps split K: in
// round r, warp w takes super-block W r + w and computes that super-block's exact
// integer sums for every (row, token); they meet in shared memory, and each
// output's float steps then run in one thread over the round's super-blocks in
// k order.  So the K order of the float work is the CPU's whatever the split,
// and a 5120-row weight still gives 320 CTAs of 4 warps (a warp per 16 rows
// and the whole K would leave an H100 with 2-3 warps an SM for it).
// A warp's lane (g, t4) = (lane / 4, lane % 4) holds rows g and g + 8 times
// tokens 2 t4 and 2 t4 + 1 of each 8-token tile (the mma's C fragment); the
// chain thread (warp w, lane) takes those elements of tiles w, w + W, ...
// Per sub-block and tile: the quants' mma (Q6_K: two, one per 16-value group
// with the other half of k zeroed) scaled into isum in integers, and a second
// mma whose A holds each row's offset weight broadcast over the sub-block's k,
// chained in C across the sub-blocks: msum = sum_k m(k) * xq(k), the CPU's
// sum_g m_g * bsum_g term for term, with no per-output loop.
template <DType T, int kTokTiles>
__global__ void __launch_bounds__(kWarpsPerCta * 32)
    kquant_mma_kernel(const uint8_t* __restrict__ w, int64_t rows, int64_t cols, int64_t row_bytes,
                      const int8_t* __restrict__ xq, const float* __restrict__ xd, int n, float* __restrict__ y) {
  DFL_LAUNCH_BOUND(kWarpsPerCta * 32);
  constexpr int BS = kBlockBytes<T>, W = kWarpsPerCta;
  constexpr int CT = (kTokTiles + W - 1) / W;  // tiles per chain thread
  DFL_STATIC_SMEM(int, part_isum, [W][kTokTiles][4][32]);
  DFL_STATIC_SMEM(int, part_msum, [W][kTokTiles][4][32]);
  DFL_STATIC_SMEM(float, part_d, [W][16]);
  DFL_STATIC_SMEM(float, part_dm, [W][16]);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const int64_t m0 = (int64_t)blockIdx.x * 16;
  const int tok0 = blockIdx.y * 8 * kTokTiles;
  const int tiles = min(kTokTiles, (n - tok0 + 7) / 8);
  const int64_t nb = cols / kQK;
  // rows and tokens past the end are read (as the last one), never written
  const int64_t ra = min(m0 + g, rows - 1), rb = min(m0 + g + 8, rows - 1);
  int tokB[kTokTiles];  // the lane's B-fragment token per tile
#pragma unroll
  for (int tt = 0; tt < kTokTiles; ++tt) tokB[tt] = min(tok0 + 8 * tt + g, n - 1);
  float acc[CT][4], accm[CT][4];
#pragma unroll
  for (int c = 0; c < CT; ++c)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[c][e] = accm[c][e] = 0.f;

  for (int64_t i0 = 0; i0 < nb; i0 += W) {
    const int64_t i = i0 + warp;
    if (i < nb) {  // this warp's super-block: integer sums only
      const uint8_t* blk_a = w + ra * row_bytes + i * BS;
      const uint8_t* blk_b = w + rb * row_bytes + i * BS;
      SuperBlockScales<T> sa, sb;
      sa.load(blk_a);
      sb.load(blk_b);
      int isum[kTokTiles][4], msum[kTokTiles][4];
#pragma unroll
      for (int tt = 0; tt < kTokTiles; ++tt)
#pragma unroll
        for (int e = 0; e < 4; ++e) isum[tt][e] = msum[tt][e] = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        // A fragment: rows g / g + 8, values 4 t4.. and 16 + 4 t4.. of sub-block j
        const uint32_t a0 = quants4<T>(blk_a, j, t4), a1 = quants4<T>(blk_b, j, t4);
        const uint32_t a2 = quants4<T>(blk_a, j, 4 + t4), a3 = quants4<T>(blk_b, j, 4 + t4);
        uint32_t am[4];  // the offsets' A: each row's weight over the sub-block's 32 (or 2 x 16) values
        if constexpr (T == DType::Q6_K) {
          am[0] = bcast4(sa.sc[2 * j]), am[1] = bcast4(sb.sc[2 * j]);
          am[2] = bcast4(sa.sc[2 * j + 1]), am[3] = bcast4(sb.sc[2 * j + 1]);
        } else {
          am[0] = am[2] = bcast4(sa.mn[j]);
          am[1] = am[3] = bcast4(sb.mn[j]);
        }
        const int32_t zero[4] = {0, 0, 0, 0};
#pragma unroll
        for (int tt = 0; tt < kTokTiles; ++tt) {
          if (tt >= tiles) break;
          const int8_t* xp = xq + (int64_t)tokB[tt] * cols + i * kQK + 32 * j + 4 * t4;
          const uint32_t b[2] = {ld_u32_act(xp), ld_u32_act(xp + 16)};
          int32_t c[4];
          if constexpr (T == DType::Q6_K) {  // a scale per 16 values: the two halves of k apart
            const uint32_t lo[4] = {a0, a1, 0u, 0u}, hi[4] = {0u, 0u, a2, a3};
            int32_t c2[4];
            mma_m16n8k32_s8(c, lo, b, zero);
            mma_m16n8k32_s8(c2, hi, b, zero);
            isum[tt][0] += sa.sc[2 * j] * c[0] + sa.sc[2 * j + 1] * c2[0];
            isum[tt][1] += sa.sc[2 * j] * c[1] + sa.sc[2 * j + 1] * c2[1];
            isum[tt][2] += sb.sc[2 * j] * c[2] + sb.sc[2 * j + 1] * c2[2];
            isum[tt][3] += sb.sc[2 * j] * c[3] + sb.sc[2 * j + 1] * c2[3];
          } else {
            const uint32_t a[4] = {a0, a1, a2, a3};
            mma_m16n8k32_s8(c, a, b, zero);
            isum[tt][0] += sa.sc[j] * c[0];
            isum[tt][1] += sa.sc[j] * c[1];
            isum[tt][2] += sb.sc[j] * c[2];
            isum[tt][3] += sb.sc[j] * c[3];
          }
          mma_m16n8k32_s8(msum[tt], am, b, msum[tt]);
        }
      }
#pragma unroll
      for (int tt = 0; tt < kTokTiles; ++tt) {
        if (tt >= tiles) break;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          part_isum[warp][tt][e][lane] = isum[tt][e];
          part_msum[warp][tt][e][lane] = T == DType::Q6_K ? 32 * msum[tt][e] : msum[tt][e];
        }
      }
      if (t4 == 0) {
        part_d[warp][g] = sa.d, part_d[warp][g + 8] = sb.d;
        part_dm[warp][g] = sa.dm, part_dm[warp][g + 8] = sb.dm;
      }
    }
    __syncthreads();
    // the float steps of this thread's outputs over the round's super-blocks, in k order
    const int steps = (int)min((int64_t)W, nb - i0);
#pragma unroll
    for (int c = 0; c < CT; ++c) {
      const int tt = warp + W * c;
      if (tt >= tiles) break;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = g + (e < 2 ? 0 : 8), tok = min(tok0 + 8 * tt + 2 * t4 + (e & 1), n - 1);
        round_float_steps(acc[c][e], accm[c][e], &part_d[0][r], &part_dm[0][r], 16, &part_isum[0][tt][e][lane],
                          &part_msum[0][tt][e][lane], kTokTiles * 4 * 32, xd + (int64_t)tok * nb + i0, steps);
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int c = 0; c < CT; ++c) {
    const int tt = warp + W * c;
    if (tt >= tiles) break;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t r = m0 + g + (e < 2 ? 0 : 8);
      const int t = tok0 + 8 * tt + 2 * t4 + (e & 1);
      if (r < rows && t < n) y[(int64_t)t * rows + r] = __fsub_rn(acc[c][e], accm[c][e]);
    }
  }
}

// ---------------------------------------------------------------- n <= 8: dp4a
// The same arithmetic for AR and small verify batches, at the weight-streaming
// rate: a group of 8 lanes owns a row, lane j decodes task j of each super-block
// (formats.cuh's task layout: one 16-byte quant load, two runs of 16 values with
// one integer scale each) and dots it with the activations by dp4a; a butterfly
// over the 8 lanes gives the super-block's exact isum and msum to every lane of
// the group, and each lane then takes the float steps in k order exactly as the
// tensor-core kernel does.  So its results are bit-identical to that kernel's
// (and the CPU's) for every token: which kernel serves a batch never shows.
template <DType T>
using ExactFmt = std::conditional_t<T == DType::Q4_K, FmtQ4_K, std::conditional_t<T == DType::Q5_K, FmtQ5_K, FmtQ6_K>>;

// Byte k (0..15, may vary by lane) of a 16-byte value, without indexing registers.
__device__ __forceinline__ int byte_of(const uint4& v, int k) {
  const uint32_t w = k < 4 ? v.x : k < 8 ? v.y : k < 12 ? v.z : v.w;
  return (int)((w >> (8 * (k & 3))) & 0xffu);
}

// Task j of one super-block: its values as int8 (unsigned, < 64) in two runs of
// 16 (lo = the task's values 0..15, hi = 16..31), their integer scales, the
// offsets' weights of the 16-value groups 2j and 2j+1, and the float scales.
// `fetch` issues the task's loads and `decode` unpacks them, so the matvec can
// have the next super-block's loads in flight while it works on this one.
template <DType T>
struct ExactTask {
  struct Raw {
    uint4 q, qh, hdr;  // Q4_K/Q5_K: qs chunk, qh (Q5_K), header; Q6_K: ql chunk, qh chunk, scales[16]
    uint32_t d6;       // Q6_K: d
  };
  uint32_t lo[4], hi[4];
  int sc_lo, sc_hi, m0, m1;
  float d, dm;

  __device__ __forceinline__ static Raw fetch(const uint8_t* blk, int j) {
    Raw r;
    if constexpr (T == DType::Q6_K) {
      const int h = j >> 2, k = j & 3, kk = k & 1;  // FmtQ6_K's task j
      r.q = ld16_u(blk + kQ6_K_ql + 64 * h + 16 * k);
      r.qh = ld16_u(blk + kQ6_K_qh + 32 * h + 16 * kk);
      r.hdr = ld16_u(blk + kQ6_K_scales);
      r.d6 = ld_u16(blk + kQ6_K_d);
    } else {
      r.hdr = ld16(blk);  // d, dmin, scales[12]: 16-byte aligned (144- and 176-byte blocks)
      r.q = ld16(blk + (T == DType::Q5_K ? kQ5_K_qs : kQ4_K_qs) + 16 * j);
      r.qh = T == DType::Q5_K ? ld16(blk + kQ5_K_qh + 16 * (j & 1)) : make_uint4(0u, 0u, 0u, 0u);
      r.d6 = 0u;
    }
    return r;
  }

  __device__ __forceinline__ void decode(const Raw& r, int j) {
    if constexpr (T == DType::Q6_K) {
      const int h = j >> 2, k = j & 3, up = k >> 1, kk = k & 1;
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const uint32_t l = u4_word(r.q, w), b = u4_word(r.qh, w) >> (2 * up);
        lo[w] = (l & 0x0f0f0f0fu) | ((b << 4) & 0x30303030u);
        hi[w] = ((l >> 4) & 0x0f0f0f0fu) | (b & 0x30303030u);
      }
      sc_lo = (int)(int8_t)byte_of(r.hdr, 8 * h + kk + 2 * up);
      sc_hi = (int)(int8_t)byte_of(r.hdr, 8 * h + kk + 4 + 2 * up);
      m0 = 32 * (int)(int8_t)byte_of(r.hdr, 2 * j);
      m1 = 32 * (int)(int8_t)byte_of(r.hdr, 2 * j + 1);
      d = dm = f16_bits_to_f32(r.d6);
    } else {  // FmtQ4_K / FmtQ5_K's task j: sub-blocks 2c (low nibbles) and 2c+1 (high)
      const int c = j >> 1;
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const uint32_t q = u4_word(r.q, w), b = u4_word(r.qh, w) >> (2 * c);
        lo[w] = (q & 0x0f0f0f0fu) | ((b << 4) & 0x10101010u);
        hi[w] = ((q >> 4) & 0x0f0f0f0fu) | ((b << 3) & 0x10101010u);
      }
      uint32_t s, mn;
      kq_scale_min_bits(r.hdr, 2 * c, s, mn);
      sc_lo = (int)s;
      kq_scale_min_bits(r.hdr, 2 * c + 1, s, mn);
      sc_hi = (int)s;
      kq_scale_min_bits(r.hdr, j, s, mn);  // groups 2j and 2j+1 are sub-block j
      m0 = m1 = (int)mn;
      d = f16_bits_to_f32(r.hdr.x);
      dm = f16_bits_to_f32(r.hdr.x >> 16);
    }
  }
};

// Super-block i's exact integer sums for token tok, over the 8 lanes of a row's group: lane j's task
// dotted with the activations by dp4a, then an xor butterfly (4, 2, 1 stays inside the group; exact
// in any order).  Every lane of the group gets the totals.
template <DType T>
__device__ __forceinline__ void group_sums(const ExactTask<T>& q, const int8_t* __restrict__ xq,
                                           const int16_t* __restrict__ xbsum, int64_t cols, int64_t i, int64_t tok,
                                           int j, int e_lo, int e_hi, int& isum, int& msum) {
  const uint8_t* xp = reinterpret_cast<const uint8_t*>(xq + tok * cols + i * kQK);
  const uint4 xl = ld16(xp + e_lo), xh = ld16(xp + e_hi);
  int dl = 0, dh = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    dl = __dp4a((int)q.lo[k], (int)u4_word(xl, k), dl);
    dh = __dp4a((int)q.hi[k], (int)u4_word(xh, k), dh);
  }
  // the lane's two 16-value group sums as one 4-byte load (the layout keeps them 4-byte aligned: 16-byte
  // aligned rows of cols / 16 sums); two 2-byte loads had touched a sector each for 64 bytes a warp
  const uint32_t bs = __ldg(reinterpret_cast<const unsigned int*>(xbsum + tok * (cols / 16) + 16 * i + 2 * j));
  isum = q.sc_lo * dl + q.sc_hi * dh;
  msum = q.m0 * (int)(int16_t)(bs & 0xffffu) + q.m1 * (int)(int16_t)(bs >> 16);
#pragma unroll
  for (int o = 4; o > 0; o >>= 1) {
    isum += __shfl_xor_sync(0xffffffffu, isum, o);
    msum += __shfl_xor_sync(0xffffffffu, msum, o);
  }
}

constexpr int kDp4aMaxTokens = 8;
constexpr int kRowsPerDp4aWarp = 4;  // a group of 8 lanes per row

template <DType T, int NT>
__global__ void __launch_bounds__(kWarpsPerCta * 32)
    kquant_dp4a_kernel(const uint8_t* __restrict__ w, int64_t rows, int64_t cols, int64_t row_bytes,
                       const int8_t* __restrict__ xq, const float* __restrict__ xd,
                       const int16_t* __restrict__ xbsum, int n, float* __restrict__ y) {
  DFL_LAUNCH_BOUND(kWarpsPerCta * 32);
  using F = ExactFmt<T>;
  constexpr int BS = kBlockBytes<T>;
  const int lane = threadIdx.x & 31, j = lane & 7;
  const int64_t r = ((int64_t)blockIdx.x * kWarpsPerCta + (threadIdx.x >> 5)) * kRowsPerDp4aWarp + (lane >> 3);
  const uint8_t* row = w + min(r, rows - 1) * row_bytes;  // past the end: read the last row, write nothing
  const int64_t nb = cols / kQK;
  const int e_lo = F::elem(j, 0), e_hi = F::elem(j, 16);  // the runs' first elements (multiples of 16)
  float acc[NT], accm[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = accm[t] = 0.f;
  typename ExactTask<T>::Raw raw = ExactTask<T>::fetch(row, j);
  for (int64_t i = 0; i < nb; ++i) {
    // the next super-block's loads go out before this one's math (the last is fetched again, unused)
    const typename ExactTask<T>::Raw next = ExactTask<T>::fetch(row + min(i + 1, nb - 1) * BS, j);
    ExactTask<T> q;
    q.decode(raw, j);
    raw = next;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const int64_t tok = min(t, n - 1);
      int isum, msum;
      group_sums<T>(q, xq, xbsum, cols, i, tok, j, e_lo, e_hi, isum, msum);
      const float xdi = xd[tok * nb + i];
      acc[t] = fmaf(__fmul_rn(q.d, xdi), (float)isum, acc[t]);
      accm[t] = fmaf(__fmul_rn(q.dm, xdi), (float)msum, accm[t]);
    }
  }
  if (r >= rows) return;
#pragma unroll
  for (int t = 0; t < NT; ++t)
    if (t == j && t < n) y[(int64_t)t * rows + r] = __fsub_rn(acc[t], accm[t]);
}

// ---------------------------------------------------------------- n <= 8, fewer rows: split K
// The same lane-group arithmetic with the CTA's 16 groups of 8 lanes spread over R rows x
// S = 16 / R super-block slots: in round k, group (row, slot) takes super-block S k + slot of its
// row and leaves the exact integer sums (isum, msum per token) and the float scales in shared
// memory; after the round's barrier one thread per (row, token) takes the round's float steps
// over slots 0..S-1, i.e. super-blocks in k order.  The results are the dp4a kernel's bits; what
// changes is how many loads are in flight: a 5120-row weight gets 16 / R times the CTAs, and the
// 48-row projections of a delta-net layer a CTA per row instead of three CTAs in all, each walking
// its whole row one super-block at a time.  Shared memory is double-buffered by round parity, so
// a round needs one barrier: the writes of round k + 2 come after every thread passed round
// k + 1's barrier, which a chain thread reaches only after reading round k.
constexpr int kLaneGroups = kWarpsPerCta * 32 / 8;

template <DType T, int NT, int R>
__global__ void __launch_bounds__(kWarpsPerCta * 32)
    kquant_splitk_kernel(const uint8_t* __restrict__ w, int64_t rows, int64_t cols, int64_t row_bytes,
                         const int8_t* __restrict__ xq, const float* __restrict__ xd,
                         const int16_t* __restrict__ xbsum, int n, float* __restrict__ y) {
  DFL_LAUNCH_BOUND(kWarpsPerCta * 32);
  using F = ExactFmt<T>;
  constexpr int BS = kBlockBytes<T>, S = kLaneGroups / R;
  static_assert(R * S == kLaneGroups && R * NT <= kWarpsPerCta * 32, "a CTA's groups and chain threads");
  DFL_STATIC_SMEM(int, part_isum, [2][kLaneGroups][NT]);
  DFL_STATIC_SMEM(int, part_msum, [2][kLaneGroups][NT]);
  DFL_STATIC_SMEM(float, part_d, [2][kLaneGroups]);
  DFL_STATIC_SMEM(float, part_dm, [2][kLaneGroups]);
  const int lane = threadIdx.x & 31, j = lane & 7, grp = threadIdx.x >> 3;
  const int slot = grp % S;
  const int64_t nb = cols / kQK;
  const uint8_t* row = w + min((int64_t)blockIdx.x * R + grp / S, rows - 1) * row_bytes;  // past the end: the last
  const int e_lo = F::elem(j, 0), e_hi = F::elem(j, 16);
  const int crow = threadIdx.x / NT, ctok = threadIdx.x % NT;  // the chain thread's (row, token), if < R * NT
  const bool chain = threadIdx.x < R * NT;
  const int64_t ctok_read = min(ctok, n - 1);
  float acc = 0.f, accm = 0.f;
  typename ExactTask<T>::Raw raw = ExactTask<T>::fetch(row + min((int64_t)slot, nb - 1) * BS, j);
  int buf = 0;
  for (int64_t i0 = 0; i0 < nb; i0 += S, buf ^= 1) {
    // a slot past the row's end computes the last super-block again and writes nothing: the
    // warp's shuffles need all its lanes
    const bool live = i0 + slot < nb;
    const int64_t i = min(i0 + slot, nb - 1);
    // the next round's loads go out before this one's math (past the end: the last, unused)
    const typename ExactTask<T>::Raw next = ExactTask<T>::fetch(row + min(i0 + slot + S, nb - 1) * BS, j);
    {
      ExactTask<T> q;
      q.decode(raw, j);
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        int isum, msum;
        group_sums<T>(q, xq, xbsum, cols, i, min(t, n - 1), j, e_lo, e_hi, isum, msum);
        if (live && j == t) part_isum[buf][grp][t] = isum, part_msum[buf][grp][t] = msum;
      }
      if (live && j == 0) part_d[buf][grp] = q.d, part_dm[buf][grp] = q.dm;
    }
    raw = next;
    __syncthreads();
    if (chain) {  // the round's float steps, super-blocks i0, i0 + 1, ... in k order
      const int steps = (int)min((int64_t)S, nb - i0), g0 = crow * S;
      round_float_steps(acc, accm, &part_d[buf][g0], &part_dm[buf][g0], 1, &part_isum[buf][g0][ctok],
                        &part_msum[buf][g0][ctok], NT, xd + ctok_read * nb + i0, steps);
    }
  }
  const int64_t r = (int64_t)blockIdx.x * R + crow;
  if (chain && r < rows && ctok < n) y[(int64_t)ctok * rows + r] = __fsub_rn(acc, accm);
}

// ---------------------------------------------------------------- 9..64 tokens: the streaming verify kernel
// The first H100 record timed kquant_mma_kernel at 300-390 GB/s on a 23-token verify (1.8 TB/s for
// the AR matvec): its warps load a super-block only after the previous round's barrier and float
// chain, one 4-byte load per fragment register, so each SM has a few KB of weights in flight.  This
// kernel keeps the same integer sums and float steps (so the same bits) and streams:
//  - A permuted K order inside each 32-value sub-block (integer sums are exact in any order, as
//    long as A and B use the same one): lane (g, t4) holds values 8 t4 .. 8 t4 + 7 of every
//    sub-block, so its quants are one 8-byte load per row and 32-value chunk (Q4_K / Q5_K: the
//    chunk qs[32 c + 8 t4 ..] holds sub-blocks 2c and 2c + 1 as low and high nibbles), and its B
//    fragment one 8-byte load of the activations.
//  - The next super-block's loads are issued before this one's math (registers, double-buffered).
//  - W warps split a row group's K (super-blocks ks, ks + W, ...; W = 1, 2 or 4 by shape, so a
//    5120-row weight still has ~1280 warps): with W = 1 a lane takes its outputs' float steps
//    itself after each super-block and the kernel has no barrier; with W > 1 the integer sums meet
//    in double-buffered shared memory, one barrier a round, and lane (ks, ...) takes the steps of
//    tiles ks, ks + W, ... over the round's super-blocks in k order.
//  - At most 4 token tiles (32 tokens) a CTA; larger verifies take more CTAs on the grid's fast
//    axis, so the CTAs that share a row group run together and read the weights once from DRAM.
// Where a StreamBlock reads its super-block from: global memory through the read-only cache (the
// streaming kernel), or the tiled kernel's copy in shared memory.  Same bytes, same layout.
struct FromGlobal {
  __device__ __forceinline__ static uint2 ld8(const uint8_t* p) { return __ldg(reinterpret_cast<const uint2*>(p)); }
  __device__ __forceinline__ static uint2 ld8_2(const uint8_t* p) { return ld8_a2(p); }  // 2-byte aligned
  __device__ __forceinline__ static uint4 ld16a(const uint8_t* p) { return ld16(p); }
  __device__ __forceinline__ static uint4 ld16_2(const uint8_t* p) { return ld16_u(p); }  // 2-byte aligned
  __device__ __forceinline__ static uint32_t ld2(const uint8_t* p) { return ld_u16(p); }
};
struct FromShared {
  template <class V>
  __device__ __forceinline__ static V lds(const uint8_t* p) {
#ifdef DFL_EMU
    if (reinterpret_cast<uintptr_t>(p) % sizeof(V)) std::abort();  // a misaligned vector load faults on the GPU
#endif
    return *reinterpret_cast<const V*>(p);
  }
  // n words from the 4-byte aligned address below p, shifted down by p's misalignment (0 or 2 bytes here)
  template <int N>
  __device__ __forceinline__ static void words(const uint8_t* p, uint32_t (&out)[N]) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    const uint8_t* base = reinterpret_cast<const uint8_t*>(a & ~(uintptr_t)3);
    const uint32_t sh = (uint32_t)(a & 3u) * 8u;
    uint32_t w[N + 1];
#pragma unroll
    for (int k = 0; k <= N; ++k) w[k] = lds<uint32_t>(base + 4 * k);
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = __funnelshift_r(w[k], w[k + 1], sh);
  }
  __device__ __forceinline__ static uint2 ld8(const uint8_t* p) { return lds<uint2>(p); }
  __device__ __forceinline__ static uint2 ld8_2(const uint8_t* p) {
    uint32_t v[2];
    words(p, v);
    return make_uint2(v[0], v[1]);
  }
  __device__ __forceinline__ static uint4 ld16a(const uint8_t* p) { return lds<uint4>(p); }
  __device__ __forceinline__ static uint4 ld16_2(const uint8_t* p) {
    uint32_t v[4];
    words(p, v);
    return make_uint4(v[0], v[1], v[2], v[3]);
  }
  __device__ __forceinline__ static uint32_t ld2(const uint8_t* p) { return lds<uint16_t>(p); }
};

template <DType T, class Mem = FromGlobal>
struct StreamBlock {  // one lane's share of 16 rows' super-block i: rows a = g, b = g + 8
  uint4 hdr[2];       // Q4_K/Q5_K: d, dmin, scales[12];  Q6_K: scales[16]
  uint2 q[2][4];      // Q4_K/Q5_K: qs[32 c + 8 t4 ..] for c = 0..3;  Q6_K: ql[64 h + 32 p + 8 t4 ..], index 2h + p
  uint2 qh[2][2];     // Q5_K: qh[8 t4 ..] (index 0);  Q6_K: qh[32 h + 8 t4 ..]
  uint32_t d6[2];     // Q6_K: d

  __device__ __forceinline__ void fetch(const uint8_t* blk_a, const uint8_t* blk_b, int t4) {
    const uint8_t* blk[2] = {blk_a, blk_b};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if constexpr (T == DType::Q6_K) {
#pragma unroll
        for (int k = 0; k < 4; ++k) q[r][k] = Mem::ld8_2(blk[r] + kQ6_K_ql + 64 * (k >> 1) + 32 * (k & 1) + 8 * t4);
#pragma unroll
        for (int h = 0; h < 2; ++h) qh[r][h] = Mem::ld8_2(blk[r] + kQ6_K_qh + 32 * h + 8 * t4);
        hdr[r] = Mem::ld16_2(blk[r] + kQ6_K_scales);
        d6[r] = Mem::ld2(blk[r] + kQ6_K_d);
      } else {  // 144- and 176-byte blocks: rows and chunks stay 16- and 8-byte aligned
        constexpr bool Q5 = T == DType::Q5_K;
        hdr[r] = Mem::ld16a(blk[r]);
#pragma unroll
        for (int c = 0; c < 4; ++c) q[r][c] = Mem::ld8(blk[r] + (Q5 ? kQ5_K_qs : kQ4_K_qs) + 32 * c + 8 * t4);
        if constexpr (Q5) qh[r][0] = Mem::ld8(blk[r] + kQ5_K_qh + 8 * t4);
        d6[r] = 0u;
      }
    }
  }

  // The lane's A values of sub-block j, row r: word 0 = values 8 t4 .. + 3, word 1 = 8 t4 + 4 .. + 7.
  __device__ __forceinline__ uint2 quants(int r, int j) const {
    if constexpr (T == DType::Q6_K) {  // value 128 h + 32 s + l: ql nibble (s >= 2: high) | qh bits 2s, 2s + 1
      const int h = j >> 2, s = j & 3;
      const uint2 l = q[r][2 * h + (s & 1)], b = qh[r][h];
      const int ls = s >= 2 ? 4 : 0;
      return make_uint2(((l.x >> ls) & 0x0f0f0f0fu) | (((b.x >> (2 * s)) & 0x03030303u) << 4),
                        ((l.y >> ls) & 0x0f0f0f0fu) | (((b.y >> (2 * s)) & 0x03030303u) << 4));
    } else {  // sub-block j = 2c + h: nibble h of qs[32 c + l] (+16 from qh bit j for Q5_K)
      const uint2 v = q[r][j >> 1];
      const int ls = 4 * (j & 1);
      uint2 out = make_uint2((v.x >> ls) & 0x0f0f0f0fu, (v.y >> ls) & 0x0f0f0f0fu);
      if constexpr (T == DType::Q5_K) {
        out.x |= ((qh[r][0].x >> j) & 0x01010101u) << 4;
        out.y |= ((qh[r][0].y >> j) & 0x01010101u) << 4;
      }
      return out;
    }
  }
  // Row r's integer scale(s) of sub-block j (Q6_K: its two 16-value groups) and offset weight
  // (Q4_K/Q5_K: the sub-block's min; Q6_K: the group's scale, per lane: values 8 t4 .. are group
  // t4 >= 2 of the sub-block).
  __device__ __forceinline__ void scales(int r, int j, int t4, int& s_lo, int& s_hi, int& m) const {
    if constexpr (T == DType::Q6_K) {
      s_lo = (int)(int8_t)byte_of(hdr[r], 2 * j);
      s_hi = (int)(int8_t)byte_of(hdr[r], 2 * j + 1);
      m = t4 >= 2 ? s_hi : s_lo;
    } else {
      uint32_t s, mn;
      kq_scale_min_bits(hdr[r], j, s, mn);
      s_lo = s_hi = (int)s;
      m = (int)mn;
    }
  }
  __device__ __forceinline__ float d(int r) const {
    return T == DType::Q6_K ? f16_bits_to_f32(d6[r]) : f16_bits_to_f32(hdr[r].x);
  }
  __device__ __forceinline__ float dm(int r) const {
    return T == DType::Q6_K ? f16_bits_to_f32(d6[r]) : f16_bits_to_f32(hdr[r].x >> 16);
  }
};

// Sub-block j of a StreamBlock's rows (a, b) as the tensor cores take it, for the lane: the A fragment
// (Q6_K: its two 16-value groups apart, each with its own scale), the integer scales, and the offsets' A
// (each row's offset weight over the lane's values).
template <DType T>
struct SubBlockA {
  uint32_t a[4], hi[4];  // Q6_K: a holds group 2j's values (lanes t4 < 2), hi group 2j + 1's; else a only
  uint32_t am[4];
  int sa_lo, sa_hi, sb_lo, sb_hi;

  template <class Mem>
  __device__ __forceinline__ SubBlockA(const StreamBlock<T, Mem>& blk, int j, int t4) {
    const uint2 qa = blk.quants(0, j), qb = blk.quants(1, j);
    int ma, mb;
    blk.scales(0, j, t4, sa_lo, sa_hi, ma);
    blk.scales(1, j, t4, sb_lo, sb_hi, mb);
    am[0] = am[2] = bcast4(ma);
    am[1] = am[3] = bcast4(mb);
    if constexpr (T == DType::Q6_K) {  // values 8 t4 .. are group t4 >= 2: the groups' lanes apart
      const bool lo_lane = t4 < 2;
      a[0] = lo_lane ? qa.x : 0u, a[1] = lo_lane ? qb.x : 0u, a[2] = lo_lane ? qa.y : 0u, a[3] = lo_lane ? qb.y : 0u;
      hi[0] = lo_lane ? 0u : qa.x, hi[1] = lo_lane ? 0u : qb.x, hi[2] = lo_lane ? 0u : qa.y, hi[3] = lo_lane ? 0u : qb.y;
    } else {
      a[0] = qa.x, a[1] = qb.x, a[2] = qa.y, a[3] = qb.y;
      hi[0] = hi[1] = hi[2] = hi[3] = 0u;
    }
  }
  // One 8-token tile whose lane B values (the same permuted order) are x: the exact integer sums
  // isum += scale * (quants . x) and msum += offsets . x.
  __device__ __forceinline__ void sums(uint2 x, int (&isum)[4], int (&msum)[4]) const {
    const uint32_t b[2] = {x.x, x.y};
    const int32_t zero[4] = {0, 0, 0, 0};
    int32_t c[4];
    mma_m16n8k32_s8(c, a, b, zero);
    if constexpr (T == DType::Q6_K) {
      int32_t c2[4];
      mma_m16n8k32_s8(c2, hi, b, zero);
      isum[0] += sa_lo * c[0] + sa_hi * c2[0];
      isum[1] += sa_lo * c[1] + sa_hi * c2[1];
      isum[2] += sb_lo * c[2] + sb_hi * c2[2];
      isum[3] += sb_lo * c[3] + sb_hi * c2[3];
    } else {
      isum[0] += sa_lo * c[0];
      isum[1] += sa_lo * c[1];
      isum[2] += sb_lo * c[2];
      isum[3] += sb_lo * c[3];
    }
    mma_m16n8k32_s8(msum, am, b, msum);
  }
};

// One tile's float steps for one super-block, as the CPU takes them: rows a (e < 2) and b, tokens
// x0 (even e) and x1 with activation scales xd0, xd1; Q6_K's offsets weigh 32 a scale unit.
template <DType T>
__device__ __forceinline__ void tile_float_steps(float (&acc)[4], float (&accm)[4], const int (&isum)[4],
                                                 const int (&msum)[4], float da, float db, float dma, float dmb,
                                                 float xd0, float xd1) {
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float xdi = e & 1 ? xd1 : xd0;
    const int ms = T == DType::Q6_K ? 32 * msum[e] : msum[e];
    acc[e] = fmaf(__fmul_rn(e < 2 ? da : db, xdi), (float)isum[e], acc[e]);
    accm[e] = fmaf(__fmul_rn(e < 2 ? dma : dmb, xdi), (float)ms, accm[e]);
  }
}

// One super-block's exact integer sums for a StreamBlock's row pair and the first `tiles` of kTiles token
// tiles: b(j, tt) gives the lane's B values of tile tt for sub-block j (from global or shared memory).
template <DType T, int kTiles, class Mem, class LoadB>
__device__ __forceinline__ void superblock_sums(const StreamBlock<T, Mem>& blk, int t4, int tiles, LoadB b,
                                                int (&isum)[kTiles][4], int (&msum)[kTiles][4]) {
#pragma unroll
  for (int tt = 0; tt < kTiles; ++tt)
#pragma unroll
    for (int e = 0; e < 4; ++e) isum[tt][e] = msum[tt][e] = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const SubBlockA<T> a(blk, j, t4);
#pragma unroll
    for (int tt = 0; tt < kTiles; ++tt) {
      if (tt >= tiles) break;
      a.sums(b(j, tt), isum[tt], msum[tt]);
    }
  }
}

constexpr int kStreamMaxTiles = 4;

template <DType T, int kTiles, int W>
__global__ void __launch_bounds__(kWarpsPerCta * 32)
    kquant_mma_stream_kernel(const uint8_t* __restrict__ w, int64_t rows, int64_t cols, int64_t row_bytes,
                             const int8_t* __restrict__ xq, const float* __restrict__ xd, int n,
                             float* __restrict__ y) {
  DFL_LAUNCH_BOUND(kWarpsPerCta * 32);
  constexpr int BS = kBlockBytes<T>, G = kWarpsPerCta / W;  // row groups of 16 a CTA
  constexpr int CT = (kTiles + W - 1) / W;                  // tiles whose float steps a lane takes
  static_assert(G * W == kWarpsPerCta && kTiles <= kStreamMaxTiles, "a CTA's warps and tiles");
  // W > 1: a round's integer sums by K slot (array sizes of 1 when W == 1: no shared memory used)
  DFL_STATIC_SMEM(int, part_isum, [W > 1 ? 2 : 1][G][W > 1 ? W : 1][W > 1 ? kTiles : 1][4][32]);
  DFL_STATIC_SMEM(int, part_msum, [W > 1 ? 2 : 1][G][W > 1 ? W : 1][W > 1 ? kTiles : 1][4][32]);
  DFL_STATIC_SMEM(float, part_d, [W > 1 ? 2 : 1][G][W > 1 ? W : 1][16]);
  DFL_STATIC_SMEM(float, part_dm, [W > 1 ? 2 : 1][G][W > 1 ? W : 1][16]);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const int rg = warp / W, ks = warp % W;
  const int64_t m0 = ((int64_t)blockIdx.y * G + rg) * 16;
  const int tok0 = blockIdx.x * 8 * kTiles;
  const int tiles = min(kTiles, (n - tok0 + 7) / 8);
  const int64_t nb = cols / kQK;
  // rows and tokens past the end are read (as the last one), never written
  const uint8_t* row_a = w + min(m0 + g, rows - 1) * row_bytes;
  const uint8_t* row_b = w + min(m0 + g + 8, rows - 1) * row_bytes;
  const int8_t* xb[kTiles];  // the lane's B-fragment token per tile, at its 8 values of sub-block 0
#pragma unroll
  for (int tt = 0; tt < kTiles; ++tt) xb[tt] = xq + (int64_t)min(tok0 + 8 * tt + g, n - 1) * cols + 8 * t4;
  int tokC[kTiles][2];  // the lane's C-fragment tokens per tile (2 t4, 2 t4 + 1)
#pragma unroll
  for (int tt = 0; tt < kTiles; ++tt)
#pragma unroll
    for (int u = 0; u < 2; ++u) tokC[tt][u] = min(tok0 + 8 * tt + 2 * t4 + u, n - 1);
  float acc[CT][4], accm[CT][4];
#pragma unroll
  for (int c = 0; c < CT; ++c)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[c][e] = accm[c][e] = 0.f;

  StreamBlock<T> cur, next;
  {
    const int64_t i = min((int64_t)ks, nb - 1);
    cur.fetch(row_a + i * BS, row_b + i * BS, t4);
  }
  int buf = 0;
  for (int64_t i0 = 0; i0 < nb; i0 += W, buf ^= 1) {
    // a K slot past the row's end computes the last super-block again and writes nothing
    const bool live = i0 + ks < nb;
    const int64_t i = min(i0 + ks, nb - 1);
    {
      const int64_t in = min(i0 + ks + W, nb - 1);  // past the end: the last again, unused
      next.fetch(row_a + in * BS, row_b + in * BS, t4);
    }
    int isum[kTiles][4], msum[kTiles][4];
    superblock_sums<T, kTiles>(cur, t4, tiles, [&](int j, int tt) {
      return __ldg(reinterpret_cast<const uint2*>(xb[tt] + i * kQK + 32 * j));
    }, isum, msum);
    if constexpr (W == 1) {  // the float steps of super-block i, in the lane that holds the sums
      const float da = cur.d(0), db = cur.d(1), dma = cur.dm(0), dmb = cur.dm(1);
#pragma unroll
      for (int tt = 0; tt < kTiles; ++tt) {
        if (tt >= tiles) break;
        tile_float_steps<T>(acc[tt], accm[tt], isum[tt], msum[tt], da, db, dma, dmb, xd[(int64_t)tokC[tt][0] * nb + i],
                            xd[(int64_t)tokC[tt][1] * nb + i]);
      }
    } else {
      if (live) {
#pragma unroll
        for (int tt = 0; tt < kTiles; ++tt) {
          if (tt >= tiles) break;
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            part_isum[buf][rg][ks][tt][e][lane] = isum[tt][e];
            part_msum[buf][rg][ks][tt][e][lane] = T == DType::Q6_K ? 32 * msum[tt][e] : msum[tt][e];
          }
        }
        if (t4 == 0) {
          part_d[buf][rg][ks][g] = cur.d(0), part_d[buf][rg][ks][g + 8] = cur.d(1);
          part_dm[buf][rg][ks][g] = cur.dm(0), part_dm[buf][rg][ks][g + 8] = cur.dm(1);
        }
      }
      __syncthreads();
      // the float steps of tiles ks, ks + W, ... over the round's super-blocks i0, i0 + 1, ... in k order
      const int steps = (int)min((int64_t)W, nb - i0);
#pragma unroll
      for (int c = 0; c < CT; ++c) {
        const int tt = ks + W * c;
        if (tt >= tiles) break;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = g + (e < 2 ? 0 : 8), tok = min(tok0 + 8 * tt + 2 * t4 + (e & 1), n - 1);  // (tt varies)
          round_float_steps(acc[c][e], accm[c][e], &part_d[buf][rg][0][r], &part_dm[buf][rg][0][r], 16,
                            &part_isum[buf][rg][0][tt][e][lane], &part_msum[buf][rg][0][tt][e][lane],
                            (W > 1 ? kTiles : 1) * 4 * 32, xd + (int64_t)tok * nb + i0, steps);
        }
      }
    }
    cur = next;
  }
#pragma unroll
  for (int c = 0; c < CT; ++c) {
    const int tt = W == 1 ? c : ks + W * c;
    if (tt >= tiles) break;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t r = m0 + g + (e < 2 ? 0 : 8);
      const int t = tok0 + 8 * tt + 2 * t4 + (e & 1);
      if (r < rows && t < n) y[(int64_t)t * rows + r] = __fsub_rn(acc[c][e], accm[c][e]);
    }
  }
}

// ---------------------------------------------------------------- prefill chunks: the tiled kernel
// The first H100 record timed kquant_mma_kernel at 17-28 GB/s of weights on 512-token prefill chunks
// (about 50 int8 TOPS, a few percent of the tensor cores; half of an 8K prefill's time): each warp
// loads its fragments straight from global memory, 4 bytes a register, and waits on them.  This kernel
// keeps the same integer sums and float steps (so the same bits, the CPU's) and tiles:
//  - A CTA of 8 warps owns 128 rows x 64 tokens and walks K one super-block at a time.  Each
//    super-block's weights (128 rows' blocks, byte for byte) and activations (64 tokens x 256 int8 and
//    their scales) are copied into shared memory by cp.async while the warps work on the previous one
//    (double-buffered, one barrier a super-block): a weight byte is read once for 64 tokens, an
//    activation once for 128 rows.
//  - Warp (wr, wt) = (warp % 4, warp / 4) takes rows 32 wr .. + 31 and tokens 32 wt .. + 31: two 16-row
//    m-tiles x four 8-token n-tiles, with the streaming kernel's fragments (StreamBlock in the permuted K
//    order, read from shared memory) and integer sums (SubBlockA).  An m-tile's float steps for the
//    super-block run right after its sums, in the lanes that hold them: k order per output, as the CPU.
//  - Shared-memory strides keep the 8-byte fragment loads free of bank conflicts: a token's activations
//    take 288 bytes (72 words), a row's block 160 (Q4_K) or 224 bytes (Q5_K; Q6_K, whose 210-byte blocks
//    are only 2-byte aligned, is copied as the 14 aligned 16-byte chunks around the block and read at its
//    offset in the first one, with funnel shifts).
constexpr int kGemmRows = 128, kGemmToks = 64, kGemmWarps = 8;
constexpr int kGemmActStride = 288;
template <DType T>
constexpr int kGemmRowStride = T == DType::Q4_K ? 160 : 224;
template <DType T>
constexpr int kGemmChunks = T == DType::Q6_K ? 14 : kBlockBytes<T> / 16;  // 16-byte copies a row's block
template <DType T>
constexpr int kGemmStageBytes = kGemmRows * kGemmRowStride<T> + kGemmToks * kGemmActStride + kGemmToks * 4;
template <DType T>
constexpr size_t kGemmSmemBytes = 2 * (size_t)kGemmStageBytes<T>;

template <DType T>
__global__ void __launch_bounds__(kGemmWarps * 32, 1)
    kquant_gemm_kernel(const uint8_t* __restrict__ w, int64_t rows, int64_t cols, int64_t row_bytes,
                       const int8_t* __restrict__ xq, const float* __restrict__ xd, int n, float* __restrict__ y) {
  DFL_LAUNCH_BOUND(kGemmWarps * 32);
  constexpr int BS = kBlockBytes<T>, RS = kGemmRowStride<T>, CH = kGemmChunks<T>, SB = kGemmStageBytes<T>;
  static_assert(CH * 16 <= RS && SB % 16 == 0, "a row's copied chunks fit its stride; stages stay 16-byte aligned");
  DFL_DYNAMIC_SMEM(uint4, smem4);
  uint8_t* const smem = reinterpret_cast<uint8_t*>(smem4);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int wr = warp & 3, wt = warp >> 2;
  const int tok0 = blockIdx.x * kGemmToks;
  const int64_t row0 = (int64_t)blockIdx.y * kGemmRows;
  const int64_t nb = cols / kQK;
  const uint8_t* const w_end = w + rows * row_bytes;
  // a row's block i in global memory (rows past the end: the last row, read and never written), and its
  // offset in the first 16-byte chunk copied (Q4_K / Q5_K blocks are 16-byte aligned)
  auto block_at = [&](int r, int64_t i) { return w + min(row0 + r, rows - 1) * row_bytes + i * BS; };
  auto block_off = [&](int r, int64_t i) {
    return T == DType::Q6_K ? (int)(reinterpret_cast<uintptr_t>(block_at(r, i)) & 15u) : 0;
  };
  // copies of super-block i into stage buffer b
  auto stage = [&](int64_t i, int b) {
    uint8_t* sw = smem + b * SB;
    uint8_t* sx = sw + kGemmRows * RS;
    float* sd = reinterpret_cast<float*>(sx + kGemmToks * kGemmActStride);
    for (int c = tid; c < kGemmRows * CH; c += kGemmWarps * 32) {
      const int r = c / CH, k = c % CH;
      const uint8_t* src = block_at(r, i) - block_off(r, i) + 16 * k;
      // Q6_K's last chunk may reach past the block: never past the weight's end
      cp_async16_zfill(sw + r * RS + 16 * k, src, (int)min((int64_t)16, (int64_t)(w_end - src)));
    }
    for (int c = tid; c < kGemmToks * (kQK / 16); c += kGemmWarps * 32) {
      const int t = c / (kQK / 16), k = c % (kQK / 16);
      cp_async16(sx + t * kGemmActStride + 16 * k, xq + (int64_t)min(tok0 + t, n - 1) * cols + i * kQK + 16 * k);
    }
    if (tid < kGemmToks) cp_async4(sd + tid, xd + (int64_t)min(tok0 + tid, n - 1) * nb + i);
    cp_async_commit();
  };

  // acc[0] / accm[0]: the m-tile being worked on; the loop over m-tiles swaps the two at its end, so it
  // need not be unrolled (an unrolled pair would keep both tiles' operands in registers: a spill)
  float acc[2][4][4], accm[2][4][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = accm[mt][nt][e] = 0.f;

  stage(0, 0);
  for (int64_t i = 0; i < nb; ++i) {
    const int b = (int)(i & 1);
    cp_async_wait_all();
    __syncthreads();  // stage b has landed for every thread, and every warp is done with stage b ^ 1
    if (i + 1 < nb) stage(i + 1, b ^ 1);
    const uint8_t* sw = smem + b * SB;
    const uint8_t* sx = sw + kGemmRows * RS;
    const float* sd = reinterpret_cast<const float*>(sx + kGemmToks * kGemmActStride);
#pragma unroll 1
    for (int mt = 0; mt < 2; ++mt) {
      const int ra = 32 * wr + 16 * mt + g, rb = ra + 8;
      StreamBlock<T, FromShared> blk;
      blk.fetch(sw + ra * RS + block_off(ra, i), sw + rb * RS + block_off(rb, i), t4);
      int isum[4][4], msum[4][4];
      superblock_sums<T, 4>(blk, t4, 4, [&](int j, int nt) {
        return FromShared::ld8(sx + (32 * wt + 8 * nt + g) * kGemmActStride + 32 * j + 8 * t4);
      }, isum, msum);
      const float da = blk.d(0), db = blk.d(1), dma = blk.dm(0), dmb = blk.dm(1);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int tc = 32 * wt + 8 * nt + 2 * t4;
        tile_float_steps<T>(acc[0][nt], accm[0][nt], isum[nt], msum[nt], da, db, dma, dmb, sd[tc], sd[tc + 1]);
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float t = acc[0][nt][e], tm = accm[0][nt][e];
          acc[0][nt][e] = acc[1][nt][e], accm[0][nt][e] = accm[1][nt][e];
          acc[1][nt][e] = t, accm[1][nt][e] = tm;
        }
    }
  }
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t r = row0 + 32 * wr + 16 * mt + g + (e < 2 ? 0 : 8);
        const int t = tok0 + 32 * wt + 8 * nt + 2 * t4 + (e & 1);
        if (r < rows && t < n) y[(int64_t)t * rows + r] = __fsub_rn(acc[mt][nt][e], accm[mt][nt][e]);
      }
}

std::atomic<int> g_matvec_rows_pin{0};

// Rows a matvec CTA takes: the most (16: no shared memory, no barrier) that still gives the device
// about 1024 CTAs (8 a SM on an H100), but never more slots than the row has super-blocks.  Speed
// only: every choice gives the same bits (set_matvec_rows pins it for tests and the GPU bench).
int matvec_rows_per_cta(int64_t rows, int64_t nb) {
  if (const int pin = g_matvec_rows_pin.load(std::memory_order_relaxed); pin > 0) return pin;  // -1: auto
  constexpr int64_t kWantCtas = 1024;
  int R = 16;
  while (R > 1 && (rows + R - 1) / R < kWantCtas) R /= 2;
  while (R < 16 && kLaneGroups / R > nb) R *= 2;
  return R;
}

template <DType T, int NT, int R>
void launch_splitk(const uint8_t* w, int64_t rows, int64_t cols, int64_t row_bytes, const int8_t* xq,
                   const float* xd, const int16_t* xbsum, int n, float* y, cudaStream_t stream) {
  launch(kquant_splitk_kernel<T, NT, R>, dim3((unsigned)((rows + R - 1) / R)), dim3(32 * kWarpsPerCta), 0, stream, w,
         rows, cols, row_bytes, xq, xd, xbsum, n, y);
}

template <DType T, int NT>
void launch_dp4a(const uint8_t* w, int64_t rows, int64_t cols, int64_t row_bytes, const int8_t* xq, const float* xd,
                 const int16_t* xbsum, int n, float* y, cudaStream_t stream) {
  const int64_t per_cta = (int64_t)kWarpsPerCta * kRowsPerDp4aWarp;
  launch(kquant_dp4a_kernel<T, NT>, dim3((unsigned)((rows + per_cta - 1) / per_cta)), dim3(32 * kWarpsPerCta), 0,
         stream, w, rows, cols, row_bytes, xq, xd, xbsum, n, y);
}

std::atomic<int> g_mma_split_pin{0};
constexpr int kStreamMaxTokens = 64;  // more (prefill chunks): kquant_gemm_kernel
constexpr int kPinTiled = -2;        // set_mma_split: every verify and prefill chunk on the tiled kernel

// DFLASH27B_CUDA_MMA: the tensor-core kernel for verifies and prefill chunks, as set_mma_split pins it:
// auto (the default), w1 / w2 / w4 (the streaming kernel with that K split), sync (the round-synchronous
// kernel) or tiled.  Read at the first K-quant matmul, so a GPU run can set aside a kernel the device
// disagrees with, without a rebuild; an unknown value fails the K-quant matmuls with the choices.  A pin
// set before the environment was read (set_mma_split) takes its place.
std::once_flag g_mma_env_read;
void mma_pin_from_env() {
  std::call_once(g_mma_env_read, [] {
    const char* v = std::getenv("DFLASH27B_CUDA_MMA");
    if (!v || !*v || !std::strcmp(v, "auto")) return;
    static const std::pair<const char*, int> kNames[] = {{"w1", 1}, {"w2", 2}, {"w4", 4}, {"sync", -1},
                                                         {"tiled", kPinTiled}};
    for (const auto& [name, pin] : kNames)
      if (!std::strcmp(v, name)) return g_mma_split_pin.store(pin);
    fail("DFLASH27B_CUDA_MMA=%s: use auto, w1, w2, w4, sync or tiled", v);  // (read again at the next matmul)
  });
}

// Warps that split a row group's K in the streaming kernel: the fewest (1: no barrier) that give the
// device about 1024 warps, at most 4 and never more than the row's super-blocks.  Speed only: every
// choice gives the same bits (set_mma_split pins it for tests and the GPU bench).
int stream_split(int64_t rows, int64_t nb) {
  if (const int pin = g_mma_split_pin.load(std::memory_order_relaxed); pin > 0) return pin;
  constexpr int64_t kWantWarps = 1024;
  const int64_t groups = (rows + 15) / 16;
  int W = 1;
  while (W < 4 && groups * W < kWantWarps && 2 * W <= nb) W *= 2;
  return W;
}

template <DType T, int kTiles, int W>
void launch_stream_w(const uint8_t* w, int64_t rows, int64_t cols, int64_t row_bytes, const int8_t* xq,
                     const float* xd, int n, float* y, cudaStream_t stream) {
  constexpr int64_t rows_per_cta = 16 * (kWarpsPerCta / W);
  const int64_t row_ctas = (rows + rows_per_cta - 1) / rows_per_cta;
  if (row_ctas > 65535) fail("matmul_exact: %lld rows are more than the streaming kernel's grid holds", (long long)rows);
  // tokens on the grid's fast axis: the CTAs of one row group run together and share its weights in L2
  launch(kquant_mma_stream_kernel<T, kTiles, W>, dim3((unsigned)((n + 8 * kTiles - 1) / (8 * kTiles)),
                                                       (unsigned)row_ctas),
         dim3(32 * kWarpsPerCta), 0, stream, w, rows, cols, row_bytes, xq, xd, n, y);
}

template <DType T, int kTiles>
void launch_stream_t(int W, const uint8_t* w, int64_t rows, int64_t cols, int64_t row_bytes, const int8_t* xq,
                     const float* xd, int n, float* y, cudaStream_t stream) {
  if (W == 1) return launch_stream_w<T, kTiles, 1>(w, rows, cols, row_bytes, xq, xd, n, y, stream);
  if (W == 2) return launch_stream_w<T, kTiles, 2>(w, rows, cols, row_bytes, xq, xd, n, y, stream);
  launch_stream_w<T, kTiles, 4>(w, rows, cols, row_bytes, xq, xd, n, y, stream);
}

template <DType T>
void launch_stream(const uint8_t* w, int64_t rows, int64_t cols, int64_t row_bytes, const int8_t* xq,
                   const float* xd, int n, float* y, cudaStream_t stream) {
  const int W = stream_split(rows, cols / kQK);
  if (n <= 16) return launch_stream_t<T, 2>(W, w, rows, cols, row_bytes, xq, xd, n, y, stream);
  launch_stream_t<T, kStreamMaxTiles>(W, w, rows, cols, row_bytes, xq, xd, n, y, stream);
}

template <DType T>
void launch_gemm(const uint8_t* w, int64_t rows, int64_t cols, int64_t row_bytes, const int8_t* xq, const float* xd,
                 int n, float* y, cudaStream_t stream) {
  static std::once_flag smem_opt_in;  // over the default 48 KiB of dynamic shared memory: once per kernel
  std::call_once(smem_opt_in, [] {
    CUDA_CHECK(cudaFuncSetAttribute(kquant_gemm_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)kGemmSmemBytes<T>));
  });
  const int64_t row_ctas = (rows + kGemmRows - 1) / kGemmRows;
  if (row_ctas > 65535) fail("matmul_exact: %lld rows are more than the tiled kernel's grid holds", (long long)rows);
  // tokens on the grid's fast axis: the CTAs of one row block run together and share its weights in L2
  launch(kquant_gemm_kernel<T>, dim3((unsigned)((n + kGemmToks - 1) / kGemmToks), (unsigned)row_ctas),
         dim3(32 * kGemmWarps), kGemmSmemBytes<T>, stream, w, rows, cols, row_bytes, xq, xd, n, y);
}

// Weights with fewer rows than this take the matvec for verifies of up to kFewRowsMaxTokens tokens.
constexpr int64_t kFewRows = 2048;
constexpr int kFewRowsMaxTokens = 64;

// The K-quant matvec for R rows a CTA: 16 is the dp4a kernel (a group of 8 lanes walks a whole row),
// fewer the split-K kernel.  Every R gives the same bits.
template <DType T, int NT>
void launch_matvec(int R, const uint8_t* w, int64_t rows, int64_t cols, int64_t row_bytes, const int8_t* xq,
                   const float* xd, const int16_t* xbsum, int n, float* y, cudaStream_t stream) {
  switch (R) {
    case 1: return launch_splitk<T, NT, 1>(w, rows, cols, row_bytes, xq, xd, xbsum, n, y, stream);
    case 2: return launch_splitk<T, NT, 2>(w, rows, cols, row_bytes, xq, xd, xbsum, n, y, stream);
    case 4: return launch_splitk<T, NT, 4>(w, rows, cols, row_bytes, xq, xd, xbsum, n, y, stream);
    case 8: return launch_splitk<T, NT, 8>(w, rows, cols, row_bytes, xq, xd, xbsum, n, y, stream);
    default: return launch_dp4a<T, NT>(w, rows, cols, row_bytes, xq, xd, xbsum, n, y, stream);
  }
}

template <DType T>
void launch_exact(const uint8_t* w, int64_t rows, int64_t cols, const int8_t* xq, const float* xd,
                  const int16_t* xbsum, int n, float* y, cudaStream_t stream) {
  mma_pin_from_env();
  const int64_t row_bytes = cols / kQK * kBlockBytes<T>;
  if (n <= kDp4aMaxTokens) {
    const int R = matvec_rows_per_cta(rows, cols / kQK);
    if (n == 1) return launch_matvec<T, 1>(R, w, rows, cols, row_bytes, xq, xd, xbsum, n, y, stream);
    if (n == 2) return launch_matvec<T, 2>(R, w, rows, cols, row_bytes, xq, xd, xbsum, n, y, stream);
    if (n <= 4) return launch_matvec<T, 4>(R, w, rows, cols, row_bytes, xq, xd, xbsum, n, y, stream);
    return launch_matvec<T, 8>(R, w, rows, cols, row_bytes, xq, xd, xbsum, n, y, stream);
  }
  if (rows < kFewRows && n <= kFewRowsMaxTokens && g_matvec_rows_pin.load(std::memory_order_relaxed) >= 0) {
    // Few rows (a delta-net layer's 48-row projections, 1024-row K / V): the tensor-core kernel would
    // have rows / 16 CTAs (3 for 48 rows), so the matvec takes the tokens 8 at a time instead; the
    // weights stay in L2 between the passes, and every kernel gives a token the same bits.
    const int R = matvec_rows_per_cta(rows, cols / kQK);
    const int64_t nb = cols / kQK;
    for (int t0 = 0; t0 < n; t0 += kDp4aMaxTokens) {
      const int g = min(kDp4aMaxTokens, n - t0);
      const int8_t* gq = xq + (int64_t)t0 * cols;
      const float* gd = xd + (int64_t)t0 * nb;
      const int16_t* gs = xbsum + (int64_t)t0 * (cols / 16);
      float* gy = y + (int64_t)t0 * rows;
      if (g <= 4) launch_matvec<T, 4>(R, w, rows, cols, row_bytes, gq, gd, gs, g, gy, stream);
      else launch_matvec<T, 8>(R, w, rows, cols, row_bytes, gq, gd, gs, g, gy, stream);
    }
    return;
  }
  // 9..64 tokens: the streaming kernel; prefill chunks: the tiled kernel.  A pin (the GPU bench's
  // comparisons) takes every verify and prefill chunk to its kernel: a split to the streaming kernel, -2 to
  // the tiled one, -1 to the round-synchronous kernel below.
  const int split = g_mma_split_pin.load(std::memory_order_relaxed);
  if ((n <= kStreamMaxTokens && split == 0) || split > 0)
    return launch_stream<T>(w, rows, cols, row_bytes, xq, xd, n, y, stream);
  if (split == 0 || split == kPinTiled) return launch_gemm<T>(w, rows, cols, row_bytes, xq, xd, n, y, stream);
  // the tiles per warp fit the batch (registers grow with them): 9..16 tokens 2, ..32 4, more 8
  const int tiles = n <= 16 ? 2 : n <= 32 ? 4 : kMaxTokTiles;
  const dim3 grid((unsigned)((rows + 15) / 16), (unsigned)((n + 8 * tiles - 1) / (8 * tiles)));
  const dim3 block(32 * kWarpsPerCta);
  if (tiles == 2) return launch(kquant_mma_kernel<T, 2>, grid, block, 0, stream, w, rows, cols, row_bytes, xq, xd, n, y);
  if (tiles == 4) return launch(kquant_mma_kernel<T, 4>, grid, block, 0, stream, w, rows, cols, row_bytes, xq, xd, n, y);
  launch(kquant_mma_kernel<T, kMaxTokTiles>, grid, block, 0, stream, w, rows, cols, row_bytes, xq, xd, n, y);
}

// ---------------------------------------------------------------- Q8_0 / Q4_0
// The CPU's arithmetic (csrc/quant/dot_cpu.cpp, dot_row_q_reference):
// activations in 32-value blocks (scale amax / 127, q = rint(x / scale), and
// the integer sum of q per block); per output, block i's exact integer sum
//   isum_i = sum_j wq_ij * xq_ij          (Q4_0: sum_j nibble_ij * xq_ij - 8 * sum_j xq_ij)
// goes into chain i % 8:
//   lane_(i%8) = fma(dw_i * xd_i, float(isum_i), lane_(i%8)),   blocks in k order
//   out = ((lane_0 + lane_4) + (lane_2 + lane_6)) + ((lane_1 + lane_5) + (lane_3 + lane_7)).
// Every form computes whole block sums, so the float steps are the same for
// every batch and kernel: AR, verify and prefill agree bit for bit, and with
// the CPU backend (AVX2 and scalar builds alike).  Two kernels:
//   n <= 8: block32_dp4a_kernel, a matvec: a group of 8 lanes owns a row and
//           lane l the blocks of chain l (8 dp4a a block); the chains meet in
//           an xor butterfly (4, 2, 1), whose additions are sum_chains';
//   n > 8:  block32_mma_kernel, 8 warps a CTA, warp w the blocks of chain w
//           for 16 rows x up to 64 tokens (a block is one m16n8k32 per 8
//           tokens, the chain's next block loaded during its math); the
//           chains meet in shared memory.  A verify of up to 64 tokens reads
//           each weight once.

// The CPU's quantize_act_row with 32-value blocks: one warp per (token, block).
__global__ void quantize_act32_kernel(const float* __restrict__ x, int64_t cols, int n, int8_t* __restrict__ q,
                                      float* __restrict__ d, int32_t* __restrict__ sum_q) {
  const int lane = threadIdx.x & 31;
  const int64_t nb = cols / 32;
  const int64_t item = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (item >= (int64_t)n * nb) return;  // whole warps only
  const int64_t tok = item / nb, b = item % nb;
  const float v = x[tok * cols + b * 32 + lane];
  float amax = fabsf(v);
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float dv = __fdiv_rn(amax, 127.f);
  const float id = dv > 0.f ? __fdiv_rn(1.f, dv) : 0.f;
  const int qi = (int)rintf(__fmul_rn(v, id));
  q[tok * cols + b * 32 + lane] = (int8_t)qi;
  int sum = qi;
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (lane == 0) {
    d[tok * nb + b] = dv;
    sum_q[tok * nb + b] = sum;
  }
}

template <DType T>
constexpr int kBlock32Bytes = T == DType::Q8_0 ? (int)sizeof(block_q8_0) : (int)sizeof(block_q4_0);

// A block's 32 quants as 8 words of 4 int8 (word k = values 4k..4k+3; Q4_0 the
// nibbles 0..15).  Blocks are 34 or 18 bytes, so quants are 2-byte aligned.
template <DType T>
__device__ __forceinline__ void block32_quants(const uint8_t* blk, uint32_t (&q)[8]) {
  if constexpr (T == DType::Q8_0) {
    const uint4 lo = ld16_u(blk + kQ8_0_qs), hi = ld16_u(blk + kQ8_0_qs + 16);
    q[0] = lo.x, q[1] = lo.y, q[2] = lo.z, q[3] = lo.w, q[4] = hi.x, q[5] = hi.y, q[6] = hi.z, q[7] = hi.w;
  } else {  // value j is the low nibble of qs[j], value 16 + j its high nibble
    const uint4 v = ld16_u(blk + kQ4_0_qs);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      q[k] = u4_word(v, k) & 0x0f0f0f0fu;
      q[k + 4] = (u4_word(v, k) >> 4) & 0x0f0f0f0fu;
    }
  }
}

// Quants 4c..4c+3 of a block (c = 0..7) as 4 int8, for a tensor-core fragment.
template <DType T>
__device__ __forceinline__ uint32_t block32_quants4(const uint8_t* blk, int c) {
  if constexpr (T == DType::Q8_0) {
    const uint8_t* p = blk + kQ8_0_qs + 4 * c;
    return ld_u16(p) | ld_u16(p + 2) << 16;
  } else {
    const uint8_t* p = blk + kQ4_0_qs + 4 * (c & 3);
    return ((ld_u16(p) | ld_u16(p + 2) << 16) >> (4 * (c >> 2))) & 0x0f0f0f0fu;
  }
}

// Block i's integer sum from the instruction's sum of quants x activations.
template <DType T>
__device__ __forceinline__ int block32_isum(int dot, const int32_t* xsum, int64_t tok, int64_t nb, int64_t i) {
  if constexpr (T == DType::Q4_0) return dot - 8 * xsum[tok * nb + i];
  return dot;
}

template <DType T, int NT>
__global__ void __launch_bounds__(kWarpsPerCta * 32)
    block32_dp4a_kernel(const uint8_t* __restrict__ w, int64_t rows, int64_t cols, int64_t row_bytes,
                        const int8_t* __restrict__ xq, const float* __restrict__ xd, const int32_t* __restrict__ xsum,
                        int n, float* __restrict__ y) {
  DFL_LAUNCH_BOUND(kWarpsPerCta * 32);
  constexpr int BS = kBlock32Bytes<T>;
  const int lane = threadIdx.x & 31, l = lane & 7;
  const int64_t r = ((int64_t)blockIdx.x * kWarpsPerCta + (threadIdx.x >> 5)) * kRowsPerDp4aWarp + (lane >> 3);
  const uint8_t* row = w + min(r, rows - 1) * row_bytes;  // past the end: read the last row, write nothing
  const int64_t nb = cols / 32;
  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.f;
  for (int64_t i = l; i < nb; i += 8) {  // chain l: blocks l, l + 8, ...
    const uint8_t* blk = row + i * BS;
    uint32_t q[8];
    block32_quants<T>(blk, q);
    const float dw = ld_f16(blk);  // d leads both blocks
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const int64_t tok = min(t, n - 1);
      const uint8_t* xp = reinterpret_cast<const uint8_t*>(xq + tok * cols + 32 * i);  // 16-byte aligned
      const uint4 x0 = ld16(xp), x1 = ld16(xp + 16);
      int dot = 0;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        dot = __dp4a((int)q[k], (int)u4_word(x0, k), dot);
        dot = __dp4a((int)q[k + 4], (int)u4_word(x1, k), dot);
      }
      const int isum = block32_isum<T>(dot, xsum, tok, nb, i);
      acc[t] = fmaf(__fmul_rn(dw, xd[tok * nb + i]), (float)isum, acc[t]);
    }
  }
#pragma unroll
  for (int t = 0; t < NT; ++t) {  // ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) in lane 0
    float v = acc[t];
    v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 4));
    v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 2));
    v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 1));
    if (l == 0 && r < rows && t < n) y[(int64_t)t * rows + r] = v;
  }
}

constexpr int kBlock32MmaWarps = 8;  // one per chain

template <DType T, int kTokTiles>
__global__ void __launch_bounds__(kBlock32MmaWarps * 32)
    block32_mma_kernel(const uint8_t* __restrict__ w, int64_t rows, int64_t cols, int64_t row_bytes,
                       const int8_t* __restrict__ xq, const float* __restrict__ xd, const int32_t* __restrict__ xsum,
                       int n, float* __restrict__ y) {
  DFL_LAUNCH_BOUND(kBlock32MmaWarps * 32);
  constexpr int BS = kBlock32Bytes<T>;
  DFL_STATIC_SMEM(float, chain, [kBlock32MmaWarps][kTokTiles][4][32]);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const int64_t m0 = (int64_t)blockIdx.x * 16;
  const int tok0 = blockIdx.y * 8 * kTokTiles;
  const int tiles = min(kTokTiles, (n - tok0 + 7) / 8);
  const int64_t nb = cols / 32;
  // rows and tokens past the end are read (as the last one), never written
  const uint8_t* row_a = w + min(m0 + g, rows - 1) * row_bytes;
  const uint8_t* row_b = w + min(m0 + g + 8, rows - 1) * row_bytes;
  float acc[kTokTiles][4];
#pragma unroll
  for (int tt = 0; tt < kTokTiles; ++tt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[tt][e] = 0.f;
  // A fragment: rows g / g + 8, values 4 t4.. and 16 + 4 t4.. of a block, and the rows' scales; the next
  // block's loads are issued before this one's math (past the end: the last block again, unused)
  auto fetch = [&](int64_t i, uint32_t (&a)[4], float (&dw)[2]) {
    const uint8_t* blk_a = row_a + i * BS;
    const uint8_t* blk_b = row_b + i * BS;
    a[0] = block32_quants4<T>(blk_a, t4), a[1] = block32_quants4<T>(blk_b, t4);
    a[2] = block32_quants4<T>(blk_a, 4 + t4), a[3] = block32_quants4<T>(blk_b, 4 + t4);
    dw[0] = ld_f16(blk_a), dw[1] = ld_f16(blk_b);
  };
  uint32_t a[4];
  float dw[2];
  fetch(min((int64_t)warp, nb - 1), a, dw);
  for (int64_t i = warp; i < nb; i += kBlock32MmaWarps) {  // chain `warp`: blocks warp, warp + 8, ...
    uint32_t an[4];
    float dwn[2];
    fetch(min(i + kBlock32MmaWarps, nb - 1), an, dwn);
    const int32_t zero[4] = {0, 0, 0, 0};
#pragma unroll
    for (int tt = 0; tt < kTokTiles; ++tt) {
      if (tt >= tiles) break;
      const int64_t tb = min(tok0 + 8 * tt + g, n - 1);  // the B fragment's token
      const int8_t* xp = xq + tb * cols + 32 * i + 4 * t4;
      const uint32_t b[2] = {ld_u32_act(xp), ld_u32_act(xp + 16)};
      int32_t c[4];
      mma_m16n8k32_s8(c, a, b, zero);
#pragma unroll
      for (int e = 0; e < 4; ++e) {  // C: rows g (e < 2) / g + 8, tokens 2 t4 + (e & 1)
        const int64_t tok = min(tok0 + 8 * tt + 2 * t4 + (e & 1), n - 1);
        const int isum = block32_isum<T>(c[e], xsum, tok, nb, i);
        acc[tt][e] = fmaf(__fmul_rn(dw[e >> 1], xd[tok * nb + i]), (float)isum, acc[tt][e]);
      }
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) a[k] = an[k];
    dw[0] = dwn[0], dw[1] = dwn[1];
  }
#pragma unroll
  for (int tt = 0; tt < kTokTiles; ++tt)
#pragma unroll
    for (int e = 0; e < 4; ++e) chain[warp][tt][e][lane] = acc[tt][e];
  __syncthreads();
  // the chains' sum, ((c0 + c4) + (c2 + c6)) + ((c1 + c5) + (c3 + c7)), one output a thread
  for (int o = threadIdx.x; o < kTokTiles * 4 * 32; o += kBlock32MmaWarps * 32) {
    const int tt = o / 128, e = (o / 32) & 3, ln = o & 31;
    if (tt >= tiles) continue;
    const int64_t r = m0 + (ln >> 2) + (e < 2 ? 0 : 8);
    const int t = tok0 + 8 * tt + 2 * (ln & 3) + (e & 1);
    if (r >= rows || t >= n) continue;
    const float s04 = __fadd_rn(chain[0][tt][e][ln], chain[4][tt][e][ln]);
    const float s26 = __fadd_rn(chain[2][tt][e][ln], chain[6][tt][e][ln]);
    const float s15 = __fadd_rn(chain[1][tt][e][ln], chain[5][tt][e][ln]);
    const float s37 = __fadd_rn(chain[3][tt][e][ln], chain[7][tt][e][ln]);
    y[(int64_t)t * rows + r] = __fadd_rn(__fadd_rn(s04, s26), __fadd_rn(s15, s37));
  }
}

template <DType T, int NT>
void launch_block32_dp4a(const uint8_t* w, int64_t rows, int64_t cols, int64_t row_bytes, const int8_t* xq,
                         const float* xd, const int32_t* xsum, int n, float* y, cudaStream_t stream) {
  const int64_t per_cta = (int64_t)kWarpsPerCta * kRowsPerDp4aWarp;
  launch(block32_dp4a_kernel<T, NT>, dim3((unsigned)((rows + per_cta - 1) / per_cta)), dim3(32 * kWarpsPerCta), 0,
         stream, w, rows, cols, row_bytes, xq, xd, xsum, n, y);
}

template <DType T, int kTokTiles>
void launch_block32_mma(const uint8_t* w, int64_t rows, int64_t cols, int64_t row_bytes, const int8_t* xq,
                        const float* xd, const int32_t* xsum, int n, float* y, cudaStream_t stream) {
  launch(block32_mma_kernel<T, kTokTiles>,
         dim3((unsigned)((rows + 15) / 16), (unsigned)((n + 8 * kTokTiles - 1) / (8 * kTokTiles))),
         dim3(32 * kBlock32MmaWarps), 0, stream, w, rows, cols, row_bytes, xq, xd, xsum, n, y);
}

template <DType T>
void launch_block32(const uint8_t* w, int64_t rows, int64_t cols, const int8_t* xq, const float* xd,
                    const int32_t* xsum, int n, float* y, cudaStream_t stream) {
  const int64_t row_bytes = cols / 32 * kBlock32Bytes<T>;
  // tokens per thread / tiles per warp fit the batch (registers grow with them)
  if (n == 1) return launch_block32_dp4a<T, 1>(w, rows, cols, row_bytes, xq, xd, xsum, n, y, stream);
  if (n == 2) return launch_block32_dp4a<T, 2>(w, rows, cols, row_bytes, xq, xd, xsum, n, y, stream);
  if (n <= 4) return launch_block32_dp4a<T, 4>(w, rows, cols, row_bytes, xq, xd, xsum, n, y, stream);
  if (n <= kDp4aMaxTokens) return launch_block32_dp4a<T, 8>(w, rows, cols, row_bytes, xq, xd, xsum, n, y, stream);
  if (n <= 16) return launch_block32_mma<T, 2>(w, rows, cols, row_bytes, xq, xd, xsum, n, y, stream);
  if (n <= 32) return launch_block32_mma<T, 4>(w, rows, cols, row_bytes, xq, xd, xsum, n, y, stream);
  launch_block32_mma<T, kMaxTokTiles>(w, rows, cols, row_bytes, xq, xd, xsum, n, y, stream);
}

}  // namespace

bool matmul_exact_supported(DType t) {
  return t == DType::Q4_K || t == DType::Q5_K || t == DType::Q6_K || t == DType::Q8_0 || t == DType::Q4_0 ||
         t == DType::F16 || t == DType::BF16;
}

size_t matmul_exact_scratch_bytes(int64_t cols, int n) { return exact_act_bytes(cols, n); }

ExactAct matmul_exact_act(DType t) {
  if (t == DType::F16 || t == DType::BF16) return ExactAct::none;
  if (t == DType::Q8_0 || t == DType::Q4_0) return ExactAct::blocks32;
  if (t == DType::Q4_K || t == DType::Q5_K || t == DType::Q6_K) return ExactAct::blocks256;
  fail("matmul_exact: %s is not a K-quant, Q8_0, Q4_0, F16 or BF16 weight", type_traits((uint32_t)t)->name);
}

namespace {
void check_exact_args(ExactAct a, int64_t cols, int n) {
  const int64_t block = a == ExactAct::blocks256 ? kQK : 32;
  if (n <= 0 || cols <= 0 || cols % block)
    fail("matmul_exact: cols %lld (a multiple of %lld) and n %d must be positive", (long long)cols, (long long)block,
         n);
}
}  // namespace

void matmul_exact_quantize(ExactAct a, const float* x, int64_t cols, int n, void* scratch, cudaStream_t stream) {
  if (a == ExactAct::none) return;
  check_exact_args(a, cols, n);
  const bool kquant = a == ExactAct::blocks256;
  char* base = static_cast<char*>(scratch);
  const ExactActLayout lay(cols, n, kquant);
  int8_t* xq = reinterpret_cast<int8_t*>(base + lay.q);
  float* xd = reinterpret_cast<float*>(base + lay.d);
  const int64_t items = (int64_t)n * (cols / (kquant ? kQK : 32));  // a warp each
  // quantize_act_kernel's vector loads and stores (the forward's buffers and the scratch layout keep them so)
  if (kquant && ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(xq)) & 15u))
    fail("matmul_exact: activations and their scratch must be 16-byte aligned");
  if (kquant)
    launch(quantize_act_kernel, dim3((unsigned)((items + 7) / 8)), dim3(256), 0, stream, x, cols, n, xq, xd,
           reinterpret_cast<int16_t*>(base + lay.sums));
  else
    launch(quantize_act32_kernel, dim3((unsigned)((items + 7) / 8)), dim3(256), 0, stream, x, cols, n, xq, xd,
           reinterpret_cast<int32_t*>(base + lay.sums));
}

void matmul_exact_quantized(DType t, const void* w, int64_t rows, int64_t cols, const float* x, int n, float* y,
                            const void* scratch, cudaStream_t stream) {
  const ExactAct a = matmul_exact_act(t);
  if (a == ExactAct::none) return matmul_half(t, w, rows, cols, x, n, y, stream);
  check_exact_args(a, cols, n);
  if (rows <= 0) fail("matmul_exact: rows %lld must be positive", (long long)rows);
  const auto* wb = static_cast<const uint8_t*>(w);
  const char* base = static_cast<const char*>(scratch);
  const ExactActLayout lay(cols, n, a == ExactAct::blocks256);
  const int8_t* xq = reinterpret_cast<const int8_t*>(base + lay.q);
  const float* xd = reinterpret_cast<const float*>(base + lay.d);
  if (a == ExactAct::blocks32) {
    const int32_t* xsum = reinterpret_cast<const int32_t*>(base + lay.sums);
    if (t == DType::Q8_0) return launch_block32<DType::Q8_0>(wb, rows, cols, xq, xd, xsum, n, y, stream);
    return launch_block32<DType::Q4_0>(wb, rows, cols, xq, xd, xsum, n, y, stream);
  }
  const int16_t* xbsum = reinterpret_cast<const int16_t*>(base + lay.sums);
  switch (t) {
    case DType::Q4_K: return launch_exact<DType::Q4_K>(wb, rows, cols, xq, xd, xbsum, n, y, stream);
    case DType::Q5_K: return launch_exact<DType::Q5_K>(wb, rows, cols, xq, xd, xbsum, n, y, stream);
    default: return launch_exact<DType::Q6_K>(wb, rows, cols, xq, xd, xbsum, n, y, stream);
  }
}

void set_matvec_rows(int rows_per_cta) {
  if (rows_per_cta != -1 && rows_per_cta != 0 && rows_per_cta != 1 && rows_per_cta != 2 && rows_per_cta != 4 &&
      rows_per_cta != 8 && rows_per_cta != 16)
    fail("matvec rows per CTA %d: use 1, 2, 4, 8 or 16, or 0 for the automatic choice (-1: automatic, and "
         "verifies of few-row weights on the tensor cores)", rows_per_cta);
  g_matvec_rows_pin.store(rows_per_cta);
}

void set_mma_split(int warps) {
  std::call_once(g_mma_env_read, [] {});  // the pin takes the environment's place
  if (warps != kPinTiled && warps != -1 && warps != 0 && warps != 1 && warps != 2 && warps != 4)
    fail("tensor-core K split %d: use 1, 2 or 4 warps a row group, 0 for the automatic choice, -1 for the "
         "round-synchronous kernel or -2 for the tiled one", warps);
  g_mma_split_pin.store(warps);
}

void matmul_exact(DType t, const void* w, int64_t rows, int64_t cols, const float* x, int n, float* y,
                  void* scratch, cudaStream_t stream) {
  matmul_exact_quantize(matmul_exact_act(t), x, cols, n, scratch, stream);
  matmul_exact_quantized(t, w, rows, cols, x, n, y, scratch, stream);
}

}  // namespace cuda
}  // namespace dfl
