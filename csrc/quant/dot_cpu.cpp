// dot_cpu.cpp — one weight row times one activation row, per format.
//
// AVX2/FMA kernels when the compiler targets them, a scalar fallback
// otherwise.  Quantised formats multiply int8 activation blocks (32 values,
// one f32 scale) with the weight's integer quants using maddubs/madd, then
// scale in float once per 32 values (per 16 for Q6_K's scales, folded into
// the integer madd).  Offsets (Q4_0's -8, K-quant mins) are applied through
// the activation block's precomputed scaled sum.  Each function's reduction
// order is fixed by the row length alone.
#include <cmath>

#include "quant/quant.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define DFL_AVX2 1
#endif

namespace dfl {

const char* simd_name() {
#ifdef DFL_AVX2
  return "avx2";
#else
  return "scalar";
#endif
}

#ifdef DFL_AVX2
static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// Sum of 32 products u8*s8 as 8 int32 lanes (u8 values must be < 128 or the
// pairwise int16 sums could saturate; every caller respects that).
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
static inline __m256i dot_s8s8(__m256i a, __m256i b) {
  return dot_u8s8(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
}
#endif

static float dot_q8_0(const block_q8_0* w, const block_q8_act* x, int64_t nb) {
#ifdef DFL_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    __m256i p = dot_s8s8(_mm256_loadu_si256((const __m256i*)w[i].qs),
                         _mm256_loadu_si256((const __m256i*)x[i].qs));
    acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_to_f32(w[i].d) * x[i].d), _mm256_cvtepi32_ps(p), acc);
  }
  return hsum(acc);
#else
  float acc = 0.f;
  for (int64_t i = 0; i < nb; ++i) {
    int s = 0;
    for (int j = 0; j < 32; ++j) s += w[i].qs[j] * x[i].qs[j];
    acc += f16_to_f32(w[i].d) * x[i].d * (float)s;
  }
  return acc;
#endif
}

static float dot_q4_0(const block_q4_0* w, const block_q8_act* x, int64_t nb) {
  float off = 0.f;
#ifdef DFL_AVX2
  __m256 acc = _mm256_setzero_ps();
  const __m128i m4 = _mm_set1_epi8(15);
  for (int64_t i = 0; i < nb; ++i) {
    __m128i q = _mm_loadu_si128((const __m128i*)w[i].qs);
    __m256i wq = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
    __m256i p = dot_u8s8(wq, _mm256_loadu_si256((const __m256i*)x[i].qs));
    float dw = f16_to_f32(w[i].d);
    acc = _mm256_fmadd_ps(_mm256_set1_ps(dw * x[i].d), _mm256_cvtepi32_ps(p), acc);
    off += dw * x[i].s;
  }
  return hsum(acc) - 8.f * off;
#else
  float acc = 0.f;
  for (int64_t i = 0; i < nb; ++i) {
    int s = 0;
    for (int j = 0; j < 16; ++j)
      s += (w[i].qs[j] & 15) * x[i].qs[j] + (w[i].qs[j] >> 4) * x[i].qs[j + 16];
    float dw = f16_to_f32(w[i].d);
    acc += dw * x[i].d * (float)s;
    off += dw * x[i].s;
  }
  return acc - 8.f * off;
#endif
}

// Q4_K (qh == nullptr) and Q5_K: 8 sub-blocks of 32 per super-block, each
// aligned with one activation block.
static float dot_k45(const uint8_t* base, size_t bstride, size_t qs_off, size_t qh_off, bool has_qh,
                     const block_q8_act* x, int64_t nb) {
  float off = 0.f;
#ifdef DFL_AVX2
  __m256 acc = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(15), b16 = _mm256_set1_epi8(16);
#else
  float acc = 0.f;
#endif
  for (int64_t i = 0; i < nb; ++i, x += 8) {
    const uint8_t* blk = base + i * bstride;
    uint16_t dh, dminh;
    std::memcpy(&dh, blk, 2);
    std::memcpy(&dminh, blk + 2, 2);
    const float d = f16_to_f32(dh), dmin = f16_to_f32(dminh);
    const uint8_t* sc = blk + 4;
    const uint8_t* qs = blk + qs_off;
    const uint8_t* qh = blk + qh_off;
    uint8_t s[8], m[8];
    for (int k = 0; k < 8; ++k) kquant_scale_min(sc, k, &s[k], &m[k]);
    for (int k = 0; k < 8; ++k) off += dmin * (float)m[k] * x[k].s;
#ifdef DFL_AVX2
    __m256i qhv = has_qh ? _mm256_loadu_si256((const __m256i*)qh) : _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      __m256i q = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
      __m256i lo = _mm256_and_si256(q, m4);
      __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
      if (has_qh) {
        __m256i bl = _mm256_set1_epi8((char)(1 << (2 * c))), bh = _mm256_set1_epi8((char)(1 << (2 * c + 1)));
        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qhv, bl), bl), b16));
        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qhv, bh), bh), b16));
      }
      __m256i plo = dot_u8s8(lo, _mm256_loadu_si256((const __m256i*)x[2 * c].qs));
      __m256i phi = dot_u8s8(hi, _mm256_loadu_si256((const __m256i*)x[2 * c + 1].qs));
      acc = _mm256_fmadd_ps(_mm256_set1_ps(d * (float)s[2 * c] * x[2 * c].d), _mm256_cvtepi32_ps(plo), acc);
      acc = _mm256_fmadd_ps(_mm256_set1_ps(d * (float)s[2 * c + 1] * x[2 * c + 1].d), _mm256_cvtepi32_ps(phi), acc);
    }
