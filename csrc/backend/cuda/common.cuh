// common.cuh — what every CUDA source of the backend shares.
//
// The block formats come from csrc/quant/blocks.h, unchanged: its structs and
// constants compile under nvcc as they are (its inline helpers are host-only
// and are not used on the device).  Device code reads blocks through the byte
// offsets below, each pinned to the struct with a static_assert, and converts
// f16/bf16 with the device helpers here.
//
// CUDA_CHECK turns a failed runtime call into dfl::Error, so the C entry points
// report it through dfl_last_error() like every other failure.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include <mutex>
#include <unordered_map>

#include "quant/blocks.h"
#include "util/error.h"

#define CUDA_CHECK(expr)                                                                          \
  do {                                                                                            \
    cudaError_t dfl_err_ = (expr);                                                                \
    if (dfl_err_ != cudaSuccess)                                                                  \
      ::dfl::fail("CUDA error %s (%s) in %s at %s:%d", cudaGetErrorName(dfl_err_),                \
                  cudaGetErrorString(dfl_err_), #expr, __FILE__, __LINE__);                       \
  } while (0)

// Dynamic shared memory: the kernel's `extern __shared__` array on the GPU;
// the emulator hands out its own buffer.
// Static shared memory, `DFL_STATIC_SMEM(float, red, [32])`: a `__shared__` array on the GPU.  The
// emulator's is the CTA's own allocation (emu::static_smem: a function static would start each CTA with what
// the last one left and the first with zeros), which the CTA's first thread to reach the declaration fills
// with 0xff bytes, as garbage would be on a GPU, so a read before any write shows.  Every kernel declares its
// static shared arrays this way (tests/test_emu_launch_checks.py).
// A kernel declared `__launch_bounds__(n, ...)` opens with `DFL_LAUNCH_BOUND(n);`.  nvcc compiles it for at
// most n threads a block and the GPU refuses a larger launch; the emulator has no registers to run out of, so
// the kernel's threads refuse it there (a test keeps the two n the same).  Nothing under nvcc.
#ifdef DFL_EMU
#define DFL_LAUNCH_BOUND(n) ::emu::check_launch_bound((n), __func__)
#define DFL_DYNAMIC_SMEM(T, name) T* name = reinterpret_cast<T*>(::emu::dynamic_smem())
#define DFL_STATIC_SMEM(T, name, dims)                                                   \
  static T dfl_smem_tag_##name dims; /* its type, size and identity; the array is the CTA's */ \
  auto& name = *static_cast<decltype(&dfl_smem_tag_##name)>(                                \
      ::emu::static_smem(&dfl_smem_tag_##name, sizeof(dfl_smem_tag_##name), __alignof__(dfl_smem_tag_##name)))
#else
#define DFL_LAUNCH_BOUND(n) ((void)0)
#define DFL_DYNAMIC_SMEM(T, name) extern __shared__ T name[]
#define DFL_STATIC_SMEM(T, name, dims) __shared__ T name dims
#endif

namespace dfl {
namespace cuda {

// Fails (dfl::Error, not a crash) unless a CUDA device is usable: no driver
// and no GPU are ordinary errors here.
inline void require_device() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear it
    fail("no usable CUDA device: %s", cudaGetErrorString(e));
  }
  if (n <= 0) fail("no usable CUDA device: none found");
}

// Every device allocation of the library goes through device_alloc /
// device_free, which count the bytes held now and the peak since the last
// reset: the GPU record compares that peak with the memory plan
// (dfl_cuda_memory_stats).  Allocations happen at load and context creation,
// never in a decode step, so one mutex costs nothing.
struct DeviceMemoryCounter {
  std::mutex mu;
  std::unordered_map<void*, size_t> live;
  uint64_t now = 0, peak = 0;
};
inline DeviceMemoryCounter& device_memory_counter() {
  static DeviceMemoryCounter c;
  return c;
}
inline void* device_alloc(size_t bytes) {
  void* p = nullptr;
  CUDA_CHECK(cudaMalloc(&p, bytes));
  DeviceMemoryCounter& c = device_memory_counter();
  std::lock_guard<std::mutex> lock(c.mu);
  c.live[p] = bytes;
  c.now += bytes;
  if (c.now > c.peak) c.peak = c.now;
  return p;
}
inline void device_free(void* p) {
  if (!p) return;
  cudaFree(p);
  DeviceMemoryCounter& c = device_memory_counter();
  std::lock_guard<std::mutex> lock(c.mu);
  auto it = c.live.find(p);
  if (it == c.live.end()) return;
  c.now -= it->second;
  c.live.erase(it);
}

// Owns one device allocation, rounded up to 16 bytes (matmul's requirement).
struct DevBuf {
  void* p = nullptr;
  explicit DevBuf(size_t bytes) { p = device_alloc((bytes + 15) / 16 * 16 + 16); }
  ~DevBuf() { device_free(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  template <class T>
  T* as() const { return static_cast<T*>(p); }
};

// ---- block field offsets (bytes), checked against blocks.h ----
constexpr int kQ4_0_d = 0, kQ4_0_qs = 2;
constexpr int kQ8_0_d = 0, kQ8_0_qs = 2;
constexpr int kQ4_K_d = 0, kQ4_K_scales = 4, kQ4_K_qs = 16;
constexpr int kQ5_K_d = 0, kQ5_K_scales = 4, kQ5_K_qh = 16, kQ5_K_qs = 48;
constexpr int kQ6_K_ql = 0, kQ6_K_qh = 128, kQ6_K_scales = 192, kQ6_K_d = 208;
static_assert(offsetof(block_q4_0, d) == kQ4_0_d && offsetof(block_q4_0, qs) == kQ4_0_qs, "q4_0 layout");
static_assert(offsetof(block_q8_0, d) == kQ8_0_d && offsetof(block_q8_0, qs) == kQ8_0_qs, "q8_0 layout");
static_assert(offsetof(block_q4_K, d) == kQ4_K_d && offsetof(block_q4_K, dmin) == 2 &&
                  offsetof(block_q4_K, scales) == kQ4_K_scales && offsetof(block_q4_K, qs) == kQ4_K_qs,
              "q4_K layout");
static_assert(offsetof(block_q5_K, d) == kQ5_K_d && offsetof(block_q5_K, dmin) == 2 &&
                  offsetof(block_q5_K, scales) == kQ5_K_scales && offsetof(block_q5_K, qh) == kQ5_K_qh &&
                  offsetof(block_q5_K, qs) == kQ5_K_qs,
              "q5_K layout");
static_assert(offsetof(block_q6_K, ql) == kQ6_K_ql && offsetof(block_q6_K, qh) == kQ6_K_qh &&
                  offsetof(block_q6_K, scales) == kQ6_K_scales && offsetof(block_q6_K, d) == kQ6_K_d,
              "q6_K layout");

// ---- device conversions (exact, like blocks.h's scalar ones) ----
__device__ __forceinline__ float f16_bits_to_f32(uint32_t h) {
  return __half2float(__ushort_as_half((unsigned short)(h & 0xffffu)));
}
__device__ __forceinline__ float bf16_bits_to_f32(uint32_t h) { return __uint_as_float((h & 0xffffu) << 16); }
// Round to nearest even, as blocks.h's f32_to_f16, widened to a 32-bit integer in the same asm block.
// Why not __half_as_ushort(__float2half_rn(f)): with nvcc 13.0 for sm_90 the 16-bit register that
// intrinsic leaves was stored byte-wise (st.global.u8) with its low byte lost (0x3c47 landed as
// 0x3c01): every f16 KV row and Q8_0 / Q4_0 block scale on the first H100 (gpu-20261127-0552).
// The emulator and the CPU never see PTX registers, so only a GPU run shows it.
__device__ __forceinline__ uint32_t f32_to_f16_bits(float f) {
#ifdef DFL_EMU
  return __half_as_ushort(__float2half_rn(f));
#else
  uint32_t r;
  asm("{ .reg .b16 h; cvt.rn.f16.f32 h, %1; cvt.u32.u16 %0, h; }" : "=r"(r) : "f"(f));
  return r;
#endif
}

// Unaligned little-endian reads from a 2-byte aligned block (scalar; for
// headers and the slow paths).
__device__ __forceinline__ uint32_t ld_u16(const uint8_t* p) {
  return __ldg(reinterpret_cast<const unsigned short*>(p));
}
__device__ __forceinline__ float ld_f16(const uint8_t* p) { return f16_bits_to_f32(ld_u16(p)); }
__device__ __forceinline__ uint32_t ld_u8(const uint8_t* p) { return __ldg(p); }

// 16 bytes from a 16-byte aligned address.
__device__ __forceinline__ uint4 ld16(const uint8_t* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// 16 bytes from any 2-byte aligned address, as one or two aligned 16-byte loads
// and funnel shifts (never a byte-wise gather).  The second load is issued
// only when p is not 16-aligned, and then it holds at least one wanted byte,
// so nothing past the 16-byte chunk holding the last wanted byte is read.
__device__ __forceinline__ uint4 ld16_u(const uint8_t* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const uint32_t s = (uint32_t)(a & 15u);
  const uint4* q = reinterpret_cast<const uint4*>(a - s);
  const uint4 lo = __ldg(q);
  if (s == 0) return lo;
  const uint4 hi = __ldg(q + 1);
  const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  const uint32_t wsel = s >> 2, sh = (s & 3u) * 8u;
  uint32_t v[6], u[5];
#pragma unroll
  for (int i = 0; i < 6; ++i) v[i] = (wsel & 2u) ? w[i + 2] : w[i];
#pragma unroll
  for (int i = 0; i < 5; ++i) u[i] = (wsel & 1u) ? v[i + 1] : v[i];
  return make_uint4(__funnelshift_r(u[0], u[1], sh), __funnelshift_r(u[1], u[2], sh),
                    __funnelshift_r(u[2], u[3], sh), __funnelshift_r(u[3], u[4], sh));
}

// Asynchronous copies from global to shared memory (cp.async, sm_80+): a tiled kernel issues the next
// tile's copies, works on the current one, and waits (cp_async_wait_all, then a barrier) before reading
// what it copied.  cp_async16 needs both addresses 16-byte aligned; the zfill form reads src_bytes
// (0..16) and zeroes the rest of the 16, so a copy never reads past the end of a tensor.  The
// emulator holds each copy back until the issuing thread's wait (emu::cp_async), so a kernel that
// reads a tile too early computes with stale bytes there too.
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, int src_bytes) {
#ifdef DFL_EMU
  ::emu::cp_async(smem, gmem, 16, src_bytes);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  (void)smem, (void)gmem, (void)src_bytes;
  __trap();  // cp.async needs sm_80+
#else
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes) : "memory");
#endif
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) { cp_async16_zfill(smem, gmem, 16); }
// 4 bytes (both addresses 4-byte aligned).
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
#ifdef DFL_EMU
  ::emu::cp_async(smem, gmem, 4, 4);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  (void)smem, (void)gmem;
  __trap();
#else
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem) : "memory");
#endif
}
// Closes the thread's copies issued so far into a group, and waits for all its groups.
__device__ __forceinline__ void cp_async_commit() {
#if !defined(DFL_EMU) && (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800)
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void cp_async_wait_all() {
#ifdef DFL_EMU
  ::emu::cp_async_wait_all();
#elif !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#endif
}

__device__ __forceinline__ uint32_t u4_word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;  // i is a compile-time constant at every use
}

// Byte m (0..3) of v as the float 2^23 + byte: exact, with no int->float
// conversion instruction (one byte permute; the caller subtracts 2^23 + offset).
__device__ __forceinline__ float byte_as_f(uint32_t v, int m) {
  return __uint_as_float(__byte_perm(v, 0x4B000000u, 0x7440u | (uint32_t)m));
}
constexpr float kTwo23 = 8388608.0f;

// The attention CTA grouping for every context from now on (backend.cu): toks tokens x heads
// query heads of one KV head per CTA, each clipped to what the shape and shared memory allow;
// 0, 0 = chosen per launch.  Speed only: a query row's arithmetic does not depend on it.
void set_attention_rows(int toks, int heads);
// The attention kernel from now on: 1 the tensor-core kernel where the head allows it (attention_mma.cuh),
// -1 the f32 kernel everywhere, 0 as DFLASH27B_CUDA_ATTN said when each context was created.  Not speed only: the two kernels round
// differently, so set it before decoding and compare runs under one choice.
void set_attention_kernel(int kind);

}  // namespace cuda
}  // namespace dfl
