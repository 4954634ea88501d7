// cpu_ops.cpp — CPU implementations of the row ops used by the forward.
#include "backend/cpu/cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "quant/quant.h"
#include "quant/simd.h"

namespace dfl {

std::vector<ActRow> quantize_activations(ThreadPool& pool, const float* x, int n, int64_t cols, int block,
                                         ActScratch& act) {
  act.reserve((int64_t)n * cols);
  pool.parallel_for(n, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      quantize_act_row(x + t * cols, act.q.data() + t * cols, act.d.data() + t * (cols / 32),
                       act.bsum.data() + t * (cols / 16), cols, block);
  });
  std::vector<ActRow> rows(n);
  for (int t = 0; t < n; ++t)
    rows[t] = ActRow{act.q.data() + (int64_t)t * cols, act.d.data() + (int64_t)t * (cols / 32),
                     act.bsum.data() + (int64_t)t * (cols / 16)};
  return rows;
}

void matmul(ThreadPool& pool, const Weight& W, const float* x, int n, float* y, ActScratch& act) {
  const bool q = dtype_is_quantized(W.type);
  const int64_t cols = W.cols;
  std::vector<ActRow> rows;
  if (q) rows = quantize_activations(pool, x, n, cols, act_block(W.type), act);
  if (gemm_kquant_supported(W.type)) {
    if (q6_panels_wanted(W))  // Q6_K in the kernels' own order, made on first use (quant.h: with_cpu_layout)
      std::call_once(W.cpu_layout->made, [&] {
        std::vector<uint8_t>& b = W.cpu_layout->bytes;
        b.resize(q6_panels_bytes(W));
        pool.parallel_for(W.rows / 4, 16, [&](int64_t p0, int64_t p1) { q6_panels_fill(W, p0, p1, b.data()); });
      });
    // parts in whole 4-row panels
    auto kbody = [&](int64_t r0, int64_t r1) { gemm_kquant(W, r0, r1, rows.data(), n, y); };
    if ((int64_t)W.rows * cols * n < (1 << 16)) kbody(0, W.rows);
    else pool.parallel_for(W.rows, 4, kbody);
    return;
  }
  // Rows in groups of 16 so a group's weights stay in L1 while every token of
  // the batch passes over them, up to kDotMaxTokens tokens per weight unpack.
  const int64_t group = 16;
  const int64_t work = (int64_t)W.rows * cols * n;
  auto body = [&](int64_t r0, int64_t r1) {
    float tmp[kDotMaxTokens];
    for (int64_t g = r0; g < r1; g += group) {
      const int64_t ge = g + group < r1 ? g + group : r1;
      for (int t0 = 0; t0 < n; t0 += kDotMaxTokens) {
        const int nt = n - t0 < kDotMaxTokens ? n - t0 : kDotMaxTokens;
        for (int64_t r = g; r < ge; ++r) {
#if defined(__AVX2__)
          // the next group's row, a row at a time ahead of its use (as the K-quant kernels' Trickle):
          // left to the hardware prefetcher, a 1-token forward of the synthetic 0.8B took 1.18x as long
          // in Q8_0, 1.05x in BF16, the bundled F16 target's 1.2x (2-vCPU Zen 3); more tokens: the same
          if (t0 == 0 && r + group < r1)
            for (size_t off = 0; off < W.row_bytes; off += 64) _mm_prefetch((const char*)W.row(r + group) + off, _MM_HINT_T0);
#endif
          if (q) {
            dot_row_q(W.type, W.row(r), rows.data() + t0, nt, cols, tmp);
          } else {
            dot_f_multi(W.type, W.row(r), x + (int64_t)t0 * cols, cols, nt, cols, tmp);
          }
          for (int k = 0; k < nt; ++k) y[(int64_t)(t0 + k) * W.rows + r] = tmp[k];
        }
      }
    }
  };
  if (work < (1 << 16)) body(0, W.rows);  // too small to be worth waking workers
  else pool.parallel_for(W.rows, group, body);
}

void rmsnorm_rows(const float* x, const float* w, int n, int dim, float eps, float* y) {
  for (int t = 0; t < n; ++t) {
    const float* xr = x + (int64_t)t * dim;
    float* yr = y + (int64_t)t * dim;
    double ss = 0.0;
    for (int i = 0; i < dim; ++i) ss += (double)xr[i] * xr[i];
    float scale = (float)(1.0 / std::sqrt(ss / dim + (double)eps));
    if (w)
      for (int i = 0; i < dim; ++i) yr[i] = xr[i] * scale * w[i];
    else
      for (int i = 0; i < dim; ++i) yr[i] = xr[i] * scale;
  }
}

