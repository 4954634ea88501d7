// matmul.cuh — the CUDA backend's float weight x activation product (every
// format, activations in f32).  K-quant weights in the forward take the exact
// kernels instead (matmul_exact.cuh).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "quant/blocks.h"

namespace dfl {
namespace cuda {

// y[t][r] = W[r] . x[t] for t < n, on the device, asynchronously on `stream`.
//
// w: rows x cols weight of type t, row-major blocks exactly as in GGUF, in
//    device memory; 16-byte aligned, and its allocation rounded up to a
//    multiple of 16 bytes (rows of 2-byte aligned formats are read with
//    aligned 16-byte loads).  Weights are decoded in registers (n <= 8) or
//    tile by tile in shared memory (n > 8); never into a global f32 copy.
// x: n x cols f32, y: n x rows f32, both device memory, 16-byte aligned.
// cols must be a multiple of 32 and of the format's block size; n >= 1.
//
// n <= 8 takes a matvec kernel (a warp per 2 or 4 rows); each token's result is
// bit-identical for every n in 1..8.  n > 8 takes the tiled kernel, whose
// results are bit-identical for every n > 8 but may differ from the matvec
// kernel's in the last bits (another summation order).
void matmul(DType t, const void* w, int64_t rows, int64_t cols, const float* x, int n, float* y,
            cudaStream_t stream);

// Largest n that takes the matvec kernel.
constexpr int kMatvecMaxTokens = 8;

}  // namespace cuda
}  // namespace dfl
