// matmul_kernels.cuh — the matmul kernels (launched by matmul.cu; see there).
#pragma once
#include "formats.cuh"

namespace dfl {
namespace cuda {
namespace kern {

constexpr int kWarps = 4;              // warps per matvec CTA
constexpr int kRowsPerWarp = 4;        // RW
constexpr int kChunkTokenCols = 4096;  // chunk columns x tokens (the shared-memory budget)
constexpr int kTileM = 64, kTileN = 64, kTileK = 32;

// Launch geometry, shared by matmul.cu and the CPU emulator (emu/).
template <class F>
struct Layout {
  static constexpr int S = F::P == 4 ? 4 : F::P + 4;  // floats per task in shared memory (padded)
  static constexpr int CQ = 32 * F::BE / F::TPB;        // columns per 32 tasks: the chunk quantum
  static int chunk_cols(int nt, int64_t cols) {
    int c = kChunkTokenCols / nt / CQ * CQ;
    if (c < CQ) c = CQ;
    const int64_t cols_up = (cols + CQ - 1) / CQ * CQ;
    return cols_up < c ? (int)cols_up : c;
  }
  static size_t smem_bytes(int nt, int chunk) { return (size_t)nt * (chunk / F::BE * F::TPB) * S * sizeof(float); }
};
inline int64_t matvec_ctas(int64_t rows) { return (rows + kWarps * kRowsPerWarp - 1) / (kWarps * kRowsPerWarp); }
// The matvec instantiation (tokens per pass) that serves n <= 8 tokens.
inline int matvec_nt(int n) { return n <= 1 ? 1 : n <= 2 ? 2 : n <= 4 ? 4 : 8; }

// For formats with F::kAffine (value = scale * q - min per half task, q an
// exact small integer): acc[r][t] += (task's values of row r) . (activations
// of token t) with the scales factored out of each half, acc += ds * (q . x)
// - dm * sum(x), which saves a multiply per value.  xf(t, g) gives activations
// 4g..4g+3 of token t.  Shared by both matvec kernels, so they sum in the same
// order (bit-identical results); other formats keep the plain loop inline.
template <class F, int NT, int RW, class XF>
__device__ __forceinline__ void task_dot(const typename F::Raw (&raw)[RW], XF xf, float (&acc)[RW][NT]) {
  constexpr int G = F::P / 4;
  static_assert(F::kAffine, "task_dot: factored formats only");
  {
    constexpr int GH = G / 2;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float sd[RW][NT], xsum[NT];
#pragma unroll
      for (int gg = 0; gg < GH; ++gg) {
        const int g = hf * GH + gg;
        float q[RW][4];
#pragma unroll
        for (int r = 0; r < RW; ++r) F::qf4(raw[r], g, q[r]);
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const float4 xv = xf(t, g);
          if (F::kMin) xsum[t] = gg == 0 ? (xv.x + xv.y) + (xv.z + xv.w) : xsum[t] + ((xv.x + xv.y) + (xv.z + xv.w));
#pragma unroll
          for (int r = 0; r < RW; ++r) {
            float a = gg == 0 ? q[r][0] * xv.x : fmaf(q[r][0], xv.x, sd[r][t]);
            a = fmaf(q[r][1], xv.y, a);
            a = fmaf(q[r][2], xv.z, a);
            a = fmaf(q[r][3], xv.w, a);
            sd[r][t] = a;
          }
        }
      }
#pragma unroll
      for (int r = 0; r < RW; ++r) {
        float ds, dm;
        F::half_scale(raw[r], hf, ds, dm);
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          float a = fmaf(ds, sd[r][t], acc[r][t]);
          if (F::kMin) a = fmaf(-dm, xsum[t], a);
          acc[r][t] = a;
        }
      }
    }
  }
}