void rope_neox(float* v, const RopeSpec& r, int64_t pos) {
  const int half = r.n_rot / 2;
  for (int p = 0; p < half; ++p) {
    float c, s;
    rope_cos_sin(r, p, pos, &c, &s);
    float a = v[p], b = v[p + half];
    v[p] = a * c - b * s;
    v[p + half] = a * s + b * c;
  }
}

void embed_row(const Weight& W, int32_t token, float* out) {
  dequantize_row(W.type, W.row(token), out, W.cols);
}

#if defined(__AVX2__)
// exp_poly on N vectors of 8 lanes, the same operations in the same order.  The
// steps are interleaved across the N vectors: one vector's chain of dependent
// operations is long, and N independent chains keep the pipes busy.
template <int N>
static inline void exp_poly8(__m256 (&x)[N]) {
  using namespace exp_poly_c;
  __m256 nan[N], n[N], r[N], p[N];
  for (int v = 0; v < N; ++v) {
    nan[v] = _mm256_cmp_ps(x[v], x[v], _CMP_UNORD_Q);
    x[v] = _mm256_max_ps(_mm256_set1_ps(kLo), x[v]);  // (lo > x) ? lo : x, a NaN x kept
    x[v] = _mm256_min_ps(_mm256_set1_ps(kHi), x[v]);
    n[v] = _mm256_round_ps(_mm256_mul_ps(x[v], _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  for (int v = 0; v < N; ++v) {
    r[v] = _mm256_sub_ps(x[v], _mm256_mul_ps(n[v], _mm256_set1_ps(kLn2Hi)));
    r[v] = _mm256_sub_ps(r[v], _mm256_mul_ps(n[v], _mm256_set1_ps(kLn2Lo)));
    p[v] = _mm256_set1_ps(kP[0]);
  }
  for (int i = 1; i < 6; ++i)
    for (int v = 0; v < N; ++v) p[v] = _mm256_add_ps(_mm256_mul_ps(p[v], r[v]), _mm256_set1_ps(kP[i]));
  const __m256i bias = _mm256_set1_epi32(127);
  for (int v = 0; v < N; ++v) {
    p[v] = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p[v], _mm256_mul_ps(r[v], r[v])), r[v]), _mm256_set1_ps(1.f));
    const __m256i ni = _mm256_cvtps_epi32(n[v]), n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    x[v] = _mm256_blendv_ps(_mm256_mul_ps(_mm256_mul_ps(p[v], f1), f2), x[v], nan[v]);
  }
}

// silu_rows on N vectors at a + i (and b + i).
template <int N>
static inline void silu8(const float* a, const float* b, float* out, int64_t i) {
  const __m256 one = _mm256_set1_ps(1.f), neg0 = _mm256_set1_ps(-0.f);
  __m256 x[N], e[N];
  for (int v = 0; v < N; ++v) {
    x[v] = _mm256_loadu_ps(a + i + 8 * v);
    e[v] = _mm256_xor_ps(x[v], neg0);
  }
  exp_poly8<N>(e);
  for (int v = 0; v < N; ++v) {
    __m256 s = _mm256_div_ps(x[v], _mm256_add_ps(one, e[v]));
    if (b) s = _mm256_mul_ps(s, _mm256_loadu_ps(b + i + 8 * v));
    _mm256_storeu_ps(out + i + 8 * v, s);
  }
}
#endif

#if defined(__AVX2__)
// gate_rows on N vectors at i
template <int N>
static inline void gate8(const float* x, float s, const float* g, float* out, int64_t i) {
  const __m256 one = _mm256_set1_ps(1.f), neg0 = _mm256_set1_ps(-0.f), vs = _mm256_set1_ps(s);
  __m256 e[N];
  for (int v = 0; v < N; ++v) e[v] = _mm256_xor_ps(_mm256_loadu_ps(g + i + 8 * v), neg0);
  exp_poly8<N>(e);
  for (int v = 0; v < N; ++v) {
    const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, e[v]));
    _mm256_storeu_ps(out + i + 8 * v, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * v), vs), sig));
  }
}
#endif

