// dot_cpu.cpp — one weight row times up to 4 activation rows, for the 32-value
// formats (Q8_0, Q4_0) and float weights; K-quants live in gemm_kquant.cpp.
//
// AVX2/FMA kernels when the compiler targets them, a scalar fallback
// otherwise.  Quantised formats multiply int8 activations (32 values per f32
// scale) with the weight's integer quants.  A token sees exactly the same
// operations in the same order whatever the batch (batch invariance), and
// Q8_0 / Q4_0 take the same float steps on every build and on CUDA:
//
//   isum_i  = sum_j wq_ij * xq_ij         block i's exact integer sum (Q4_0: wq = nibble - 8,
//                                         as sum nibble * xq - 8 * sum xq)
//   lane_l  = fma(dw_i * xd_i, float(isum_i), lane_l)   for l = i % 8, blocks in k order
//   out     = ((lane_0 + lane_4) + (lane_2 + lane_6)) + ((lane_1 + lane_5) + (lane_3 + lane_7))
//
// Eight chains by block index because every fast form computes whole block
// sums: AVX2 reduces 8 blocks' sums into one vector and takes one fma for the
// 8 chains, a CUDA tensor-core instruction sums a whole block, the scalar loop
// and the dp4a matvec one block at a time.  dot_row_q_reference writes the
// definition one output at a time.
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "quant/quant.h"
#include "quant/simd.h"
#include "util/error.h"


