// Kernels whose memory traffic is known by hand, for the emulator's memtrace (csrc/backend/cuda/emu/memtrace.cpp):
// tests/test_emu_launch_checks.py builds this with ThreadSanitizer's instrumentation and memtrace.cpp in place
// of libtsan, runs each case by name and checks its JSON (one kernel a case) against the counts a GPU's
// profiler would give.  2 CTAs of 64 threads unless a case says otherwise.
#include <cstdio>
#include <cstring>

#include "cuda_runtime.h"
#include "common.cuh"  // DFL_STATIC_SMEM / DFL_DYNAMIC_SMEM: the backend's shared arrays

extern "C" void dfl_emu_memtrace_reset(void);
extern "C" int dfl_emu_memtrace_dump(const char* path);

constexpr int kThreads = 64, kCtas = 2, kN = kThreads * kCtas;

__device__ inline int gid() { return (int)(blockIdx.x * blockDim.x + threadIdx.x); }

// lane i reads word i: 4 sectors for the warp's 128 bytes
__global__ void coalesced4(const float* in, float* out) { out[gid()] = in[gid()]; }
// lane i reads word 8i: a sector a lane
__global__ void strided4(const float* in, float* out) { out[gid()] = in[8 * gid()]; }
// lane i reads bytes 16i..16i+15: 16 sectors for 512 bytes
__global__ void vec16(const uint4* in, uint4* out) { out[gid()] = __ldg(in + gid()); }
// every lane reads word 0: one sector
__global__ void broadcast(const float* in, float* out) { out[gid()] = in[0]; }
// every CTA reads the same 256 words: DRAM sees them once
__global__ void reuse(const float* in, float* out) {
  float s = 0.f;
  for (int k = 0; k < 4; ++k) s += in[64 * k + (int)threadIdx.x];
  out[gid()] = s;
}
// half the lanes load a, then every lane loads b: b's instruction is still one of 32 lanes
__global__ void divergent(const float* a, const float* b, float* out) {
  float s = 0.f;
  if ((threadIdx.x & 31) < 16) s = a[gid()];
  out[gid()] = s + b[gid()];
}
// a local array (registers or local memory on a GPU) is not traffic
__global__ void local_array(const float* in, float* out) {
  volatile float v[16];
  for (int k = 0; k < 16; ++k) v[k] = in[gid()] + (float)k;
  float s = 0.f;
  for (int k = 0; k < 16; ++k) s += v[k];
  out[gid()] = s;
}
// shared memory: lane i at word stride S (1: one wavefront; 2: two lanes a bank; 32: one bank)
template <int S>
__global__ void smem_stride(float* out) {
  DFL_STATIC_SMEM(float, s, [32 * kThreads]);
  s[S * threadIdx.x] = (float)threadIdx.x;
  __syncthreads();
  out[gid()] = s[S * threadIdx.x];
}
// 16 bytes a lane to and from dynamic shared memory (a float4 made field by field, stored whole as nvcc stores
// it): 4 wavefronts an instruction, none wasted
__global__ void smem_vec16(float* out) {
  DFL_DYNAMIC_SMEM(float4, s);
  s[threadIdx.x] = make_float4(1.f, 2.f, 3.f, (float)threadIdx.x);
  __syncthreads();
  const float4 v = s[threadIdx.x ^ 1];
  out[gid()] = v.x + v.w;
}
// cp.async of 16 bytes a lane into shared memory, then read back
__global__ void cp_async16(const uint4* in, uint4* out) {
  DFL_DYNAMIC_SMEM(uint4, s);
  emu::cp_async(&s[threadIdx.x], &in[gid()], 16, 16);
  emu::cp_async_wait_all();
  __syncthreads();
  out[gid()] = s[threadIdx.x];
}

// two int8 and one tf32 mma.sync a warp (counted once a warp, not a lane)
__global__ void mma_count(float* out) {
  const uint32_t a[4] = {1u, 2u, 3u, 4u}, b[2] = {5u, 6u};
  const int32_t c[4] = {0, 0, 0, 0};
  int32_t d[4], e[4];
  emu::mma_m16n8k32_s8(d, a, b, c);
  emu::mma_m16n8k32_s8(e, a, b, d);
  const float cf[4] = {0.f, 0.f, 0.f, 0.f};
  float f[4];
  emu::mma_m16n8k8_tf32(f, a, b, cf);
  out[gid()] = (float)e[0] + f[0];
}

int main(int argc, char** argv) {
  if (argc < 3) return 2;
  const char* c = argv[1];
  float *in, *in2, *out;
  cudaMalloc(&in, sizeof(float) * 8 * kN);
  cudaMalloc(&in2, sizeof(float) * 8 * kN);
  cudaMalloc(&out, sizeof(float) * 8 * kN);
  for (int i = 0; i < 8 * kN; ++i) in[i] = in2[i] = (float)i;
  const uint4* in4 = reinterpret_cast<const uint4*>(in);
  uint4* out4 = reinterpret_cast<uint4*>(out);
  auto run = [&](auto kernel, size_t smem, auto body) { emu::launch(kCtas, kThreads, smem, body, (const void*)kernel); };
  dfl_emu_memtrace_reset();
  if (!std::strcmp(c, "coalesced4")) run(coalesced4, 0, [&] { coalesced4(in, out); });
  else if (!std::strcmp(c, "strided4")) run(strided4, 0, [&] { strided4(in, out); });
  else if (!std::strcmp(c, "vec16")) run(vec16, 0, [&] { vec16(in4, out4); });
  else if (!std::strcmp(c, "broadcast")) run(broadcast, 0, [&] { broadcast(in, out); });
  else if (!std::strcmp(c, "reuse")) run(reuse, 0, [&] { reuse(in, out); });
  else if (!std::strcmp(c, "divergent")) run(divergent, 0, [&] { divergent(in, in2, out); });
  else if (!std::strcmp(c, "local_array")) run(local_array, 0, [&] { local_array(in, out); });
  else if (!std::strcmp(c, "smem_stride1")) run(smem_stride<1>, 0, [&] { smem_stride<1>(out); });
  else if (!std::strcmp(c, "smem_stride2")) run(smem_stride<2>, 0, [&] { smem_stride<2>(out); });
  else if (!std::strcmp(c, "smem_stride32")) run(smem_stride<32>, 0, [&] { smem_stride<32>(out); });
  else if (!std::strcmp(c, "smem_vec16")) run(smem_vec16, 16 * kThreads, [&] { smem_vec16(out); });
  else if (!std::strcmp(c, "cp_async16")) run(cp_async16, 16 * kThreads, [&] { cp_async16(in4, out4); });
  else if (!std::strcmp(c, "mma_count")) run(mma_count, 0, [&] { mma_count(out); });
  else return 2;
  return dfl_emu_memtrace_dump(argv[2]) == 0 ? 0 : 3;
}
