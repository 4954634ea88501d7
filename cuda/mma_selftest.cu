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

// One warp per 16 x 8 tile of D; A row-major (M x K), B given as its transpose
// (N x K, row-major: a column of B is contiguous), C and D row-major int32.
__global__ void mma_tiles_kernel(const int8_t* A, const int8_t* Bt, const int32_t* C, int32_t* D, int M, int N,
                                 int K) {
  const int lane = threadIdx.x & 31, warp = (int)(blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5));
  const int tiles_n = N / 8;
  if (warp >= (M / 16) * tiles_n) return;  // whole warps only: every lane of a live warp takes part
  const int m0 = warp / tiles_n * 16, n0 = warp % tiles_n * 8, g = lane >> 2, t = lane & 3;
  int32_t acc[4] = {C[(m0 + g) * N + n0 + 2 * t], C[(m0 + g) * N + n0 + 2 * t + 1],
                    C[(m0 + g + 8) * N + n0 + 2 * t], C[(m0 + g + 8) * N + n0 + 2 * t + 1]};
  for (int k0 = 0; k0 < K; k0 += 32) {
    const uint32_t a[4] = {load_u32(A + (m0 + g) * K + k0 + 4 * t), load_u32(A + (m0 + g + 8) * K + k0 + 4 * t),
                           load_u32(A + (m0 + g) * K + k0 + 16 + 4 * t),
                           load_u32(A + (m0 + g + 8) * K + k0 + 16 + 4 * t)};
    const uint32_t b[2] = {load_u32(Bt + (n0 + g) * K + k0 + 4 * t), load_u32(Bt + (n0 + g) * K + k0 + 16 + 4 * t)};
    int32_t d[4];
    mma_m16n8k32_s8(d, a, b, acc);
    for (int i = 0; i < 4; ++i) acc[i] = d[i];
  }
  D[(m0 + g) * N + n0 + 2 * t] = acc[0];
  D[(m0 + g) * N + n0 + 2 * t + 1] = acc[1];
  D[(m0 + g + 8) * N + n0 + 2 * t] = acc[2];
  D[(m0 + g + 8) * N + n0 + 2 * t + 1] = acc[3];
}

// The tf32 instruction the same way: A row-major (M x K) and Bt (N x K) as f32, C and D f32.  Operands go
// through tf32_rna_bits, which leaves these (small integers) unchanged.
__global__ void mma_tf32_tiles_kernel(const float* A, const float* Bt, const float* C, float* D, int M, int N, int K) {
  const int lane = threadIdx.x & 31, warp = (int)(blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5));
  const int tiles_n = N / 8;
  if (warp >= (M / 16) * tiles_n) return;
  const int m0 = warp / tiles_n * 16, n0 = warp % tiles_n * 8, g = lane >> 2, t = lane & 3;
  float acc[4] = {C[(m0 + g) * N + n0 + 2 * t], C[(m0 + g) * N + n0 + 2 * t + 1], C[(m0 + g + 8) * N + n0 + 2 * t],
                  C[(m0 + g + 8) * N + n0 + 2 * t + 1]};
  auto tf = [](float v) { return tf32_rna_bits(__float_as_uint(v)); };
  for (int k0 = 0; k0 < K; k0 += 8) {
    const uint32_t a[4] = {tf(A[(m0 + g) * K + k0 + t]), tf(A[(m0 + g + 8) * K + k0 + t]),
                           tf(A[(m0 + g) * K + k0 + t + 4]), tf(A[(m0 + g + 8) * K + k0 + t + 4])};
    const uint32_t b[2] = {tf(Bt[(n0 + g) * K + k0 + t]), tf(Bt[(n0 + g) * K + k0 + t + 4])};
    float d[4];
    mma_m16n8k8_tf32(d, a, b, acc);
    for (int i = 0; i < 4; ++i) acc[i] = d[i];
  }
  D[(m0 + g) * N + n0 + 2 * t] = acc[0];
  D[(m0 + g) * N + n0 + 2 * t + 1] = acc[1];
  D[(m0 + g + 8) * N + n0 + 2 * t] = acc[2];
  D[(m0 + g + 8) * N + n0 + 2 * t + 1] = acc[3];
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
  std::vector<float> A((size_t)M * K), Bt((size_t)N * K), C((size_t)M * N), D((size_t)M * N);
  for (auto& x : A) x = (float)v(rng);
  for (auto& x : Bt) x = (float)v(rng);
  for (auto& x : C) x = (float)c(rng);
  DevBuf dA(A.size() * 4), dB(Bt.size() * 4), dC(C.size() * 4), dD(D.size() * 4);
  CUDA_CHECK(cudaMemcpy(dA.p, A.data(), A.size() * 4, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dB.p, Bt.data(), Bt.size() * 4, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dC.p, C.data(), C.size() * 4, cudaMemcpyHostToDevice));
  const int warps = (M / 16) * (N / 8), per_cta = 4;
  launch(mma_tf32_tiles_kernel, dim3((unsigned)((warps + per_cta - 1) / per_cta)), dim3(32 * per_cta), 0, nullptr,
         dA.as<const float>(), dB.as<const float>(), dC.as<const float>(), dD.as<float>(), M, N, K);
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaMemcpy(D.data(), dD.p, D.size() * 4, cudaMemcpyDeviceToHost));
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
  std::vector<int32_t> C((size_t)M * N), D((size_t)M * N);
  for (auto& v : A) v = (int8_t)i8(rng);
  for (auto& v : Bt) v = (int8_t)i8(rng);
  for (auto& v : C) v = c32(rng);
  // the extremes too: -128 * -128 sums are where a wrong sign extension shows
  A[0] = Bt[0] = -128;
  A[1] = 127, Bt[1] = -128;
  DevBuf dA(A.size()), dB(Bt.size()), dC(C.size() * 4), dD(D.size() * 4);
  CUDA_CHECK(cudaMemcpy(dA.p, A.data(), A.size(), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dB.p, Bt.data(), Bt.size(), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dC.p, C.data(), C.size() * 4, cudaMemcpyHostToDevice));
  const int warps = (M / 16) * (N / 8), per_cta = 4;
  launch(mma_tiles_kernel, dim3((unsigned)((warps + per_cta - 1) / per_cta)), dim3(32 * per_cta), 0, nullptr,
         dA.as<const int8_t>(), dB.as<const int8_t>(), dC.as<const int32_t>(), dD.as<int32_t>(), M, N, K);
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaMemcpy(D.data(), dD.p, D.size() * 4, cudaMemcpyDeviceToHost));
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
