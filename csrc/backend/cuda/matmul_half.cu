// matmul_half.cu — F16 / BF16 weights times f32 activations on the tf32 tensor
// cores (mma.m16n8k8, mma.cuh), one kernel for every batch size.
//
// Exactness (the batch-invariance contract): an output element's value is a
// fixed sequence of instructions over K that depends on nothing but its row of
// W and its token's x, so an AR step (n = 1, the tile padded), a verify of any
// tree and a prefill chunk of any length give the same bits per token:
//   * a CTA owns 16 rows; its 8 warps split K by 32-column groups, warp w
//     taking groups w, w + 8, w + 16, ... (fixed by the shape alone);
//   * within a group, lane (g, t) = (lane / 4, lane % 4) holds 8 consecutive
//     columns 8t .. 8t+7 of rows g and g + 8 (one 16-byte load each) and of
//     its tile's token g (two float4); instruction j = 0..3 of the group puts
//     columns 8t + 2j and 8t + 2j + 1 in k slots t and t + 4 of A and B alike
//     (a fixed permutation of K inside the group, so the loads stay whole);
//   * x is split into tf32 hi + lo (hi = x rounded to tf32, lo = the rest
//     rounded to tf32: 22 significant bits of x), weights are exact in tf32
//     (BF16: 8 bits, F16: 11), and each instruction j runs hi then lo into the
//     group's accumulator, which starts at 0; the group's sum is then added to
//     the warp's running sum by an f32 add (round to nearest).  The tensor
//     cores' accumulation is not IEEE (it truncates, per published
//     measurements), so a running sum kept inside the instruction for all of K
//     would drift one way: with the instruction modelled as an exact sum
//     truncated to f32, a 4384-column dot product came out 4.4e-6 (of the
//     largest output) off the CPU's that way, 4.9e-7 with the group sums;
//   * the 8 warps' partial sums meet in shared memory and add in warp order,
//     (((w0 + w1) + w2) + ...) + w7.
// Token tiles of 8 (1 to 8 of them per CTA) only decide how many tokens share
// a weight load, never the order of an element's sum.  Versus the CPU's f32
// dot products the difference is f32-rounding sized (x to 22 bits, the
// hardware's summation); the CPU emulator models the instruction in f32 (see
// mma.cuh), so there the same contract holds bit for bit and the tolerance vs
// the CPU is tested.  F32 weights keep the float kernels (matmul.cu).
//
// Speed is still to be measured on the first GPU (issue 19): n = 1 streams the
// weights with the next two groups' loads in flight; larger batches read the
// weights once per 64 tokens, with no shared-memory staging yet.
#include "launch.cuh"
#include "matmul_exact.cuh"
#include "mma.cuh"

