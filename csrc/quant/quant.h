// quant.h — per-format reference routines and the CPU dot products.
//
// Every format has a scalar `dequantize_row` (the source of truth, checked
// bit-exactly against gguf-py) and a dot product against an activation row.
// Quantised weights are multiplied with activations quantised per 32 values
// to int8 (`ActRow`), so the inner loops run on integer SIMD; float
// weights are multiplied with f32 activations.  A dot product's result depends
// only on its two rows, never on batch size or thread count: that is what
// makes the whole forward batch-invariant.
#pragma once
#include "quant/blocks.h"

namespace dfl {

bool dtype_supported(uint32_t type);
void dequantize_row(DType t, const void* src, float* dst, int64_t n);

// Activation side of a dot product.
bool dtype_is_quantized(DType t);
// Values per activation scale for weights of type t: 256 for K-quants, else 32.
int act_block(DType t);
void quantize_act_row(const float* x, int8_t* q, float* d, int16_t* bsum, int64_t n, int block);

// KV-cache / generic writers (round to nearest, as ggml's reference quantizers).
void quantize_row(DType t, const float* x, void* dst, int64_t n);  // F32, F16, BF16, Q8_0, Q4_0

// Q8_0 / Q4_0 weights: out[k] = w_row . x[k] for k < nt (1 <= nt <= 4).  The
// weight block is unpacked once for all nt tokens, but each token's result is
// computed by the same sequence of operations whatever nt is (batch
// invariance), so a token's value never depends on its neighbours.
void dot_row_q(DType t, const void* w_row, const ActRow* x, int nt, int64_t n, float* out);
constexpr int kDotMaxTokens = 4;
// The same value written one output at a time: the definition (dot_cpu.cpp's
// header) the kernels, the scalar build and CUDA's matmul equal bit for bit.
float dot_row_q_reference(DType t, const void* w_row, const ActRow& x, int64_t n);
// dequantize_row's values (exactly), with F16C / AVX2 for the float types where built.
void widen_row(DType t, const void* src, float* dst, int64_t n);
// Float weights (F32/F16/BF16) against f32 activations.
float dot_f(DType t, const void* w_row, const float* x, int64_t n);
// out[k] = w_row . x[k * x_stride ..] for k < nt, each exactly equal to dot_f's result (the weight
// row is read once per pair of tokens).
void dot_f_multi(DType t, const void* w_row, const float* x, int64_t x_stride, int nt, int64_t n, float* out);
// out[i] += p[s] * v[s][i] for rows s = 0..ns-1 in order, a multiply then an add per
// element and row (never fused), out kept in registers across the rows; rows of other
// types are widened first (widen_row).
void axpy_rows(const float* const* v, const float* p, int ns, float* out, int64_t n);

// K-quant weights (Q4_K, Q5_K, Q6_K) against int8 activations (act_block 256):
// y[t * W.rows + r] for rows [r0, r1) and every token t < n.  One arithmetic for
// every batch size and tiling (gemm_kquant.cpp), so a token's row is bit-identical
// alone or in any batch, on every build.
struct Weight;
bool gemm_kquant_supported(DType t);
// Q6_K weights whose rows come in fours get a CpuLayout holder (loaders call this): the AVX2 kernels then read
// a copy pre-transposed into their panels' order, made on the first CPU matmul (cpu_ops.cpp: q6_panels_bytes,
// then q6_panels_fill), the same bits as the GGUF order at every batch size and 1.3x faster for a quad of
// tokens (bench/q6k_layout.cpp).  DFLASH27B_CPU_Q6K_PANELS=0 (read once) keeps the GGUF order.
Weight with_cpu_layout(Weight w);
// Whether the CPU's kernels would read W's panels now (AVX2 build, AVX-512 not active, not turned off), and
// making them once: the bytes to allocate, then panels [p0, p1) (4 rows each; the caller splits the work).
bool q6_panels_wanted(const Weight& W);
size_t q6_panels_bytes(const Weight& W);
void q6_panels_fill(const Weight& W, int64_t p0, int64_t p1, uint8_t* out);  // 4-row panels p0..p1
// Rows of panels the kernels have read so far in this process (tests: the panel path was taken).
int64_t q6_panel_rows_read();
void gemm_kquant(const Weight& W, int64_t r0, int64_t r1, const ActRow* x, int n, float* y);
// The same arithmetic written one output at a time (the definition the kernels are tested against).
void gemm_kquant_reference(const Weight& W, int64_t r0, int64_t r1, const ActRow* x, int n, float* y);

const char* simd_name();  // "avx2+avx512", "avx2" or "scalar": the kernels in use now

}  // namespace dfl
