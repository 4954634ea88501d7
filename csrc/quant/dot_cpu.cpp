// dot_cpu.cpp — one weight row times up to 4 activation rows, for the 32-value
// formats (Q8_0, Q4_0) and float weights; K-quants live in gemm_kquant.cpp.
//
// AVX2/FMA kernels when the compiler targets them, a scalar fallback
// otherwise.  Quantised formats multiply int8 activations (32 values per f32
// scale) with the weight's integer quants through maddubs/madd; Q4_0's -8 goes
// through the activation's scaled sums.  A weight block is unpacked once and
// used for up to 4 tokens; each token keeps its own accumulators and sees
// exactly the same operations in the same order as when it is alone (batch
// invariance).
#include <cmath>

#include "quant/quant.h"
#include "quant/simd.h"
#include "util/error.h"


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
// 32 products u8*s8 summed into 8 int32 lanes (u8 < 128 avoids int16 saturation).
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
static inline __m256i dot_s8s8(__m256i a, __m256i b) {
  return dot_u8s8(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
}
#endif

// ---- Q8_0 and Q4_0 ----------------------------------------------------------
template <int NT>
static void dot_q8_0(const block_q8_0* w, const ActRow* x, int64_t nb, float* out) {
#ifdef DFL_AVX2
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const __m256i wq = load256(w[i].qs);
    const float dw = fp16(w[i].d);
    for (int t = 0; t < NT; ++t) {
      const __m256i p = dot_s8s8(wq, load256(x[t].q + 32 * i));
      acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x[t].d[i]), _mm256_cvtepi32_ps(p), acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) out[t] = hsum(acc[t]);
#else
  for (int t = 0; t < NT; ++t) {
    float acc = 0.f;
    for (int64_t i = 0; i < nb; ++i) {
      int s = 0;
      for (int j = 0; j < 32; ++j) s += w[i].qs[j] * x[t].q[32 * i + j];
      acc += fp16(w[i].d) * x[t].d[i] * (float)s;
    }
    out[t] = acc;
  }
#endif
}

template <int NT>
static void dot_q4_0(const block_q4_0* w, const ActRow* x, int64_t nb, float* out) {
  float off[NT];
  for (int t = 0; t < NT; ++t) off[t] = 0.f;
#ifdef DFL_AVX2
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  const __m128i m4 = _mm_set1_epi8(15);
  for (int64_t i = 0; i < nb; ++i) {
    const __m128i q = _mm_loadu_si128((const __m128i*)w[i].qs);
    const __m256i wq = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
    const float dw = fp16(w[i].d);
    for (int t = 0; t < NT; ++t) {
      const __m256i p = dot_u8s8(wq, load256(x[t].q + 32 * i));
      acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x[t].d[i]), _mm256_cvtepi32_ps(p), acc[t]);
      off[t] += dw * x[t].s[i];
    }
  }
  for (int t = 0; t < NT; ++t) out[t] = hsum(acc[t]) - 8.f * off[t];
#else
  for (int t = 0; t < NT; ++t) {
    float acc = 0.f;
    for (int64_t i = 0; i < nb; ++i) {
      const int8_t* xq = x[t].q + 32 * i;
      int s = 0;
      for (int j = 0; j < 16; ++j) s += (w[i].qs[j] & 15) * xq[j] + (w[i].qs[j] >> 4) * xq[j + 16];
      const float dw = fp16(w[i].d);
      acc += dw * x[t].d[i] * (float)s;
      off[t] += dw * x[t].s[i];
    }
    out[t] = acc - 8.f * off[t];
  }
#endif
}

template <int NT>
static void dot_q_nt(DType t, const void* w, const ActRow* x, int64_t n, float* out) {
  switch (t) {
    case DType::Q8_0: dot_q8_0<NT>((const block_q8_0*)w, x, n / QK8_0, out); return;
    case DType::Q4_0: dot_q4_0<NT>((const block_q4_0*)w, x, n / QK4_0, out); return;
    default: fail("dot_row_q: %s is not a 32-value quantised type (K-quants go through gemm_kquant)", type_traits((uint32_t)t)->name);
  }
}