void gate_rows(const float* x, float s, const float* g, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__)
  for (; i + 32 <= n; i += 32) gate8<4>(x, s, g, out, i);
  for (; i + 8 <= n; i += 8) gate8<1>(x, s, g, out, i);
#endif
  for (; i < n; ++i) out[i] = x[i] * s * sigmoid(g[i]);
}

void silu_rows(const float* a, const float* b, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__)
  for (; i + 32 <= n; i += 32) silu8<4>(a, b, out, i);
  for (; i + 8 <= n; i += 8) silu8<1>(a, b, out, i);
#endif
  for (; i < n; ++i) out[i] = b ? silu(a[i]) * b[i] : silu(a[i]);
}

#if defined(__AVX2__)
// delta_rule_cols on 64 columns: 4 zmm sums in flight, each column's operations those of the loop below.
DFL_AVX512 static void delta_rule_cols64(
    const float* S_in, int64_t in_stride, float* S_out, int64_t out_stride, const float* k, const float* v,
    const float* q, float decay, float beta, int dk, float* out, float* delta_out) {
  const __m512 dec = _mm512_set1_ps(decay), vbeta = _mm512_set1_ps(beta);
  __m512 a[4];
  for (int c = 0; c < 4; ++c) a[c] = _mm512_setzero_ps();
  for (int i = 0; i < dk; ++i) {
    const float* Si = S_in + (int64_t)i * in_stride;
    const __m512 ki = _mm512_set1_ps(k[i]);
    for (int c = 0; c < 4; ++c) a[c] = _mm512_add_ps(a[c], _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(Si + 16 * c), dec), ki));
  }
  __m512 d[4], o[4];
  for (int c = 0; c < 4; ++c) {
    d[c] = _mm512_mul_ps(vbeta, _mm512_sub_ps(_mm512_loadu_ps(v + 16 * c), a[c]));
    if (delta_out) _mm512_storeu_ps(delta_out + 16 * c, d[c]);
    o[c] = _mm512_setzero_ps();
  }
  for (int i = 0; i < dk; ++i) {
    const float* Si = S_in + (int64_t)i * in_stride;
    float* So = S_out + (int64_t)i * out_stride;
    const __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]);
    for (int c = 0; c < 4; ++c) {
      const __m512 sv = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(Si + 16 * c), dec), _mm512_mul_ps(ki, d[c]));
      _mm512_storeu_ps(So + 16 * c, sv);
      o[c] = _mm512_add_ps(o[c], _mm512_mul_ps(sv, qi));
    }
  }
  for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out + 16 * c, o[c]);
}
#endif

int delta_block_cols() { return cpu_avx512_active() ? 64 : 32; }

