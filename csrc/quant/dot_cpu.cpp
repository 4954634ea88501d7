// dot_cpu.cpp — one weight row times up to 4 activation rows, per format.
//
// AVX2/FMA kernels when the compiler targets them, a scalar fallback
// otherwise.  Quantised formats multiply int8 activations (32 values per f32
// scale) with the weight's integer quants through maddubs/madd.  K-quant
// kernels reduce the 8 sub-block sums of a super-block to one int32 vector
// (`reduce8`) and apply the 8 (weight scale x activation scale) factors with
// one vector multiply; offsets (K-quant mins, Q4_0's -8) go through the
// activation's scaled sums.  A weight block is unpacked once and used for up
// to 4 tokens; each token keeps its own accumulators and sees exactly the
// same operations in the same order as when it is alone (batch invariance).
#include <cmath>

#include "quant/quant.h"
#include "util/error.h"

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

// K-quant (scale, min) pairs of a Q4_K/Q5_K super-block as 8 + 8 bytes.
static inline void unpack_k_scales(const uint8_t* sc, uint8_t scales[8], uint8_t mins[8]) {
  uint32_t w0, w1, w2;
  std::memcpy(&w0, sc, 4);
  std::memcpy(&w1, sc + 4, 4);
  std::memcpy(&w2, sc + 8, 4);
  uint32_t s_lo = w0 & 0x3f3f3f3f, m_lo = w1 & 0x3f3f3f3f;
  uint32_t s_hi = (w2 & 0x0f0f0f0f) | (((w0 >> 6) & 0x03030303) << 4);
  uint32_t m_hi = ((w2 >> 4) & 0x0f0f0f0f) | (((w1 >> 6) & 0x03030303) << 4);
  std::memcpy(scales, &s_lo, 4);
  std::memcpy(scales + 4, &s_hi, 4);
  std::memcpy(mins, &m_lo, 4);
  std::memcpy(mins + 4, &m_hi, 4);
}

