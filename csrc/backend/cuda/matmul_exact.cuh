// matmul_exact.cuh — the CUDA backend's batch-invariant matmuls: a token's
// result is the same bits for every batch size (AR step, verify, prefill chunk).
// Quantised weights in the CPU backend's arithmetic bit for bit (matmul_exact.cu:
// K-quants and, for more than 8 tokens, Q8_0 / Q4_0 on the int8 tensor cores);
// F16 / BF16 on the tf32 tensor cores (matmul_half.cu), within f32 rounding of
// the CPU.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "quant/blocks.h"

namespace dfl {
namespace cuda {

bool matmul_exact_supported(DType t);  // Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, F16, BF16

// Device bytes of the quantised activations matmul_exact needs for n x cols.
size_t matmul_exact_scratch_bytes(int64_t cols, int n);

// y[t][r] = W[r] . x[t] for t < n, asynchronously on `stream`; all pointers device
// memory (w as in GGUF, x n x cols f32, y n x rows f32, scratch of
// matmul_exact_scratch_bytes, 16-byte aligned).  cols a multiple of 256 for
// K-quants, of 32 otherwise.  Each token's result is bit-identical for every n;
// for quantised weights it equals the CPU backend's dfl_matmul (same activation
// quantisation, same integer sums, same float steps), for F16 / BF16 it is
// within f32 rounding of it (matmul_half; scratch unused).
void matmul_exact(DType t, const void* w, int64_t rows, int64_t cols, const float* x, int n, float* y,
                  void* scratch, cudaStream_t stream);

// matmul_exact in two halves, so that matmuls of one input (a layer's q / k / v,
// its gate / up) quantise it once: which activations format t's kernel reads
// (none for F16 / BF16), the quantisation into scratch, and the matmul on it.
enum class ExactAct { none, blocks256, blocks32 };
ExactAct matmul_exact_act(DType t);  // fails for the other formats
void matmul_exact_quantize(ExactAct a, const float* x, int64_t cols, int n, void* scratch, cudaStream_t stream);
void matmul_exact_quantized(DType t, const void* w, int64_t rows, int64_t cols, const float* x, int n, float* y,
                            const void* scratch, cudaStream_t stream);

// Pin the K-quant matvec's rows per CTA (n <= 8 tokens, and verifies of up to 64 on weights of fewer
// than 2048 rows) to 1, 2, 4, 8 or 16, or 0 for the automatic choice by the weight's shape; -1 is the
// automatic choice with every verify on the tensor cores.  Speed only: the bits are the same for every
// choice.  For tests and the GPU bench (dfl_cuda_matvec_rows).
void set_matvec_rows(int rows_per_cta);

// Pin the K-quant tensor-core verify (9..64 tokens): the streaming kernel with 1, 2 or 4 warps splitting
// each 16 rows' K, 0 for the automatic choice by shape, -1 for the round-synchronous kernel (the one the
// first GPU record timed, and the one prefill chunks of more than 64 tokens take unless a split is pinned).
// Speed only: the bits are the same for every choice.  For tests and the GPU bench (dfl_cuda_mma_split).
void set_mma_split(int warps);

// F16 / BF16 weights on the tf32 tensor cores, batch-invariant (matmul_half.cu).
void matmul_half(DType t, const void* w, int64_t rows, int64_t cols, const float* x, int n, float* y,
                 cudaStream_t stream);

}  // namespace cuda
}  // namespace dfl
