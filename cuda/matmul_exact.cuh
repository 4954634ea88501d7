// matmul_exact.cuh — quantised weight x int8 activation in the CPU backend's
// arithmetic bit for bit (see matmul_exact.cu): K-quants on the int8 tensor
// cores, Q8_0 / Q4_0 in the CPU's AVX2 lane order.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "quant/blocks.h"

namespace dfl {
namespace cuda {

bool matmul_exact_supported(DType t);  // Q4_K, Q5_K, Q6_K, Q8_0, Q4_0

// Device bytes of the quantised activations matmul_exact needs for n x cols.
size_t matmul_exact_scratch_bytes(int64_t cols, int n);

// y[t][r] = W[r] . x[t] for t < n, asynchronously on `stream`; all pointers device
// memory (w as in GGUF, x n x cols f32, y n x rows f32, scratch of
// matmul_exact_scratch_bytes, 16-byte aligned).  cols a multiple of 256 (Q8_0 /
// Q4_0: of 32).  Each
// token's result is bit-identical for every n, and equal to the CPU backend's
// dfl_matmul (same activation quantisation, same integer sums, same float steps).
void matmul_exact(DType t, const void* w, int64_t rows, int64_t cols, const float* x, int n, float* y,
                  void* scratch, cudaStream_t stream);

}  // namespace cuda
}  // namespace dfl
