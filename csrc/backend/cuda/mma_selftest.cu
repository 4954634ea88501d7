// mma_selftest.cu — checks mma_m16n8k32_s8 and mma_m16n8k8_tf32 and their
// fragment maps (mma.cuh) against the definition, on the GPU and on the CPU
// emulator alike.
#include <random>
#include <vector>

#include "launch.cuh"
#include "mma.cuh"

namespace dfl {
namespace cuda {

namespace {

__device__ __forceinline__ uint32_t load_u32(const int8_t* p) { return *reinterpret_cast<const uint32_t*>(p); }

// The instructions under test, one k step of a tile each: A row-major (M x K), B given as its transpose
// (N x K, row-major: a column of B is contiguous), the fragments gathered by the maps in mma.cuh.
struct S8 {
  using TA = int8_t;
  using TC = int32_t;
  static constexpr int kK = 32;
  __device__ static void step(const int8_t* A, const int8_t* Bt, int K, int m0, int n0, int g, int t, int k0,
                              int32_t (&acc)[4]) {
    const uint32_t a[4] = {load_u32(A + (m0 + g) * K + k0 + 4 * t), load_u32(A + (m0 + g + 8) * K + k0 + 4 * t),
                           load_u32(A + (m0 + g) * K + k0 + 16 + 4 * t),
                           load_u32(A + (m0 + g + 8) * K + k0 + 16 + 4 * t)};
    const uint32_t b[2] = {load_u32(Bt + (n0 + g) * K + k0 + 4 * t), load_u32(Bt + (n0 + g) * K + k0 + 16 + 4 * t)};
    int32_t d[4];
    mma_m16n8k32_s8(d, a, b, acc);
    for (int i = 0; i < 4; ++i) acc[i] = d[i];
  }
};
// f32 operands through tf32_rna_bits, which leaves the test's small integers unchanged
struct Tf32 {
  using TA = float;
  using TC = float;
  static constexpr int kK = 8;
  __device__ static void step(const float* A, const float* Bt, int K, int m0, int n0, int g, int t, int k0,
                              float (&acc)[4]) {
    auto tf = [](float v) { return tf32_rna_bits(__float_as_uint(v)); };
    const uint32_t a[4] = {tf(A[(m0 + g) * K + k0 + t]), tf(A[(m0 + g + 8) * K + k0 + t]),
                           tf(A[(m0 + g) * K + k0 + t + 4]), tf(A[(m0 + g + 8) * K + k0 + t + 4])};
    const uint32_t b[2] = {tf(Bt[(n0 + g) * K + k0 + t]), tf(Bt[(n0 + g) * K + k0 + t + 4])};
    float d[4];
    mma_m16n8k8_tf32(d, a, b, acc);
    for (int i = 0; i < 4; ++i) acc[i] = d[i];
  }
};

// One warp per 16 x 8 tile of D = A B + C (C and D row-major M x N); lane (g, t)'s register i is element
// (g + 8 (i >= 2), 2 t + i % 2) of the tile.
template <class I>
__global__ void mma_tiles_kernel(const typename I::TA* A, const typename I::TA* Bt, const typename I::TC* C,
                                 typename I::TC* D, int M, int N, int K) {
  const int lane = threadIdx.x & 31, warp = (int)(blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5));
  const int tiles_n = N / 8;
  if (warp >= (M / 16) * tiles_n) return;  // whole warps only: every lane of a live warp takes part
  const int m0 = warp / tiles_n * 16, n0 = warp % tiles_n * 8, g = lane >> 2, t = lane & 3;
  auto at = [&](int i) { return (m0 + g + (i >= 2 ? 8 : 0)) * N + n0 + 2 * t + (i & 1); };
  typename I::TC acc[4];
  for (int i = 0; i < 4; ++i) acc[i] = C[at(i)];
  for (int k0 = 0; k0 < K; k0 += I::kK) I::step(A, Bt, K, m0, n0, g, t, k0, acc);
  for (int i = 0; i < 4; ++i) D[at(i)] = acc[i];
}

// Uploads A, Bt and C, runs `kernel` with one warp per 16 x 8 tile of D, and returns D.
template <class TA, class TC>
std::vector<TC> run_tiles(void (*kernel)(const TA*, const TA*, const TC*, TC*, int, int, int), const std::vector<TA>& A,
                          const std::vector<TA>& Bt, const std::vector<TC>& C, int M, int N, int K) {
  DevBuf dA(A.size() * sizeof(TA)), dB(Bt.size() * sizeof(TA)), dC(C.size() * sizeof(TC)), dD(C.size() * sizeof(TC));
  CUDA_CHECK(cudaMemcpy(dA.p, A.data(), A.size() * sizeof(TA), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dB.p, Bt.data(), Bt.size() * sizeof(TA), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dC.p, C.data(), C.size() * sizeof(TC), cudaMemcpyHostToDevice));
  const int warps = (M / 16) * (N / 8), per_cta = 4;
  launch(kernel, dim3((unsigned)((warps + per_cta - 1) / per_cta)), dim3(32 * per_cta), 0, nullptr, dA.as<const TA>(),
         dB.as<const TA>(), dC.as<const TC>(), dD.as<TC>(), M, N, K);
  CUDA_CHECK(cudaGetLastError());
  std::vector<TC> D(C.size());
  CUDA_CHECK(cudaMemcpy(D.data(), dD.p, D.size() * sizeof(TC), cudaMemcpyDeviceToHost));
  return D;
}

}  // namespace

int mma_tf32_selftest(int M, int N, int K, uint32_t seed) {
  if (M <= 0 || N <= 0 || K <= 0 || M % 16 || N % 8 || K % 8)
    fail("mma_tf32_selftest: M %d, N %d, K %d must be positive multiples of 16, 8 and 8", M, N, K);
  require_device();
  std::mt19937 rng(seed);
  // |A|, |B| <= 64, |C| <= 1e5 and K <= 1024: every partial sum is an integer below 2^24, exact in f32 in any
  // order, so a wrong fragment map shows as a wrong integer
  std::uniform_int_distribution<int> v(-64, 64), c(-100000, 100000);
  if (K > 1024) fail("mma_tf32_selftest: K %d > 1024 would leave f32's exact integers", K);
  std::vector<float> A((size_t)M * K), Bt((size_t)N * K), C((size_t)M * N);
  for (auto& x : A) x = (float)v(rng);
  for (auto& x : Bt) x = (float)v(rng);
  for (auto& x : C) x = (float)c(rng);
  const std::vector<float> D = run_tiles(mma_tiles_kernel<Tf32>, A, Bt, C, M, N, K);
  int bad = 0;
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      double ref = C[(size_t)m * N + n];
      for (int k = 0; k < K; ++k) ref += (double)A[(size_t)m * K + k] * Bt[(size_t)n * K + k];
      bad += D[(size_t)m * N + n] != (float)ref;
    }
  return bad;
}