#ifdef DFL_AVX2
// Hardware f16 -> f32 (F16C); exact, like the scalar f16_to_f32.
static inline float fp16(uint16_t h) { return _cvtsh_ss(h); }
#else
static inline float fp16(uint16_t h) { return f16_to_f32(h); }
#endif

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
// [sum(v0), ..., sum(v7)] as one int32 vector.
static inline __m256i reduce8(const __m256i* v) {
  __m256i s01 = _mm256_hadd_epi32(v[0], v[1]), s23 = _mm256_hadd_epi32(v[2], v[3]);
  __m256i s45 = _mm256_hadd_epi32(v[4], v[5]), s67 = _mm256_hadd_epi32(v[6], v[7]);
  __m256i a = _mm256_hadd_epi32(s01, s23), b = _mm256_hadd_epi32(s45, s67);
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}
static inline __m256 bytes_to_ps(const uint8_t* b8) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)b8)));
}
static inline __m256i load256(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
#endif

#ifdef DFL_AVX2
// shuffle masks broadcasting int16 element k of each 128-bit lane to the lane
// and (q6) element 2j to the low lane with 2j+1 to the high lane.
struct BcastMasks {
  __m256i m[8], pair[4];
  BcastMasks() {
    alignas(32) int8_t b[32];
    for (int k = 0; k < 8; ++k) {
      for (int i = 0; i < 32; ++i) b[i] = (int8_t)(2 * k + (i & 1));
      m[k] = _mm256_load_si256((const __m256i*)b);
    }
    for (int j = 0; j < 4; ++j) {
      for (int i = 0; i < 32; ++i) b[i] = (int8_t)(4 * j + (i >= 16 ? 2 : 0) + (i & 1));
      pair[j] = _mm256_load_si256((const __m256i*)b);
    }
  }
};
static const BcastMasks kBcast;
#endif

// ---- Q4_K and Q5_K ---------------------------------------------------------
// Activations: one scale per super-block (act_block == 256), so the 8 scaled
// sub-block sums add up in int32 and are converted once.
template <int NT, bool Q5>
static void dot_k45(const uint8_t* w, const ActRow* x, int64_t nb, float* out) {
  constexpr size_t bsize = Q5 ? sizeof(block_q5_K) : sizeof(block_q4_K);
  constexpr size_t qs_off = Q5 ? offsetof(block_q5_K, qs) : offsetof(block_q4_K, qs);
#ifdef DFL_AVX2
  __m256 acc[NT], accm[NT];
  for (int t = 0; t < NT; ++t) acc[t] = accm[t] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(15), b16 = _mm256_set1_epi8(16);
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* blk = w + i * bsize;
    uint16_t dh, mh;
    std::memcpy(&dh, blk, 2);
    std::memcpy(&mh, blk + 2, 2);
    uint8_t sc[8], mn[8];
    unpack_k_scales(blk + 4, sc, mn);
    const float d = fp16(dh);
    const __m256 dmn = _mm256_mul_ps(_mm256_set1_ps(fp16(mh)), bytes_to_ps(mn));
    const __m128i s16 = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)sc));
    const __m256i s256 = _mm256_set_m128i(s16, s16);
    __m256i lo[4], hi[4], slo[4], shi[4];
    const __m256i qhv = Q5 ? load256(blk + offsetof(block_q5_K, qh)) : _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      __m256i q = load256(blk + qs_off + 32 * c);
      lo[c] = _mm256_and_si256(q, m4);
      hi[c] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
      if (Q5) {
        const __m256i bl = _mm256_set1_epi8((char)(1 << (2 * c))), bh = _mm256_set1_epi8((char)(1 << (2 * c + 1)));
        lo[c] = _mm256_or_si256(lo[c], _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qhv, bl), bl), b16));
        hi[c] = _mm256_or_si256(hi[c], _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qhv, bh), bh), b16));
      }
      slo[c] = _mm256_shuffle_epi8(s256, kBcast.m[2 * c]);
      shi[c] = _mm256_shuffle_epi8(s256, kBcast.m[2 * c + 1]);
    }
    for (int t = 0; t < NT; ++t) {
      const int8_t* xq = x[t].q + i * 256;
      __m256i isum = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const __m256i plo = _mm256_maddubs_epi16(lo[c], load256(xq + 64 * c));
        const __m256i phi = _mm256_maddubs_epi16(hi[c], load256(xq + 64 * c + 32));
        isum = _mm256_add_epi32(isum, _mm256_add_epi32(_mm256_madd_epi16(plo, slo[c]), _mm256_madd_epi16(phi, shi[c])));
      }
      acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * x[t].d[i]), _mm256_cvtepi32_ps(isum), acc[t]);
      accm[t] = _mm256_fmadd_ps(dmn, _mm256_loadu_ps(x[t].s + 8 * i), accm[t]);
    }
  }
  for (int t = 0; t < NT; ++t) out[t] = hsum(acc[t]) - hsum(accm[t]);
#else
  for (int t = 0; t < NT; ++t) {
    float acc = 0.f, accm = 0.f;
    for (int64_t i = 0; i < nb; ++i) {
      const uint8_t* blk = w + i * bsize;
      uint16_t dh, mh;
      std::memcpy(&dh, blk, 2);
      std::memcpy(&mh, blk + 2, 2);
      uint8_t sc[8], mn[8];
      unpack_k_scales(blk + 4, sc, mn);
      const uint8_t* qs = blk + qs_off;
      const uint8_t* qh = Q5 ? blk + offsetof(block_q5_K, qh) : nullptr;
      const int8_t* xq = x[t].q + i * 256;
      int isum = 0;
      for (int c = 0; c < 4; ++c) {
        int slo = 0, shi = 0;
        for (int l = 0; l < 32; ++l) {
          int a = qs[32 * c + l] & 15, b = qs[32 * c + l] >> 4;
          if (Q5) {
            a += ((qh[l] >> (2 * c)) & 1) << 4;
            b += ((qh[l] >> (2 * c + 1)) & 1) << 4;
          }
          slo += a * xq[64 * c + l];
          shi += b * xq[64 * c + 32 + l];
        }
        isum += sc[2 * c] * slo + sc[2 * c + 1] * shi;
      }
      acc += fp16(dh) * x[t].d[i] * (float)isum;
      for (int k = 0; k < 8; ++k) accm += fp16(mh) * mn[k] * x[t].s[8 * i + k];
    }
    out[t] = acc - accm;
  }
#endif
}

