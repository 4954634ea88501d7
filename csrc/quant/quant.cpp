// quant.cpp — reference dequantizers, activation/KV quantizers, the type table.
//
// The dequantizers follow the block layouts in blocks.h literally, one output
// element at a time; they are the reference every faster kernel (AVX2 dots in
// dot_cpu.cpp, CUDA later) is tested against, and are checked bit-exactly
// against gguf-py's dequantize in tests/test_quant.py.
#include "quant/quant.h"
#include "quant/simd.h"

#include <cmath>


namespace dfl {

const TypeTraits* type_traits(uint32_t type) {
  static const TypeTraits f32{"F32", 1, 4}, f16{"F16", 1, 2}, bf16{"BF16", 1, 2},
      q4_0{"Q4_0", QK4_0, sizeof(block_q4_0)}, q8_0{"Q8_0", QK8_0, sizeof(block_q8_0)},
      q4_k{"Q4_K", QK_K, sizeof(block_q4_K)}, q5_k{"Q5_K", QK_K, sizeof(block_q5_K)},
      q6_k{"Q6_K", QK_K, sizeof(block_q6_K)};
  switch ((DType)type) {
    case DType::F32: return &f32;
    case DType::F16: return &f16;
    case DType::BF16: return &bf16;
    case DType::Q4_0: return &q4_0;
    case DType::Q8_0: return &q8_0;
    case DType::Q4_K: return &q4_k;
    case DType::Q5_K: return &q5_k;
    case DType::Q6_K: return &q6_k;
  }
  return nullptr;
}

bool dtype_supported(uint32_t type) { return type_traits(type) != nullptr; }

bool dtype_is_quantized(DType t) {
  return t == DType::Q4_0 || t == DType::Q8_0 || t == DType::Q4_K || t == DType::Q5_K ||
         t == DType::Q6_K;
}

static void dequant_q4_0(const block_q4_0* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += QK4_0) {
    float d = f16_to_f32(b[i].d);
    for (int j = 0; j < 16; ++j) {
      y[j] = d * (float)((b[i].qs[j] & 15) - 8);
      y[j + 16] = d * (float)((b[i].qs[j] >> 4) - 8);
    }
  }
}

static void dequant_q8_0(const block_q8_0* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += QK8_0) {
    float d = f16_to_f32(b[i].d);
    for (int j = 0; j < 32; ++j) y[j] = d * (float)b[i].qs[j];
  }
}

// Q4_K and Q5_K share the sub-block structure; qh == nullptr for Q4_K.
static void dequant_k45(float d, float dmin, const uint8_t* sc, const uint8_t* qs,
                        const uint8_t* qh, float* y) {
  for (int c = 0; c < 4; ++c) {
    uint8_t s0, m0, s1, m1;
    kquant_scale_min(sc, 2 * c, &s0, &m0);
    kquant_scale_min(sc, 2 * c + 1, &s1, &m1);
    float d0 = d * s0, mm0 = dmin * m0, d1 = d * s1, mm1 = dmin * m1;
    for (int l = 0; l < 32; ++l) {
      int lo = qs[32 * c + l] & 15, hi = qs[32 * c + l] >> 4;
      if (qh) {
        lo += ((qh[l] >> (2 * c)) & 1) << 4;
        hi += ((qh[l] >> (2 * c + 1)) & 1) << 4;
      }
      y[64 * c + l] = d0 * (float)lo - mm0;
      y[64 * c + 32 + l] = d1 * (float)hi - mm1;
    }
  }
}