namespace dfl {
namespace cuda {

namespace {

constexpr int kSplit = 8;       // warps of a CTA, each every 8th of K's groups (a 5120-row weight: 2560 warps)
constexpr int kMaxTiles = 8;    // token tiles of 8 per CTA: up to 64 tokens per weight pass
constexpr int kGroupCols = 32;  // columns per group: 4 instructions of k = 8

// Two weights of one 32-bit word (elements 2j, 2j+1 of a lane's 8) as tf32 bits, exactly.
template <bool kBF16>
__device__ __forceinline__ void half2_tf32(uint32_t w, uint32_t& lo, uint32_t& hi) {
  if constexpr (kBF16) {
    lo = w << 16;
    hi = w & 0xffff0000u;
  } else {
    lo = __float_as_uint(f16_bits_to_f32(w & 0xffffu));
    hi = __float_as_uint(f16_bits_to_f32(w >> 16));
  }
}

// x = hi + lo, both tf32 (hi + lo carries 22 of x's 24 significant bits).
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = tf32_rna_bits(__float_as_uint(x));
  lo = tf32_rna_bits(__float_as_uint(__fsub_rn(x, __uint_as_float(hi))));
}

template <bool kBF16, int kTiles>
__global__ void __launch_bounds__(kSplit * 32)
    half_mma_kernel(const uint8_t* __restrict__ w, int64_t rows, int64_t cols, const float* __restrict__ x, int n,
                    float* __restrict__ y) {
  DFL_LAUNCH_BOUND(kSplit * 32);
  DFL_STATIC_SMEM(float, part, [kSplit][kTiles][4][32]);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t m0 = (int64_t)blockIdx.x * 16;
  const int tok0 = blockIdx.y * 8 * kTiles;
  const int tiles = min(kTiles, (n - tok0 + 7) / 8);
  const int64_t row_bytes = cols * 2, groups = cols / kGroupCols;
  // rows and tokens past the end are read (as the last one), never written
  const uint8_t* wa = w + min(m0 + g, rows - 1) * row_bytes + 16 * t;
  const uint8_t* wb = w + min(m0 + g + 8, rows - 1) * row_bytes + 16 * t;
  const float* xt[kTiles];
#pragma unroll
  for (int tt = 0; tt < kTiles; ++tt) xt[tt] = x + (int64_t)min(tok0 + 8 * tt + g, n - 1) * cols + 8 * t;
  float acc[kTiles][4];
#pragma unroll
  for (int tt = 0; tt < kTiles; ++tt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[tt][e] = 0.f;

  if (warp < groups) {
    // two groups' weights in flight ahead of the math (past the end: the last group again, unused)
    auto next = [&](int64_t q) { return q + kSplit < groups ? q + kSplit : q; };
    int64_t q1 = next(warp);
    uint4 ra = ld16(wa + (int64_t)warp * 64), rb = ld16(wb + (int64_t)warp * 64);
    uint4 ra1 = ld16(wa + q1 * 64), rb1 = ld16(wb + q1 * 64);
    for (int64_t q = warp; q < groups; q += kSplit) {
      const int64_t q2 = next(q1);
      const uint4 na = ld16(wa + q2 * 64), nb = ld16(wb + q2 * 64);
      q1 = q2;
      uint32_t a[4][4];  // instruction j: {row g, row g + 8} x {slot t = col 8t + 2j, slot t + 4 = col 8t + 2j + 1}
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        half2_tf32<kBF16>(u4_word(ra, j), a[j][0], a[j][2]);
        half2_tf32<kBF16>(u4_word(rb, j), a[j][1], a[j][3]);
      }
      ra = ra1, rb = rb1, ra1 = na, rb1 = nb;
#pragma unroll
      for (int tt = 0; tt < kTiles; ++tt) {
        if (tt >= tiles) break;
        const float4 x0 = *reinterpret_cast<const float4*>(xt[tt] + q * kGroupCols);
        const float4 x1 = *reinterpret_cast<const float4*>(xt[tt] + q * kGroupCols + 4);
        const float xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
        float grp[4] = {0.f, 0.f, 0.f, 0.f};  // the group's sum, then added to acc in f32 (see top)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          uint32_t hi[2], lo[2];
          split_tf32(xv[2 * j], hi[0], lo[0]);
          split_tf32(xv[2 * j + 1], hi[1], lo[1]);
          float d[4];
          mma_m16n8k8_tf32(d, a[j], hi, grp);
          mma_m16n8k8_tf32(grp, a[j], lo, d);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[tt][e] = __fadd_rn(acc[tt][e], grp[e]);
      }
    }
  }
#pragma unroll
  for (int tt = 0; tt < kTiles; ++tt)
#pragma unroll
    for (int e = 0; e < 4; ++e) part[warp][tt][e][lane] = acc[tt][e];
  __syncthreads();
  for (int tt = warp; tt < tiles; tt += kSplit)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t r = m0 + g + (e < 2 ? 0 : 8);
      const int tok = tok0 + 8 * tt + 2 * t + (e & 1);
      float v = part[0][tt][e][lane];
#pragma unroll
      for (int w = 1; w < kSplit; ++w) v = __fadd_rn(v, part[w][tt][e][lane]);
      if (r < rows && tok < n) y[(int64_t)tok * rows + r] = v;
    }
}

template <bool kBF16, int kTiles>
void launch_half(const uint8_t* w, int64_t rows, int64_t cols, const float* x, int n, float* y, cudaStream_t s) {
  const int64_t gx = (rows + 15) / 16, gy = (n + 8 * kTiles - 1) / (8 * kTiles);
  if (gx > 0x7fffffff || gy > 65535) fail("matmul: %lld rows x %d tokens is too large", (long long)rows, n);
  launch(half_mma_kernel<kBF16, kTiles>, dim3((unsigned)gx, (unsigned)gy), dim3(kSplit * 32), 0, s, w, rows, cols, x,
         n, y);
}

template <bool kBF16>
void launch_half_n(const uint8_t* w, int64_t rows, int64_t cols, const float* x, int n, float* y, cudaStream_t s) {
  // token tiles fit the batch (registers grow with them); the per-element order is the same for all
  if (n <= 8) return launch_half<kBF16, 1>(w, rows, cols, x, n, y, s);
  if (n <= 16) return launch_half<kBF16, 2>(w, rows, cols, x, n, y, s);
  if (n <= 32) return launch_half<kBF16, 4>(w, rows, cols, x, n, y, s);
  launch_half<kBF16, kMaxTiles>(w, rows, cols, x, n, y, s);
}

}  // namespace

void matmul_half(DType t, const void* w, int64_t rows, int64_t cols, const float* x, int n, float* y,
                 cudaStream_t stream) {
  if (t != DType::F16 && t != DType::BF16) fail("matmul_half: %s is not F16 or BF16", type_traits((uint32_t)t)->name);
  if (rows <= 0 || n <= 0 || cols <= 0 || cols % kGroupCols)
    fail("matmul_half: rows %lld, cols %lld (a multiple of 32), n %d must be positive", (long long)rows,
         (long long)cols, n);
  if (reinterpret_cast<uintptr_t>(w) % 16 || reinterpret_cast<uintptr_t>(x) % 16)
    fail("matmul_half: weights and activations must be 16-byte aligned");
  const auto* wb = static_cast<const uint8_t*>(w);
  if (t == DType::BF16) return launch_half_n<true>(wb, rows, cols, x, n, y, stream);
  launch_half_n<false>(wb, rows, cols, x, n, y, stream);
}

}  // namespace cuda
}  // namespace dfl
