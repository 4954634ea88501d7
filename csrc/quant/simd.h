// simd.h — the CPU kernels' one switch between their AVX2 and scalar code, and
// the small helpers the kernel files share.
#pragma once
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

#ifdef DFL_AVX2
inline __m256i load256(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
#endif

}  // namespace dfl
