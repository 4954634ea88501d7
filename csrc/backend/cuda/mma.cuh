// mma.cuh — the tensor-core instructions the exact verify kernels are built on:
// mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 (quantised weights) and
// m16n8k8 tf32 (F16 / BF16 weights, further down), sm_80 and later.
//
// Why int8: a quantised weight block times int8 activations is an integer
// dot product, and int32 accumulation is exact in any order.  So the
// instruction's internal order cannot change a result, the float work that
// follows (one scale per block, in k order) is the same for every batch
// shape (the exactness contract: AR, verify and prefill give bit-identical
// per-token results), and the CPU emulator reproduces the hardware bit for
// bit — no tolerance to state.
//
// Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k32"), with g = lane / 4
// and t = lane % 4; each 32-bit register packs 4 consecutive int8, low byte first:
//   A (16 x 32, row-major): a[0] row g,   cols 4t..4t+3     a[1] row g+8, cols 4t..4t+3
//                           a[2] row g,   cols 16+4t..+3    a[3] row g+8, cols 16+4t..+3
//   B (32 x 8, column n = g): b[0] rows 4t..4t+3,  b[1] rows 16+4t..16+4t+3
//   C, D (16 x 8, int32):   c[0], c[1] row g,   cols 2t, 2t+1
//                           c[2], c[3] row g+8, cols 2t, 2t+1
// The emulator (shim/cuda_runtime.h, emu::mma_m16n8k32_s8) assembles the
// warp's fragments by exactly these maps, so a wrong map fails the self-test
// on the GPU (mma_selftest in backend_ops) rather than passing silently.
#pragma once
#include "common.cuh"

namespace dfl {
namespace cuda {

// d = a * b + c for the warp's 16 x 8 x 32 tile; every lane of the warp calls it.
__device__ __forceinline__ void mma_m16n8k32_s8(int32_t (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                                const int32_t (&c)[4]) {
#ifdef DFL_EMU
  ::emu::mma_m16n8k32_s8(d, a, b, c);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  (void)d, (void)a, (void)b, (void)c;
  __trap();  // int8 mma.m16n8k32 needs sm_80+; the default architectures (86;89;90) have it
#else
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %11, %12, %13};\n"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(c[0]), "r"(c[1]), "r"(c[2]),
        "r"(c[3]));
#endif
}

// mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32, for F16 / BF16 weights
// (matmul_half.cu).  A 32-bit register holds one tf32 value (an f32 whose low
// 13 mantissa bits the instruction ignores).  Fragments (PTX ISA, "Matrix
// Fragments for mma.m16n8k8", .tf32), g = lane / 4, t = lane % 4:
//   A (16 x 8, row-major): a[0] row g, col t    a[1] row g+8, col t
//                          a[2] row g, col t+4  a[3] row g+8, col t+4
//   B (8 x 8, column n = g): b[0] row t, b[1] row t+4
//   C, D (16 x 8, f32): as for m16n8k32 above.
// The products of two tf32 values are exact in f32; the ISA does not define
// the order or rounding of the sum.  What exactness needs holds all the same:
// an output element depends only on its row of A, its column of B and its C
// (no other element of the tile), so a fixed sequence of instructions per
// element gives the same bits whatever else the tile holds.  The emulator
// (emu::mma_m16n8k8_tf32) sums c + a0 b0 + ... + a7 b7 wide and truncates to
// f32, as measurements of the hardware describe it: its results are within
// the stated tolerances of the GPU's, not equal.
__device__ __forceinline__ void mma_m16n8k8_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                                 const float (&c)[4]) {
#ifdef DFL_EMU
  ::emu::mma_m16n8k8_tf32(d, a, b, c);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  (void)d, (void)a, (void)b, (void)c;
  __trap();  // tf32 mma needs sm_80+
#else
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
        "f"(c[3]));
#endif
}

// f32 -> tf32 bits, rounded to nearest with ties away from zero (what
// cvt.rna.tf32.f32 does), in integer operations so that the GPU and the
// emulator round alike.  Inf stays Inf, NaN stays NaN.
__host__ __device__ __forceinline__ uint32_t tf32_rna_bits(uint32_t u) {
  if ((u & 0x7f800000u) == 0x7f800000u) return (u & 0x007fffffu) ? 0x7fc00000u : u;
  return (u + 0x1000u) & 0xffffe000u;
}

// Self-test of the instruction and the fragment maps above: random int8 A
// (M x K), B (K x N) and int32 C, D = A B + C computed by warps of
// 16 x 8 tiles chaining K / 32 instructions, compared with a host reference.
// Returns the number of wrong elements (0 = the maps and the instruction
// agree with the definition).  M % 16 == 0, N % 8 == 0, K % 32 == 0.
int mma_selftest(int M, int N, int K, uint32_t seed);
// The same for mma_m16n8k8_tf32 (K % 8 == 0), with small integer operands so
// that every sum is exact in any order: a wrong map cannot hide in rounding.
int mma_tf32_selftest(int M, int N, int K, uint32_t seed);

}  // namespace cuda
}  // namespace dfl