static void dequant_q6_k(const block_q6_K* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += QK_K) {
    float d = f16_to_f32(b[i].d);
    for (int n = 0; n < 2; ++n) {
      const uint8_t* ql = b[i].ql + 64 * n;
      const uint8_t* qh = b[i].qh + 32 * n;
      const int8_t* sc = b[i].scales + 8 * n;
      float* o = y + 128 * n;
      for (int l = 0; l < 32; ++l) {
        int s = l / 16;
        int q1 = (int)((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4)) - 32;
        int q2 = (int)((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
        int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        o[l] = d * (float)sc[s] * (float)q1;
        o[l + 32] = d * (float)sc[s + 2] * (float)q2;
        o[l + 64] = d * (float)sc[s + 4] * (float)q3;
        o[l + 96] = d * (float)sc[s + 6] * (float)q4;
      }
    }
  }
}

void dequantize_row(DType t, const void* src, float* y, int64_t n) {
  switch (t) {
    case DType::F32: std::memcpy(y, src, n * 4); return;
    case DType::F16: {
      const uint16_t* h = (const uint16_t*)src;
      for (int64_t i = 0; i < n; ++i) y[i] = f16_to_f32(h[i]);
      return;
    }
    case DType::BF16: {
      const uint16_t* h = (const uint16_t*)src;
      for (int64_t i = 0; i < n; ++i) y[i] = bf16_to_f32(h[i]);
      return;
    }
    case DType::Q4_0: dequant_q4_0((const block_q4_0*)src, y, n / QK4_0); return;
    case DType::Q8_0: dequant_q8_0((const block_q8_0*)src, y, n / QK8_0); return;
    case DType::Q4_K: {
      const block_q4_K* b = (const block_q4_K*)src;
      for (int64_t i = 0; i < n / QK_K; ++i)
        dequant_k45(f16_to_f32(b[i].d), f16_to_f32(b[i].dmin), b[i].scales, b[i].qs, nullptr,
                    y + i * QK_K);
      return;
    }
    case DType::Q5_K: {
      const block_q5_K* b = (const block_q5_K*)src;
      for (int64_t i = 0; i < n / QK_K; ++i)
        dequant_k45(f16_to_f32(b[i].d), f16_to_f32(b[i].dmin), b[i].scales, b[i].qs, b[i].qh,
                    y + i * QK_K);
      return;
    }
    case DType::Q6_K: dequant_q6_k((const block_q6_K*)src, y, n / QK_K); return;
  }
}

int act_block(DType t) { return (t == DType::Q4_K || t == DType::Q5_K || t == DType::Q6_K) ? 256 : 32; }

// The scalar loop is the definition; the AVX2 one computes the same values
// (max is exact, x * id is one rounding either way, cvtps rounds to nearest even
// like nearbyint, integer sums are exact).
void quantize_act_row(const float* x, int8_t* q, float* dd, int16_t* bsum, int64_t n, int block) {
  for (int64_t b = 0; b < n / block; ++b, x += block, q += block) {
#ifdef DFL_AVX2
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 mx = _mm256_setzero_ps();
    for (int j = 0; j < block; j += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
#else
    float amax = 0.f;
    for (int j = 0; j < block; ++j) amax = std::fmax(amax, std::fabs(x[j]));
#endif
    const float d = amax / 127.f;
    const float id = d > 0.f ? 1.f / d : 0.f;
    for (int k = 0; k < block / 32; ++k) {
#ifdef DFL_AVX2
      const __m256 idv = _mm256_set1_ps(id);
      __m256i v[4];
      for (int c = 0; c < 4; ++c) v[c] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 32 * k + 8 * c), idv));
      const __m256i packed = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3])),
          _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256((__m256i*)(q + 32 * k), packed);
      auto sum8 = [](__m256i a) {
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        return _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1)));
      };
      const int half = sum8(_mm256_add_epi32(v[0], v[1]));
      const int sum = half + sum8(_mm256_add_epi32(v[2], v[3]));
#else
      int sum = 0;
      int half = 0;
      for (int j = 32 * k; j < 32 * k + 32; ++j) {
        int v = (int)std::nearbyint(x[j] * id);
        q[j] = (int8_t)v;
        sum += v;
        if (j == 32 * k + 15) half = sum;
      }
#endif
      if (bsum) {
        bsum[b * (block / 16) + 2 * k] = (int16_t)half;            // first 16 values
        bsum[b * (block / 16) + 2 * k + 1] = (int16_t)(sum - half);  // last 16
      }
    }
    dd[b] = d;
  }
}

void quantize_row(DType t, const float* x, void* dst, int64_t n) {
  switch (t) {
    case DType::F32: std::memcpy(dst, x, n * 4); return;
    case DType::F16: {
      uint16_t* h = (uint16_t*)dst;
      for (int64_t i = 0; i < n; ++i) h[i] = f32_to_f16(x[i]);
      return;
    }
    case DType::BF16: {  // round to nearest even
      uint16_t* h = (uint16_t*)dst;
      for (int64_t i = 0; i < n; ++i) {
        uint32_t u;
        std::memcpy(&u, &x[i], 4);
        h[i] = (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
      }
      return;
    }
    case DType::Q8_0: {
      block_q8_0* b = (block_q8_0*)dst;
      for (int64_t i = 0; i < n / 32; ++i, x += 32) {
        float amax = 0.f;
        for (int j = 0; j < 32; ++j) amax = std::fmax(amax, std::fabs(x[j]));
        float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        b[i].d = f32_to_f16(d);
        for (int j = 0; j < 32; ++j) b[i].qs[j] = (int8_t)std::nearbyint(x[j] * id);
      }
      return;
    }
    case DType::Q4_0: {
      // Scale from the signed value of largest magnitude so it maps to -8.
      block_q4_0* b = (block_q4_0*)dst;
      for (int64_t i = 0; i < n / 32; ++i, x += 32) {
        float amax = 0.f, vmax = 0.f;
        for (int j = 0; j < 32; ++j)
          if (std::fabs(x[j]) > amax) { amax = std::fabs(x[j]); vmax = x[j]; }
        float d = vmax / -8.f, id = d != 0.f ? 1.f / d : 0.f;
        b[i].d = f32_to_f16(d);
        for (int j = 0; j < 16; ++j) {
          int q0 = (int)(x[j] * id + 8.5f), q1 = (int)(x[j + 16] * id + 8.5f);
          q0 = q0 < 0 ? 0 : (q0 > 15 ? 15 : q0);
          q1 = q1 < 0 ? 0 : (q1 > 15 ? 15 : q1);
          b[i].qs[j] = (uint8_t)(q0 | (q1 << 4));
        }
      }
      return;
    }
    default: return;  // K-quants are never written by the engine
  }
}

}  // namespace dfl