// The plain loop for the other formats: dequantize 4 values, fma with the
// activations.  Shared by both matvec kernels like task_dot.
template <class F, int NT, int RW, class XF>
__device__ __forceinline__ void task_dot_plain(const typename F::Raw (&raw)[RW], XF xf, float (&acc)[RW][NT]) {
  constexpr int G = F::P / 4;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float wv[RW][4];
#pragma unroll
    for (int r = 0; r < RW; ++r) F::deq4(raw[r], g, wv[r]);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const float4 xv = xf(t, g);
#pragma unroll
      for (int r = 0; r < RW; ++r) {
        float a = acc[r][t];
        a = fmaf(wv[r][0], xv.x, a);
        a = fmaf(wv[r][1], xv.y, a);
        a = fmaf(wv[r][2], xv.z, a);
        a = fmaf(wv[r][3], xv.w, a);
        acc[r][t] = a;
      }
    }
  }
}

// Warp butterfly sum of each (row, token) accumulator, then one lane stores it.
template <int NT, int RW>
__device__ __forceinline__ void warp_reduce_store(float (&acc)[RW][NT], int lane, int n, int64_t rows, int64_t row0,
                                                  float* __restrict__ y) {
#pragma unroll
  for (int r = 0; r < RW; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      float v = acc[r][t];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      acc[r][t] = v;
    }
#pragma unroll
  for (int r = 0; r < RW; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t)
      if (lane == (r * NT + t) % 32 && t < n && row0 + r < rows) y[(int64_t)t * rows + row0 + r] = acc[r][t];
}

template <class F, int NT, int RW>
__global__ void __launch_bounds__(kWarps * 32)
    matvec_kernel(const uint8_t* __restrict__ w, int64_t rows, int64_t cols, int64_t row_bytes,
                  const float* __restrict__ x, int n, float* __restrict__ y, int chunk_cols) {
  DFL_LAUNCH_BOUND(kWarps * 32);
  DFL_DYNAMIC_SMEM(float4, smem_f4);
  float* xs = reinterpret_cast<float*>(smem_f4);
  constexpr int S = Layout<F>::S;
  constexpr int G = F::P / 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int chunk_tasks = chunk_cols / F::BE * F::TPB;
  const int64_t row_tasks = cols / F::BE * F::TPB;
  const int64_t row0 = ((int64_t)blockIdx.x * kWarps + warp) * RW;

  // Rows past the end are read (as the last row), never written.
  const uint8_t* wbase = w + (row0 < rows ? row0 : rows - 1) * row_bytes;
  const int rlast = row0 + RW <= rows ? RW - 1 : (int)(rows - 1 - (row0 < rows ? row0 : rows - 1));

  float acc[RW][NT];
#pragma unroll
  for (int r = 0; r < RW; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[r][t] = 0.f;

  for (int64_t task0 = 0; task0 < row_tasks; task0 += chunk_tasks) {
    const int ntask = row_tasks - task0 < chunk_tasks ? (int)(row_tasks - task0) : chunk_tasks;
    const int64_t col0 = task0 / F::TPB * F::BE;
    __syncthreads();  // the previous chunk's reads are done
    // A task's values 4g..4g+3 are 4 consecutive elements starting at a multiple
    // of 4 (every format's elem() keeps runs of 4), so the copy moves float4s.
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      float* dst = xs + (size_t)t * chunk_tasks * S;
      const float* src = x + (int64_t)t * cols + col0;
#pragma unroll 4
      for (int k = threadIdx.x; k < ntask * G; k += kWarps * 32) {
        const int task = k / G, g = k % G;
        const int e = task / F::TPB * F::BE + F::elem(task % F::TPB, 4 * g);
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (t < n) v = __ldg(reinterpret_cast<const float4*>(src + e));
        *reinterpret_cast<float4*>(dst + task * S + 4 * g) = v;
      }
    }
    __syncthreads();

#pragma unroll 1
    for (int task = lane; task < ntask; task += 32) {
      const int64_t gt = task0 + task;
      const int64_t boff = gt / F::TPB * F::BB;
      const int j = (int)(gt % F::TPB);
      typename F::Raw raw[RW];
#pragma unroll
      for (int r = 0; r < RW; ++r) F::load(wbase + (r < rlast ? r : rlast) * row_bytes + boff, j, raw[r]);
      if constexpr (F::kAffine) {
        const float* xt = xs + (size_t)task * S;
        task_dot<F, NT, RW>(raw, [&](int t, int g) {
          return *reinterpret_cast<const float4*>(xt + (size_t)t * chunk_tasks * S + 4 * g);
        }, acc);
      } else {
        task_dot_plain<F, NT, RW>(raw, [&](int t, int g) {
          return *reinterpret_cast<const float4*>(xs + ((size_t)t * chunk_tasks + task) * S + 4 * g);
        }, acc);
      }
    }
  }

  warp_reduce_store<NT, RW>(acc, lane, n, rows, row0, y);
}

