// CPU emulation shim: lets g++ compile cuda/formats.cuh and cuda/matmul_kernels.cuh
// as host code (see ../emu_matmul.cpp).  Each CUDA thread of a CTA becomes a
// std::thread; CTAs run one after another, so `__shared__` variables become
// function statics.  Only what those two headers use is here.
#pragma once
#include <barrier>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)

struct uint4 { uint32_t x, y, z, w; };
struct float4 { float x, y, z, w; };
struct dim3 { unsigned x = 1, y = 1, z = 1; };
inline uint4 make_uint4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) { return {a, b, c, d}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }

// Vector loads trap on misalignment, as the GPU would fault.
inline uint4 __ldg(const uint4* p) {
  if ((uintptr_t)p & 15) std::abort();
  uint4 v;
  std::memcpy(&v, p, 16);
  return v;
}
inline float4 __ldg(const float4* p) {
  if ((uintptr_t)p & 15) std::abort();
  float4 v;
  std::memcpy(&v, p, 16);
  return v;
}
inline unsigned short __ldg(const unsigned short* p) {
  if ((uintptr_t)p & 1) std::abort();
  return *p;
}
inline uint8_t __ldg(const uint8_t* p) { return *p; }
inline float __ldg(const float* p) { return *p; }

inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t v = (uint64_t)y << 32 | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= (uint32_t)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}
inline uint32_t __funnelshift_r(uint32_t lo, uint32_t hi, uint32_t sh) {
  return (uint32_t)((((uint64_t)hi << 32) | lo) >> (sh & 31));
}
inline float __uint_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t __float_as_uint(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

typedef int cudaError_t;
typedef void* cudaStream_t;
#define cudaSuccess 0
inline const char* cudaGetErrorName(int) { return "emulated"; }
inline const char* cudaGetErrorString(int) { return "emulated"; }

// ---- threads, barriers, shuffles ----
inline thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;
struct EmuCta {
  std::barrier<>* bar;
  std::barrier<>* warp_bar[32];
  float slot[32][32];
};
inline thread_local EmuCta* emu_cta = nullptr;
inline void __syncthreads() { emu_cta->bar->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int o) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  emu_cta->slot[w][lane] = v;
  emu_cta->warp_bar[w]->arrive_and_wait();
  const float r = emu_cta->slot[w][lane ^ o];
  emu_cta->warp_bar[w]->arrive_and_wait();
  return r;
}