void delta_rule_cols(const float* S_in, int64_t in_stride, float* S_out, int64_t out_stride, const float* k,
                     const float* v, const float* q, float decay, float beta, int dk, int nb, float* out,
                     float* delta_out) {
  // u = (decay S)^T k; delta = beta (v - u); S' = decay S + k delta^T; out = S'^T q.
  // decay * S is formed (one rounding) in both passes rather than stored between them.
  // Every u[j] and out[j] accumulates over i in order, a multiply and an add apiece;
  // the AVX2 loops do exactly that on 8 columns at a time.
#if defined(__AVX2__)
  if (nb == 64 && cpu_avx512_active())
    return delta_rule_cols64(S_in, in_stride, S_out, out_stride, k, v, q, decay, beta, dk, out, delta_out);
  if (nb == 32) {
    const __m256 dec = _mm256_set1_ps(decay), vbeta = _mm256_set1_ps(beta);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int i = 0; i < dk; ++i) {
      const float* Si = S_in + (int64_t)i * in_stride;
      const __m256 ki = _mm256_set1_ps(k[i]);
      a0 = _mm256_add_ps(a0, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(Si), dec), ki));
      a1 = _mm256_add_ps(a1, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(Si + 8), dec), ki));
      a2 = _mm256_add_ps(a2, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(Si + 16), dec), ki));
      a3 = _mm256_add_ps(a3, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(Si + 24), dec), ki));
    }
    // delta = beta (v - u), as the scalar loop below
    const __m256 d0 = _mm256_mul_ps(vbeta, _mm256_sub_ps(_mm256_loadu_ps(v), a0));
    const __m256 d1 = _mm256_mul_ps(vbeta, _mm256_sub_ps(_mm256_loadu_ps(v + 8), a1));
    const __m256 d2 = _mm256_mul_ps(vbeta, _mm256_sub_ps(_mm256_loadu_ps(v + 16), a2));
    const __m256 d3 = _mm256_mul_ps(vbeta, _mm256_sub_ps(_mm256_loadu_ps(v + 24), a3));
    if (delta_out) {
      _mm256_storeu_ps(delta_out, d0);
      _mm256_storeu_ps(delta_out + 8, d1);
      _mm256_storeu_ps(delta_out + 16, d2);
      _mm256_storeu_ps(delta_out + 24, d3);
    }
    __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0;
    for (int i = 0; i < dk; ++i) {
      const float* Si = S_in + (int64_t)i * in_stride;
      float* So = S_out + (int64_t)i * out_stride;
      const __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(q[i]);
      const __m256 s0 = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(Si), dec), _mm256_mul_ps(ki, d0));
      const __m256 s1 = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(Si + 8), dec), _mm256_mul_ps(ki, d1));
      const __m256 s2 = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(Si + 16), dec), _mm256_mul_ps(ki, d2));
      const __m256 s3 = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(Si + 24), dec), _mm256_mul_ps(ki, d3));
      _mm256_storeu_ps(So, s0);
      _mm256_storeu_ps(So + 8, s1);
      _mm256_storeu_ps(So + 16, s2);
      _mm256_storeu_ps(So + 24, s3);
      o0 = _mm256_add_ps(o0, _mm256_mul_ps(s0, qi));
      o1 = _mm256_add_ps(o1, _mm256_mul_ps(s1, qi));
      o2 = _mm256_add_ps(o2, _mm256_mul_ps(s2, qi));
      o3 = _mm256_add_ps(o3, _mm256_mul_ps(s3, qi));
    }
    _mm256_storeu_ps(out, o0);
    _mm256_storeu_ps(out + 8, o1);
    _mm256_storeu_ps(out + 16, o2);
    _mm256_storeu_ps(out + 24, o3);
    return;
  }
#endif
  float u[kDeltaCols], delta[kDeltaCols];
  for (int j = 0; j < nb; ++j) u[j] = 0.f;
  for (int i = 0; i < dk; ++i) {
    const float* Si = S_in + (int64_t)i * in_stride;
    const float ki = k[i];
    for (int j = 0; j < nb; ++j) u[j] += (Si[j] * decay) * ki;
  }
  for (int j = 0; j < nb; ++j) {
    delta[j] = beta * (v[j] - u[j]);
    out[j] = 0.f;
  }
  for (int i = 0; i < dk; ++i) {
    const float* Si = S_in + (int64_t)i * in_stride;
    float* So = S_out + (int64_t)i * out_stride;
    const float ki = k[i], qi = q[i];
    for (int j = 0; j < nb; ++j) {
      const float s = Si[j] * decay + ki * delta[j];
      So[j] = s;
      out[j] += s * qi;
    }
  }
  if (delta_out)
    for (int j = 0; j < nb; ++j) delta_out[j] = delta[j];
}

void delta_rule_step(const float* S_in, float* S_out, const float* k, const float* v, const float* q, float decay,
                     float beta, int dk, int dv, float* out, float* delta_out) {
  const int bw = delta_block_cols();
  for (int j0 = 0; j0 < dv; j0 += bw)
    delta_rule_cols(S_in + j0, dv, S_out + j0, dv, k, v + j0, q, decay, beta, dk, std::min(bw, dv - j0),
                    out + j0, delta_out ? delta_out + j0 : nullptr);
}

void stream_copy(float* dst, const float* src, size_t n) {
#if defined(__AVX2__)
  if (((uintptr_t)dst & 31) == 0) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
    for (; i < n; ++i) dst[i] = src[i];
    return;
  }
#endif
  std::memcpy(dst, src, n * sizeof(float));
}

void stream_fence() {
#if defined(__AVX2__)
  _mm_sfence();
#endif
}

void delta_rule_apply(float* S, const float* k, const float* delta, float decay, int dk, int dv) {
  for (int i = 0; i < dk; ++i) {
    float* Si = S + (int64_t)i * dv;
    const float ki = k[i];
    for (int j = 0; j < dv; ++j) {
      Si[j] *= decay;
      Si[j] += ki * delta[j];
    }
  }
}

}  // namespace dfl