void dot_row_q(DType t, const void* w, const ActRow* x, int nt, int64_t n, float* out) {
  switch (nt) {
    case 1: dot_q_nt<1>(t, w, x, n, out); return;
    case 2: dot_q_nt<2>(t, w, x, n, out); return;
    case 3: dot_q_nt<3>(t, w, x, n, out); return;
    case 4: dot_q_nt<4>(t, w, x, n, out); return;
    default: fail("dot_row_q: %d tokens (1..4 allowed)", nt);
  }
}

// ---- float weights ----------------------------------------------------------
// The scalar tail of a float dot, shared so every caller forms it identically.
static inline float dot_f_tail(DType t, const void* wv, const float* x, int64_t i, int64_t n) {
  float tail = 0.f;
  for (; i < n; ++i) {
    float w = t == DType::F32   ? ((const float*)wv)[i]
              : t == DType::F16 ? fp16(((const uint16_t*)wv)[i])
                                : bf16_to_f32(((const uint16_t*)wv)[i]);
    tail += w * x[i];
  }
  return tail;
}

#ifdef DFL_AVX2
static inline __m256 load_f8(DType t, const void* wv, int64_t k) {
  if (t == DType::F32) return _mm256_loadu_ps((const float*)wv + k);
  const __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)wv + k));
  if (t == DType::F16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

void widen_row(DType t, const void* src, float* dst, int64_t n) {
#ifdef DFL_AVX2
  if (t == DType::F32 || t == DType::F16 || t == DType::BF16) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load_f8(t, src, i));
    const size_t es = t == DType::F32 ? 4 : 2;
    if (i < n) dequantize_row(t, static_cast<const uint8_t*>(src) + i * es, dst + i, n - i);
    return;
  }
#endif
  dequantize_row(t, src, dst, n);
}

float dot_f(DType t, const void* wv, const float* x, int64_t n) {
  int64_t i = 0;
#ifdef DFL_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (; i + 32 <= n; i += 32) {
    a0 = _mm256_fmadd_ps(load_f8(t, wv, i), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(load_f8(t, wv, i + 8), _mm256_loadu_ps(x + i + 8), a1);
    a2 = _mm256_fmadd_ps(load_f8(t, wv, i + 16), _mm256_loadu_ps(x + i + 16), a2);
    a3 = _mm256_fmadd_ps(load_f8(t, wv, i + 24), _mm256_loadu_ps(x + i + 24), a3);
  }
  float head = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#else
  float head = 0.f;
#endif
  return head + dot_f_tail(t, wv, x, i, n);
}

void dot_f_multi(DType t, const void* wv, const float* x, int64_t x_stride, int nt, int64_t n, float* out) {
  int k = 0;
#ifdef DFL_AVX2
  // Two tokens per pass: each weight vector is loaded (and widened) once for both, and each token's
  // accumulators see exactly dot_f's operations in dot_f's order.
  for (; k + 2 <= nt; k += 2) {
    const float* x0 = x + (int64_t)k * x_stride;
    const float* x1 = x0 + x_stride;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
      const __m256 w0 = load_f8(t, wv, i), w1 = load_f8(t, wv, i + 8);
      const __m256 w2 = load_f8(t, wv, i + 16), w3 = load_f8(t, wv, i + 24);
      a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0 + i), a0);
      a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x0 + i + 8), a1);
      a2 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x0 + i + 16), a2);
      a3 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x0 + i + 24), a3);
      b0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x1 + i), b0);
      b1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x1 + i + 8), b1);
      b2 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x1 + i + 16), b2);
      b3 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x1 + i + 24), b3);
    }
    out[k] = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3))) + dot_f_tail(t, wv, x0, i, n);
    out[k + 1] = hsum(_mm256_add_ps(_mm256_add_ps(b0, b1), _mm256_add_ps(b2, b3))) + dot_f_tail(t, wv, x1, i, n);
  }
#endif
  for (; k < nt; ++k) out[k] = dot_f(t, wv, x + (int64_t)k * x_stride, n);
}

void axpy_row(const float* v, float p, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] += p * v[i];
}

}  // namespace dfl