namespace dfl {

bool cpu_avx512_supported() {
#ifdef DFL_AVX2
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512vnni");
  return has;
#else
  return false;
#endif
}

namespace {
bool avx512_from_env() {
  const char* e = std::getenv("DFLASH27B_CPU_AVX512");
  return cpu_avx512_supported() && !(e && std::strcmp(e, "0") == 0);
}
}  // namespace

namespace detail {
std::atomic<int> g_avx512{-1};
int avx512_from_env_once() {
  const int v = avx512_from_env() ? 1 : 0;
  g_avx512.store(v, std::memory_order_relaxed);
  return v;
}
}  // namespace detail

void set_cpu_avx512(int mode) {
  if (mode < -1 || mode > 1) fail("AVX-512 mode %d: use 1 (on), 0 (off) or -1 (as DFLASH27B_CPU_AVX512)", mode);
#ifdef DFL_AVX2
  if (mode == 1 && !cpu_avx512_supported()) fail("AVX-512 kernels: this CPU lacks AVX-512 F/BW/DQ/VL/VNNI");
#else
  if (mode == 1) fail("AVX-512 kernels: this build has no AVX2 kernels");
#endif
  detail::g_avx512.store(mode < 0 ? (avx512_from_env() ? 1 : 0) : mode, std::memory_order_relaxed);
}

const char* simd_name() {
#ifdef DFL_AVX2
  return cpu_avx512_active() ? "avx2+avx512" : "avx2";
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
// The 8 chains' final sum, in the order of the AVX2 horizontal add.
static inline float sum_chains(const float l[8]) {
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

template <DType T>
using Block32 = std::conditional_t<T == DType::Q8_0, block_q8_0, block_q4_0>;

// Block i's exact integer sum against token x.
template <DType T>
static inline int block32_isum(const Block32<T>& b, const ActRow& x, int64_t i) {
  const int8_t* xq = x.q + 32 * i;
  int s = 0;
  if constexpr (T == DType::Q8_0) {
    for (int j = 0; j < 32; ++j) s += b.qs[j] * xq[j];
  } else {
    for (int j = 0; j < 16; ++j) s += (b.qs[j] & 15) * xq[j] + (b.qs[j] >> 4) * xq[j + 16];
    s -= 8 * (x.bsum[2 * i] + x.bsum[2 * i + 1]);
  }
  return s;
}

// The definition, one output at a time (tests and the scalar build).
template <DType T>
static float dot_block32_reference(const Block32<T>* w, const ActRow& x, int64_t nb) {
  float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int64_t i = 0; i < nb; ++i)
    lane[i % 8] = std::fma(fp16(w[i].d) * x.d[i], (float)block32_isum<T>(w[i], x, i), lane[i % 8]);
  return sum_chains(lane);
}

#ifdef DFL_AVX2
// Lane k of the result = the sum of p[k]'s 8 lanes (exact).
static inline __m256i sum_lanes8(const __m256i p[8]) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// Blocks i0 .. i0 + 7 into the NT tokens' chain vectors: lane k of acc[t] is
// chain (i0 + k) % 8 = k, since groups start at multiples of 8.  A short last
// group (nk < 8 blocks) reads zero-padded copies and leaves the chains it has
// no block for untouched.
template <DType T, int NT, bool kFull>
static inline void block32_group(const Block32<T>* w, const ActRow* x, int64_t i0, int nk, __m256* acc) {
  const Block32<T>* g = w + i0;
  __m256i wq[8];  // Q8_0 as stored, Q4_0 nibbles 0..15 (values 0-15 low, 16-31 high)
  const __m128i m4 = _mm_set1_epi8(15);
  for (int k = 0; k < 8; ++k) {
    if (!kFull && k >= nk) {
      wq[k] = _mm256_setzero_si256();
    } else if constexpr (T == DType::Q8_0) {
      wq[k] = load256(g[k].qs);
    } else {
      const __m128i q = _mm_loadu_si128((const __m128i*)g[k].qs);
      wq[k] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
    }
  }
  auto d_of = [&](int k) { return kFull || k < nk ? (short)g[k].d : (short)0; };
  const __m256 dw = _mm256_cvtph_ps(
      _mm_setr_epi16(d_of(0), d_of(1), d_of(2), d_of(3), d_of(4), d_of(5), d_of(6), d_of(7)));
  for (int t = 0; t < NT; ++t) {
    __m256i p[8];
    for (int k = 0; k < 8; ++k) {
      if (!kFull && k >= nk) {
        p[k] = _mm256_setzero_si256();
        continue;
      }
      const __m256i xk = load256(x[t].q + 32 * (i0 + k));
      p[k] = T == DType::Q8_0 ? dot_s8s8(wq[k], xk) : dot_u8s8(wq[k], xk);
    }
    __m256i isum = sum_lanes8(p);
    __m256 xd;
    __m256i bs = _mm256_setzero_si256();
    if constexpr (kFull) {
      xd = _mm256_loadu_ps(x[t].d + i0);
      if (T == DType::Q4_0) bs = load256(x[t].bsum + 2 * i0);
    } else {
      alignas(32) float xdp[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      alignas(32) int16_t bsp[16] = {0};
      for (int k = 0; k < nk; ++k) xdp[k] = x[t].d[i0 + k];
      for (int k = 0; k < 2 * nk; ++k) bsp[k] = x[t].bsum[2 * i0 + k];
      xd = _mm256_load_ps(xdp);
      bs = _mm256_load_si256((const __m256i*)bsp);
    }
    if constexpr (T == DType::Q4_0)  // - 8 * sum xq, from the activation's 16-value sums
      isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(_mm256_madd_epi16(bs, _mm256_set1_epi16(1)), 3));
    const __m256 next = _mm256_fmadd_ps(_mm256_mul_ps(dw, xd), _mm256_cvtepi32_ps(isum), acc[t]);
    if constexpr (kFull) {
      acc[t] = next;
    } else {
      const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(nk), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      acc[t] = _mm256_blendv_ps(acc[t], next, _mm256_castsi256_ps(keep));
    }
  }
}
#endif

template <DType T, int NT>
static void dot_block32(const Block32<T>* w, const ActRow* x, int64_t nb, float* out) {
#ifdef DFL_AVX2
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  int64_t i0 = 0;
  for (; i0 + 8 <= nb; i0 += 8) block32_group<T, NT, true>(w, x, i0, 8, acc);
  if (i0 < nb) block32_group<T, NT, false>(w, x, i0, (int)(nb - i0), acc);
  for (int t = 0; t < NT; ++t) {
    alignas(32) float lane[8];
    _mm256_store_ps(lane, acc[t]);
    out[t] = sum_chains(lane);
  }
#else
  for (int t = 0; t < NT; ++t) out[t] = dot_block32_reference<T>(w, x[t], nb);
#endif
}

template <int NT>
static void dot_q_nt(DType t, const void* w, const ActRow* x, int64_t n, float* out) {
  switch (t) {
    case DType::Q8_0: dot_block32<DType::Q8_0, NT>((const block_q8_0*)w, x, n / QK8_0, out); return;
    case DType::Q4_0: dot_block32<DType::Q4_0, NT>((const block_q4_0*)w, x, n / QK4_0, out); return;
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

float dot_row_q_reference(DType t, const void* w, const ActRow& x, int64_t n) {
  switch (t) {
    case DType::Q8_0: return dot_block32_reference<DType::Q8_0>((const block_q8_0*)w, x, n / QK8_0);
    case DType::Q4_0: return dot_block32_reference<DType::Q4_0>((const block_q4_0*)w, x, n / QK4_0);
    default: fail("dot_row_q_reference: %s is not Q8_0 or Q4_0", type_traits((uint32_t)t)->name);
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

#ifdef DFL_AVX2
// ---- AVX-512 (where cpu_avx512_active): the same operations as the AVX2 loops, twice as wide ----
DFL_AVX512_BEGIN
DFL_AVX512 static inline __m512 load_f16x(DType t, const void* wv, int64_t k) {  // 16 values as f32
  if (t == DType::F32) return _mm512_loadu_ps((const float*)wv + k);
  const __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)wv + k));
  if (t == DType::F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// dot_f for M rows of x against one weight row read once: dot_f's chains a0, a1 are the two halves
// of A (values i..i+15 of each 32), a2, a3 those of B, and they meet as dot_f's do.
template <int M>
DFL_AVX512 static void dot_f_rows512(DType t, const void* wv, const float* x, int64_t x_stride, int64_t n,
                                       float* out) {
  __m512 A[M], B[M];
  for (int j = 0; j < M; ++j) A[j] = B[j] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 w0 = load_f16x(t, wv, i), w1 = load_f16x(t, wv, i + 16);
    for (int j = 0; j < M; ++j) {
      const float* xj = x + (int64_t)j * x_stride + i;
      A[j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xj), A[j]);
      B[j] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xj + 16), B[j]);
    }
  }
  for (int j = 0; j < M; ++j) {
    const __m256 s01 = _mm256_add_ps(_mm512_castps512_ps256(A[j]), _mm512_extractf32x8_ps(A[j], 1));
    const __m256 s23 = _mm256_add_ps(_mm512_castps512_ps256(B[j]), _mm512_extractf32x8_ps(B[j], 1));
    out[j] = hsum(_mm256_add_ps(s01, s23)) + dot_f_tail(t, wv, x + (int64_t)j * x_stride, i, n);
  }
}

// axpy_rows' vector part: returns how many outputs (from the first) it took.
DFL_AVX512 static int64_t axpy_rows512(const float* const* v, const float* p, int ns, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 128 <= n; i += 128) {
    __m512 acc[8];
    for (int c = 0; c < 8; ++c) acc[c] = _mm512_loadu_ps(out + i + 16 * c);
    for (int s = 0; s < ns; ++s) {
      const __m512 ps = _mm512_set1_ps(p[s]);
      const float* vs = v[s] + i;
      for (int c = 0; c < 8; ++c) acc[c] = _mm512_add_ps(acc[c], _mm512_mul_ps(ps, _mm512_loadu_ps(vs + 16 * c)));
    }
    for (int c = 0; c < 8; ++c) _mm512_storeu_ps(out + i + 16 * c, acc[c]);
  }
  for (; i + 16 <= n; i += 16) {
    __m512 acc = _mm512_loadu_ps(out + i);
    for (int s = 0; s < ns; ++s) acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_set1_ps(p[s]), _mm512_loadu_ps(v[s] + i)));
    _mm512_storeu_ps(out + i, acc);
  }
  return i;
}
DFL_AVX512_END
#endif

