// matmul.cu — quantised / float weight x f32 activations on the GPU.
//
// Matvec kernel (n <= 8 tokens).  A CTA is 4 warps; a warp owns RW = 4
// consecutive rows.  The columns are walked in chunks: the CTA copies the
// chunk's activations of all tokens into shared memory in *task order* (see
// formats.cuh: the order in which a lane decodes a task's values), padded so
// that the float4 reads of a warp hit distinct banks.  Each lane then takes
// the chunk's tasks lane, lane+32, ...; for a task it issues the 16-byte
// weight loads of all RW rows, decodes 4 values at a time in registers and
// accumulates w * x for every (row, token).  At the end a butterfly of warp
// shuffles sums the 32 lanes.  A chunk holds a multiple of 32 tasks, so lane
// L always owns the row's tasks L mod 32 in increasing order, whatever the
// chunk size: the summation order of a token's dot product does not depend
// on n (batch invariance for n in 1..8).  The kernel is instantiated for
// NT = 1, 2, 4, 8 tokens; n = 3, 5, 6, 7 run with zero padding tokens.
//
// Register-staged matvec (matvec_gx_kernel), chosen per format and NT by
// MatvecCfg (matmul_kernels.cuh) where it measured faster on an H100: no
// shared memory and no barrier; a warp owns RW (2 or 4) rows, each lane issues
// the weight loads of U tasks x RW rows before decoding them and reads the
// activations straight from global memory (L1-resident), and __launch_bounds__
// caps the registers so that MINB CTAs fit an SM.  Lane L still takes the
// row's tasks L mod 32 in increasing order with the same per-task arithmetic,
// so both kernels give bit-identical results and batch invariance holds across
// the NT instances whichever kernel serves them.  Both go through task_dot;
// for formats with F::kAffine (Q6_K) it sums q * x per half task and applies
// the scale once per half (one multiply per value fewer).  (ncu on Q4_K n = 1: ~70% of
// issue slots and ~77% of L1 throughput busy, DRAM ~35%: the f32 decode is
// instruction-bound, not load-bound.)
//
// Tiled kernel (n > 8).  64 rows x 64 tokens per CTA of 256 threads, 32
// columns per step: the weight tile is decoded (deq8) into shared memory as
// f32, the activation tile copied beside it, and each thread accumulates a
// 4 x 4 block of outputs.  Plain CUDA-core FMAs; tensor cores come later.
#include "matmul_launch.cuh"

namespace dfl {
namespace cuda {
using namespace kern;

void matmul(DType t, const void* w, int64_t rows, int64_t cols, const float* x, int n, float* y,
            cudaStream_t stream) {
  if (rows <= 0 || n <= 0) return;
  if (cols <= 0 || cols % 32) fail("matmul: cols %lld is not a positive multiple of 32", (long long)cols);
  switch (t) {
    case DType::F32: return launch<FmtF32>(w, rows, cols, x, n, y, stream);
    case DType::F16: return launch<FmtF16>(w, rows, cols, x, n, y, stream);
    case DType::BF16: return launch<FmtBF16>(w, rows, cols, x, n, y, stream);
    case DType::Q4_0: return launch<FmtQ4_0>(w, rows, cols, x, n, y, stream);
    case DType::Q8_0: return launch<FmtQ8_0>(w, rows, cols, x, n, y, stream);
    case DType::Q4_K:
    case DType::Q5_K:
    case DType::Q6_K:
      if (cols % QK_K) fail("matmul: cols %lld is not a multiple of 256", (long long)cols);
      if (t == DType::Q4_K) return launch<FmtQ4_K>(w, rows, cols, x, n, y, stream);
      if (t == DType::Q5_K) return launch<FmtQ5_K>(w, rows, cols, x, n, y, stream);
      return launch<FmtQ6_K>(w, rows, cols, x, n, y, stream);
  }
  fail("matmul: unsupported tensor type %u", (unsigned)t);
}

}  // namespace cuda
}  // namespace dfl