int mma_selftest(int M, int N, int K, uint32_t seed) {
  if (M <= 0 || N <= 0 || K <= 0 || M % 16 || N % 8 || K % 32)
    fail("mma_selftest: M %d, N %d, K %d must be positive multiples of 16, 8 and 32", M, N, K);
  require_device();
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> i8(-128, 127), c32(-1000000, 1000000);
  std::vector<int8_t> A((size_t)M * K), Bt((size_t)N * K);
  std::vector<int32_t> C((size_t)M * N);
  for (auto& v : A) v = (int8_t)i8(rng);
  for (auto& v : Bt) v = (int8_t)i8(rng);
  for (auto& v : C) v = c32(rng);
  // the extremes too: -128 * -128 sums are where a wrong sign extension shows
  A[0] = Bt[0] = -128;
  A[1] = 127, Bt[1] = -128;
  const std::vector<int32_t> D = run_tiles(mma_tiles_kernel<S8>, A, Bt, C, M, N, K);
  int bad = 0;
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      int64_t ref = C[(size_t)m * N + n];
      for (int k = 0; k < K; ++k) ref += (int32_t)A[(size_t)m * K + k] * (int32_t)Bt[(size_t)n * K + k];
      bad += D[(size_t)m * N + n] != (int32_t)ref;  // |ref| stays far inside int32 here
    }
  return bad;
}

}  // namespace cuda
}  // namespace dfl
