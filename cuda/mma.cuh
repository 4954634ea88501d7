// mma.cuh — the tensor-core instruction the exact verify kernels are built on:
// mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 (sm_80 and later).
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

// Self-test of the instruction and the fragment maps above: random int8 A
// (M x K), B (K x N) and int32 C, D = A B + C computed by warps of
// 16 x 8 tiles chaining K / 32 instructions, compared with a host reference.
// Returns the number of wrong elements (0 = the maps and the instruction
// agree with the definition).  M % 16 == 0, N % 8 == 0, K % 32 == 0.
int mma_selftest(int M, int N, int K, uint32_t seed);

}  // namespace cuda
}  // namespace dfl