// Register-staged variant (see matmul.cu): no shared memory, activations read
// from global memory; MINB CTAs per SM bound the registers.
template <class F, int NT, int RW, int U, int MINB>
__global__ void __launch_bounds__(kWarps * 32, MINB)
    matvec_gx_kernel(const uint8_t* __restrict__ w, int64_t rows, int64_t cols, int64_t row_bytes,
                  const float* __restrict__ x, int n, float* __restrict__ y) {
  DFL_LAUNCH_BOUND(kWarps * 32);
  constexpr int G = F::P / 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t row_tasks = cols / F::BE * F::TPB;
  const int64_t row0 = ((int64_t)blockIdx.x * kWarps + warp) * RW;

  // Rows past the end are read (as the last row), never written.
  const uint8_t* wbase = w + (row0 < rows ? row0 : rows - 1) * row_bytes;
  const int rlast = row0 + RW <= rows ? RW - 1 : (int)(rows - 1 - (row0 < rows ? row0 : rows - 1));

  float acc[RW][NT];
#pragma unroll
  for (int r = 0; r < RW; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[r][t] = 0.f;

  // Lane L takes the row's tasks L, L+32, L+64, ... in increasing order, U at
  // a time: the loads of all U x RW (task, row) pairs go out first, then they
  // are decoded 4 values at a time and multiplied with the activations, read
  // straight from global memory (L1/L2 resident: every warp reads the same x)
  // as float4s, since a task's runs of 4 values are 4 consecutive elements.
#pragma unroll 1
  for (int64_t task0 = lane; task0 < row_tasks; task0 += 32 * U) {
    typename F::Raw raw[U][RW];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t gt = task0 + 32 * u;
      if (gt < row_tasks) {
        const int64_t boff = gt / F::TPB * F::BB;
        const int j = (int)(gt % F::TPB);
#pragma unroll
        for (int r = 0; r < RW; ++r) F::load(wbase + (r < rlast ? r : rlast) * row_bytes + boff, j, raw[u][r]);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t gt = task0 + 32 * u;
      if (gt < row_tasks) {
        const int j = (int)(gt % F::TPB);
        const float* xb = x + gt / F::TPB * F::BE;
        if constexpr (F::kAffine) {
          task_dot<F, NT, RW>(raw[u], [&](int t, int g) {
            float4 xv = make_float4(0.f, 0.f, 0.f, 0.f);
            if (t < n) xv = __ldg(reinterpret_cast<const float4*>(xb + (int64_t)t * cols + F::elem(j, 4 * g)));
            return xv;
          }, acc);
        } else {
          task_dot_plain<F, NT, RW>(raw[u], [&](int t, int g) {
            float4 xv = make_float4(0.f, 0.f, 0.f, 0.f);
            if (t < n) xv = __ldg(reinterpret_cast<const float4*>(xb + (int64_t)t * cols + F::elem(j, 4 * g)));
            return xv;
          }, acc);
        }
      }
    }
  }

  warp_reduce_store<NT, RW>(acc, lane, n, rows, row0, y);
}

// Which matvec kernel serves format F at NT tokens per pass (measured on an
// H100, bench/RESULTS.md): the shared-memory kernel (gx = false) or the
// register-staged one with RW rows per warp, U tasks per lane in flight and at
// least MINB CTAs per SM.  Both sum a token's products in the same order
// (lane L: tasks L mod 32 ascending, values in task order), so the results are
// bit-identical whichever serves an n.
template <class F, int NT>
struct MatvecCfg { static constexpr bool gx = false; static constexpr int RW = kRowsPerWarp, U = 1, MINB = 1; };
#define DFL_MV_CFG(Fmt, N, rw, u, minb)                                                              \
  template <>                                                                                         \
  struct MatvecCfg<Fmt, N> { static constexpr bool gx = true; static constexpr int RW = rw, U = u, MINB = minb; }
DFL_MV_CFG(FmtQ4_K, 1, 2, 1, 8);
DFL_MV_CFG(FmtQ4_K, 2, 4, 1, 6);
DFL_MV_CFG(FmtQ4_K, 4, 4, 1, 5);
DFL_MV_CFG(FmtQ5_K, 1, 2, 1, 8);
DFL_MV_CFG(FmtQ5_K, 2, 4, 1, 6);
DFL_MV_CFG(FmtQ5_K, 4, 4, 1, 5);
DFL_MV_CFG(FmtQ6_K, 1, 4, 1, 3);
DFL_MV_CFG(FmtQ6_K, 2, 4, 1, 5);
DFL_MV_CFG(FmtQ6_K, 4, 4, 1, 3);
DFL_MV_CFG(FmtQ8_0, 1, 2, 1, 8);
DFL_MV_CFG(FmtQ8_0, 2, 4, 2, 5);
DFL_MV_CFG(FmtQ8_0, 4, 4, 1, 6);
DFL_MV_CFG(FmtQ8_0, 8, 4, 1, 5);
DFL_MV_CFG(FmtF16, 1, 2, 1, 8);
DFL_MV_CFG(FmtF16, 2, 2, 1, 8);
DFL_MV_CFG(FmtF16, 4, 4, 1, 5);
DFL_MV_CFG(FmtF16, 8, 4, 1, 5);
#undef DFL_MV_CFG
inline int64_t matvec_gx_ctas(int64_t rows, int rw) { return (rows + kWarps * rw - 1) / (kWarps * rw); }

template <class F>
__global__ void __launch_bounds__(256)
    tiled_kernel(const uint8_t* __restrict__ w, int64_t rows, int64_t cols, int64_t row_bytes,
                 const float* __restrict__ x, int n, float* __restrict__ y) {
  DFL_LAUNCH_BOUND(256);
  DFL_STATIC_SMEM(__align__(16) float, ws, [kTileK][kTileM + 4]);
  DFL_STATIC_SMEM(__align__(16) float, xs, [kTileK][kTileN + 4]);
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
  const int64_t m0 = (int64_t)blockIdx.x * kTileM;
  const int64_t n0 = (int64_t)blockIdx.y * kTileN;
  const int wr = tid >> 2, wp = tid & 3;  // weight decode: row, 8-column part
  const int64_t wrow = m0 + wr < rows ? m0 + wr : rows - 1;
  const uint8_t* wp_row = w + wrow * row_bytes;

  float acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;

  for (int64_t k0 = 0; k0 < cols; k0 += kTileK) {
    float v[8];
    deq8<F>(wp_row, k0 + 8 * wp, v);
#pragma unroll
    for (int i = 0; i < 8; ++i) ws[8 * wp + i][wr] = v[i];
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int idx = tid + 256 * q, t = idx >> 3, c4 = idx & 7;
      float4 xv = make_float4(0.f, 0.f, 0.f, 0.f);
      if (n0 + t < n) xv = __ldg(reinterpret_cast<const float4*>(x + (n0 + t) * cols + k0) + c4);
      xs[4 * c4 + 0][t] = xv.x;
      xs[4 * c4 + 1][t] = xv.y;
      xs[4 * c4 + 2][t] = xv.z;
      xs[4 * c4 + 3][t] = xv.w;
    }
    __syncthreads();
#pragma unroll 8
    for (int kk = 0; kk < kTileK; ++kk) {
      const float4 a = *reinterpret_cast<const float4*>(&ws[kk][4 * tx]);
      const float4 b = *reinterpret_cast<const float4*>(&xs[kk][4 * ty]);
      const float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int64_t t = n0 + 4 * ty + j;
    if (t >= n) continue;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t r = m0 + 4 * tx + i;
      if (r < rows) y[t * rows + r] = acc[i][j];
    }
  }
}

}  // namespace kern
}  // namespace cuda
}  // namespace dfl
