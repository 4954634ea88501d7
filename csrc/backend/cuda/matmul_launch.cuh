// matmul_launch.cuh — host-side launch of the matmul kernels for one format.
//
// Each format's kernels are instantiated in one of matmul_float.cu /
// matmul_kquant.cu (so nvcc compiles them in parallel); matmul.cu only
// dispatches on the type.
#pragma once
#include "launch.cuh"
#include "matmul.cuh"
#include "matmul_kernels.cuh"

namespace dfl {
namespace cuda {
namespace kern {

template <class F, int NT>
void launch_matvec(const uint8_t* w, int64_t rows, int64_t cols, int64_t rb, const float* x, int n, float* y,
                   cudaStream_t s) {
  using C = MatvecCfg<F, NT>;
  if constexpr (C::gx) {
    const int64_t grid = matvec_gx_ctas(rows, C::RW);
    if (grid > 0x7fffffff) fail("matmul: %lld rows is too many", (long long)rows);
    launch(matvec_gx_kernel<F, NT, C::RW, C::U, C::MINB>, dim3((unsigned)grid), dim3(kWarps * 32), 0, s, w, rows, cols, rb, x,
           n, y);
  } else {
    const int chunk = Layout<F>::chunk_cols(NT, cols);
    const size_t smem = Layout<F>::smem_bytes(NT, chunk);  // <= 37 KiB: no opt-in above 48 KiB needed
    const int64_t grid = matvec_ctas(rows);
    if (grid > 0x7fffffff) fail("matmul: %lld rows is too many", (long long)rows);
    launch(matvec_kernel<F, NT, kRowsPerWarp>, dim3((unsigned)grid), dim3(kWarps * 32), smem, s, w, rows, cols, rb, x, n,
           y, chunk);
  }
}

// y = W x for n tokens of a weight of format F (see matmul.cuh).
template <class F>
void launch(const void* wv, int64_t rows, int64_t cols, const float* x, int n, float* y, cudaStream_t s) {
  const uint8_t* w = static_cast<const uint8_t*>(wv);
  const int64_t rb = cols / F::BE * F::BB;
  if (n <= kMatvecMaxTokens) {
    switch (matvec_nt(n)) {
      case 1: return launch_matvec<F, 1>(w, rows, cols, rb, x, n, y, s);
      case 2: return launch_matvec<F, 2>(w, rows, cols, rb, x, n, y, s);
      case 4: return launch_matvec<F, 4>(w, rows, cols, rb, x, n, y, s);
      default: return launch_matvec<F, 8>(w, rows, cols, rb, x, n, y, s);
    }
  }
  const int64_t gx = (rows + kTileM - 1) / kTileM, gy = (n + kTileN - 1) / kTileN;
  if (gx > 0x7fffffff || gy > 65535) fail("matmul: %lld rows x %d tokens is too large", (long long)rows, n);
  launch(tiled_kernel<F>, dim3((unsigned)gx, (unsigned)gy), dim3(256), 0, s, w, rows, cols, rb, x, n, y);
}

#define DFL_MATMUL_LAUNCH(F)                                                                              \
  template void launch<F>(const void* wv, int64_t rows, int64_t cols, const float* x, int n, float* y, \
                          cudaStream_t s)
extern DFL_MATMUL_LAUNCH(FmtF32);
extern DFL_MATMUL_LAUNCH(FmtF16);
extern DFL_MATMUL_LAUNCH(FmtBF16);
extern DFL_MATMUL_LAUNCH(FmtQ4_0);
extern DFL_MATMUL_LAUNCH(FmtQ8_0);
extern DFL_MATMUL_LAUNCH(FmtQ4_K);
extern DFL_MATMUL_LAUNCH(FmtQ5_K);
extern DFL_MATMUL_LAUNCH(FmtQ6_K);

}  // namespace kern
}  // namespace cuda
}  // namespace dfl