// ---- Q6_K -------------------------------------------------------------------
template <int NT>
static void dot_q6_k(const block_q6_K* w, const ActRow* x, int64_t nb, float* out) {
#ifdef DFL_AVX2
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
  for (int64_t i = 0; i < nb; ++i) {
    const float d = fp16(w[i].d);
    __m256i q[8], scv[8];
    for (int n = 0; n < 2; ++n) {
      const __m256i ql0 = load256(w[i].ql + 64 * n), ql1 = load256(w[i].ql + 64 * n + 32);
      const __m256i qh = load256(w[i].qh + 32 * n);
      q[4 * n + 0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4));
      q[4 * n + 1] = _mm256_or_si256(_mm256_and_si256(ql1, m4),
                                     _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4));
      q[4 * n + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                                     _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4));
      q[4 * n + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                     _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4));
      // group j of this half uses scale 2j on its first 16 values and 2j+1 on the rest
      const __m128i s16 = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i*)(w[i].scales + 8 * n)));
      const __m256i s256 = _mm256_set_m128i(s16, s16);
      for (int j = 0; j < 4; ++j) scv[4 * n + j] = _mm256_shuffle_epi8(s256, kBcast.pair[j]);
    }
    // 32 * sum(scale * x) over the 16 sub-blocks, from the activation's sums
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)w[i].scales));
    for (int t = 0; t < NT; ++t) {
      const int8_t* xq = x[t].q + i * 256;
      __m256i isum = _mm256_slli_epi32(
          _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i*)(x[t].bsum + i * 16))), 5);
      isum = _mm256_sub_epi32(_mm256_setzero_si256(), isum);
      for (int g = 0; g < 8; ++g) {
        const __m256i p16 = _mm256_maddubs_epi16(q[g], load256(xq + 32 * g));
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p16, scv[g]));
      }
      acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * x[t].d[i]), _mm256_cvtepi32_ps(isum), acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) out[t] = hsum(acc[t]);
#else
  for (int t = 0; t < NT; ++t) {
    float acc = 0.f;
    for (int64_t i = 0; i < nb; ++i) {
      int isum = 0;
      for (int n = 0; n < 2; ++n) {
        const uint8_t* ql = w[i].ql + 64 * n;
        const uint8_t* qh = w[i].qh + 32 * n;
        const int8_t* sc = w[i].scales + 8 * n;
        for (int j = 0; j < 4; ++j) {
          const int8_t* xq = x[t].q + i * 256 + 128 * n + 32 * j;
          for (int l = 0; l < 32; ++l) {
            int src = (j & 1) ? ql[l + 32] : ql[l];
            int low = (j < 2) ? (src & 15) : (src >> 4);
            int qv = (low | (((qh[l] >> (2 * j)) & 3) << 4)) - 32;
            isum += sc[2 * j + l / 16] * qv * xq[l];
          }
        }
      }
      acc += fp16(w[i].d) * x[t].d[i] * (float)isum;
    }
    out[t] = acc;
  }
#endif
}

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
    case DType::Q4_K: dot_k45<NT, false>((const uint8_t*)w, x, n / QK_K, out); return;
    case DType::Q5_K: dot_k45<NT, true>((const uint8_t*)w, x, n / QK_K, out); return;
    case DType::Q6_K: dot_q6_k<NT>((const block_q6_K*)w, x, n / QK_K, out); return;
    case DType::Q8_0: dot_q8_0<NT>((const block_q8_0*)w, x, n / QK8_0, out); return;
    case DType::Q4_0: dot_q4_0<NT>((const block_q4_0*)w, x, n / QK4_0, out); return;
    default: fail("dot_row_q: %s is not a quantised type", type_traits((uint32_t)t)->name);
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

void axpy_row(DType t, const void* row, float p, float* out, int64_t n, float* tmp) {
  const float* v = (const float*)row;
  if (t != DType::F32) {
#ifdef DFL_AVX2
    if (t == DType::F16 && n % 8 == 0) {  // convert on the fly: same values as dequantize_row
      const uint16_t* h = (const uint16_t*)row;
      const __m256 pv = _mm256_set1_ps(p);
      for (int64_t i = 0; i < n; i += 8) {
        const __m256 w = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + i)));
        _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_loadu_ps(out + i), _mm256_mul_ps(pv, w)));
      }
      return;
    }
#endif
    dequantize_row(t, row, tmp, n);
    v = tmp;
  }
  for (int64_t i = 0; i < n; ++i) out[i] += p * v[i];
}

}  // namespace dfl