void dot_f_multi(DType t, const void* wv, const float* x, int64_t x_stride, int nt, int64_t n, float* out) {
  int k = 0;
#ifdef DFL_AVX2
  if (cpu_avx512_active()) {  // 4 rows of x a pass over the weight row
    for (; k + 4 <= nt; k += 4) dot_f_rows512<4>(t, wv, x + (int64_t)k * x_stride, x_stride, n, out + k);
    const float* xk = x + (int64_t)k * x_stride;
    switch (nt - k) {
      case 3: return dot_f_rows512<3>(t, wv, xk, x_stride, n, out + k);
      case 2: return dot_f_rows512<2>(t, wv, xk, x_stride, n, out + k);
      case 1: return dot_f_rows512<1>(t, wv, xk, x_stride, n, out + k);
      default: return;
    }
  }
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

void axpy_rows(const float* const* v, const float* p, int ns, float* out, int64_t n) {
  int64_t i = 0;
#ifdef DFL_AVX2
  if (cpu_avx512_active()) i = axpy_rows512(v, p, ns, out, n);
  // 64 outputs stay in registers through all rows: one load and store of out per block of rows
  for (; i + 64 <= n; i += 64) {
    __m256 acc[8];
    for (int c = 0; c < 8; ++c) acc[c] = _mm256_loadu_ps(out + i + 8 * c);
    for (int s = 0; s < ns; ++s) {
      const __m256 ps = _mm256_set1_ps(p[s]);
      const float* vs = v[s] + i;
      for (int c = 0; c < 8; ++c) acc[c] = _mm256_add_ps(acc[c], _mm256_mul_ps(ps, _mm256_loadu_ps(vs + 8 * c)));
    }
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(out + i + 8 * c, acc[c]);
  }
#endif
  for (; i < n; ++i) {
    float o = out[i];
    for (int s = 0; s < ns; ++s) o += p[s] * v[s][i];
    out[i] = o;
  }
}

}  // namespace dfl
