// simd.h — the CPU kernels' one switch between their AVX2 and scalar code, and
// the small helpers the kernel files share.
#pragma once
#include <atomic>

#include "quant/blocks.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define DFL_AVX2 1
#endif

namespace dfl {

// f16 -> f32, exact either way (F16C or the scalar conversion).
inline float fp16(uint16_t h) {
#ifdef DFL_AVX2
  return _cvtsh_ss(h);
#else
  return f16_to_f32(h);
#endif
}

// The AVX-512 panel kernels of gemm_kquant.cpp (prefill and verify batches) run
// where the build has AVX2 and the CPU AVX-512 F/BW/DQ/VL/VNNI; they compute the same
// bits as the AVX2 ones.  DFLASH27B_CPU_AVX512=0 in the environment, or
// set_cpu_avx512(0), keeps the AVX2 kernels (to compare, or to time both).
bool cpu_avx512_supported();
void set_cpu_avx512(int mode);  // 1 on (fails where unsupported), 0 off, -1 as the environment says
namespace detail {
extern std::atomic<int> g_avx512;  // 1 on, 0 off, -1: not yet read from the environment
int avx512_from_env_once();
}  // namespace detail
// Inline: the float kernels ask once per weight row (a call was 1-2% of a tiny model's decode).
inline bool cpu_avx512_active() {
  const int v = detail::g_avx512.load(std::memory_order_relaxed);
  return (v < 0 ? detail::avx512_from_env_once() : v) == 1;
}

// The target of every AVX-512 kernel (called only where cpu_avx512_active()), and
// the warnings GCC 12 gives inside its own AVX-512 intrinsics (their "undefined"
// pass-through operands), silenced between DFL_AVX512_BEGIN and DFL_AVX512_END.
#define DFL_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")))
#define DFL_AVX512_BEGIN \
  _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"") \
      _Pragma("GCC diagnostic ignored \"-Wuninitialized\"")
#define DFL_AVX512_END _Pragma("GCC diagnostic pop")

#ifdef DFL_AVX2
inline __m256i load256(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
#endif

}  // namespace dfl