#else
    for (int c = 0; c < 4; ++c) {
      int slo = 0, shi = 0;
      for (int l = 0; l < 32; ++l) {
        int lo = qs[32 * c + l] & 15, hi = qs[32 * c + l] >> 4;
        if (has_qh) {
          lo += ((qh[l] >> (2 * c)) & 1) << 4;
          hi += ((qh[l] >> (2 * c + 1)) & 1) << 4;
        }
        slo += lo * x[2 * c].qs[l];
        shi += hi * x[2 * c + 1].qs[l];
      }
      acc += d * (float)s[2 * c] * x[2 * c].d * (float)slo;
      acc += d * (float)s[2 * c + 1] * x[2 * c + 1].d * (float)shi;
    }
#endif
  }
#ifdef DFL_AVX2
  return hsum(acc) - off;
#else
  return acc - off;
#endif
}

static float dot_q6_k(const block_q6_K* w, const block_q8_act* x, int64_t nb) {
#ifdef DFL_AVX2
  __m256 acc = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3), b32 = _mm256_set1_epi8(32);
  for (int64_t i = 0; i < nb; ++i) {
    const float d = f16_to_f32(w[i].d);
    for (int n = 0; n < 2; ++n, x += 4) {
      __m256i ql0 = _mm256_loadu_si256((const __m256i*)(w[i].ql + 64 * n));
      __m256i ql1 = _mm256_loadu_si256((const __m256i*)(w[i].ql + 64 * n + 32));
      __m256i qh = _mm256_loadu_si256((const __m256i*)(w[i].qh + 32 * n));
      __m256i q[4];
      q[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4));
      q[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4));
      q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4));
      q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4));
      const int8_t* sc = w[i].scales + 8 * n;
      for (int j = 0; j < 4; ++j) {
        __m256i wq = _mm256_sub_epi8(q[j], b32);
        __m256i xq = _mm256_loadu_si256((const __m256i*)x[j].qs);
        __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xq, wq));
        __m256i scv = _mm256_set_m128i(_mm_set1_epi16(sc[2 * j + 1]), _mm_set1_epi16(sc[2 * j]));
        __m256i p = _mm256_madd_epi16(p16, scv);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d * x[j].d), _mm256_cvtepi32_ps(p), acc);
      }
    }
  }
  return hsum(acc);
#else
  float acc = 0.f;
  for (int64_t i = 0; i < nb; ++i) {
    const float d = f16_to_f32(w[i].d);
    for (int n = 0; n < 2; ++n, x += 4) {
      const uint8_t* ql = w[i].ql + 64 * n;
      const uint8_t* qh = w[i].qh + 32 * n;
      const int8_t* sc = w[i].scales + 8 * n;
      for (int j = 0; j < 4; ++j) {
        int sum = 0;
        for (int l = 0; l < 32; ++l) {
          int lowsrc = (j & 1) ? ql[l + 32] : ql[l];
          int low = (j < 2) ? (lowsrc & 15) : (lowsrc >> 4);
          int q = (low | (((qh[l] >> (2 * j)) & 3) << 4)) - 32;
          sum += sc[2 * j + l / 16] * q * x[j].qs[l];
        }
        acc += d * x[j].d * (float)sum;
      }
    }
  }
  return acc;
#endif
}

static float dot_float(DType t, const void* wv, const float* x, int64_t n) {
  int64_t i = 0;
  float tail = 0.f;
#ifdef DFL_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  auto load = [&](int64_t k) -> __m256 {
    if (t == DType::F32) return _mm256_loadu_ps((const float*)wv + k);
    const __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)wv + k));
    if (t == DType::F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  };
  for (; i + 32 <= n; i += 32) {
    a0 = _mm256_fmadd_ps(load(i), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(load(i + 8), _mm256_loadu_ps(x + i + 8), a1);
    a2 = _mm256_fmadd_ps(load(i + 16), _mm256_loadu_ps(x + i + 16), a2);
    a3 = _mm256_fmadd_ps(load(i + 24), _mm256_loadu_ps(x + i + 24), a3);
  }
  float head = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#else
  float head = 0.f;
#endif
  for (; i < n; ++i) {
    float w = t == DType::F32 ? ((const float*)wv)[i]
              : t == DType::F16 ? f16_to_f32(((const uint16_t*)wv)[i])
                                : bf16_to_f32(((const uint16_t*)wv)[i]);
    tail += w * x[i];
  }
  return head + tail;
}

float vec_dot(DType t, const void* w, const void* x, int64_t n) {
  const block_q8_act* xa = (const block_q8_act*)x;
  switch (t) {
    case DType::F32:
    case DType::F16:
    case DType::BF16: return dot_float(t, w, (const float*)x, n);
    case DType::Q8_0: return dot_q8_0((const block_q8_0*)w, xa, n / 32);
    case DType::Q4_0: return dot_q4_0((const block_q4_0*)w, xa, n / 32);
    case DType::Q4_K:
      return dot_k45((const uint8_t*)w, sizeof(block_q4_K), offsetof(block_q4_K, qs), 0, false, xa, n / QK_K);
    case DType::Q5_K:
      return dot_k45((const uint8_t*)w, sizeof(block_q5_K), offsetof(block_q5_K, qs),
                     offsetof(block_q5_K, qh), true, xa, n / QK_K);
    case DType::Q6_K: return dot_q6_k((const block_q6_K*)w, xa, n / QK_K);
  }
  return 0.f;
}

}  // namespace dfl
