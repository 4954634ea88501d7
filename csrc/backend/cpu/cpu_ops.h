// cpu_ops.h — the CPU backend's ops, each a plain function over f32 rows.
//
// Every op computes each output row (token) from that row's inputs alone with
// a fixed reduction order, so results never depend on batch composition or
// thread count.  Parallel ops split work over rows/heads with the pool; the
// split only decides which thread computes an element, not how.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "model/qwen35.h"
#include "model/rope.h"
#include "util/threadpool.h"

namespace dfl {

// Scratch for activations quantised to int8 (see ActRow), grown on demand.
struct ActScratch {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> bsum;
  void reserve(int64_t n_values) {
    if ((int64_t)q.size() < n_values) {
      q.resize(n_values);
      d.resize(n_values / 32 + 1);
      bsum.resize(n_values / 16 + 1);
    }
  }
};

// y[t][r] = sum_i W[r][i] x[t][i] for t < n.
void matmul(ThreadPool& pool, const Weight& W, const float* x, int n, float* y, ActScratch& act);
// n rows of x quantised to int8 for weights whose activation block is `block` (act_block), into act.
std::vector<ActRow> quantize_activations(ThreadPool& pool, const float* x, int n, int64_t cols, int block,
                                         ActScratch& act);

// y = x / sqrt(mean(x^2) + eps) * w   (w may be null), over `n` rows of `dim`.
void rmsnorm_rows(const float* x, const float* w, int n, int dim, float eps, float* y);

// NeoX rotation of the first r.n_rot dims of one head vector at position pos.
void rope_neox(float* v, const RopeSpec& r, int64_t pos);

// exp(x) as the gates use it: Cody-Waite range reduction (x = n ln2 + r) and
// Cephes' degree-6 polynomial for exp(r), within 1 ulp of the true value for
// finite results; inf above 88.73, 0 below -104, NaN through.  Every step is
// one IEEE float operation (no fused multiply-add), so silu_rows' AVX2 lanes
// and this scalar code give the same bits.
namespace exp_poly_c {
constexpr float kLo = -104.f, kHi = 88.75f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                         4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace exp_poly_c
inline float exp_poly(float x) {
  using namespace exp_poly_c;
  if (x != x) return x;
  x = kLo > x ? kLo : x;
  x = kHi < x ? kHi : x;
  const float n = std::nearbyint(x * kLog2e);
  float r = x - n * kLn2Hi;
  r = r - n * kLn2Lo;
  float p = kP[0];
  for (int i = 1; i < 6; ++i) p = p * r + kP[i];
  p = p * (r * r) + r + 1.f;
  // 2^n in two factors, so that n from -150 to 128 stays in the exponent's range
  const int ni = (int)n, n1 = ni >> 1, n2 = ni - n1;
  const uint32_t b1 = (uint32_t)(n1 + 127) << 23, b2 = (uint32_t)(n2 + 127) << 23;
  float f1, f2;
  std::memcpy(&f1, &b1, 4);
  std::memcpy(&f2, &b2, 4);
  return p * f1 * f2;
}
inline float silu(float x) { return x / (1.f + exp_poly(-x)); }
inline float sigmoid(float x) { return 1.f / (1.f + exp_poly(-x)); }
// out[i] = silu(a[i]) * b[i] (b null: silu(a[i])), AVX2 where built; out may alias a or b.
void silu_rows(const float* a, const float* b, float* out, int64_t n);
// out[i] = x[i] * s * sigmoid(g[i]) (attention's output gate), AVX2 where built; out may alias x.
void gate_rows(const float* x, float s, const float* g, float* out, int64_t n);
inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

// Row of the embedding table (any weight type) as f32.
void embed_row(const Weight& W, int32_t token, float* out);

// out[j] = sum_i S[i][j] * q[i]  etc.: one gated delta-rule step on one head.
// The state before the step is read from S_in, the state after it written to
// S_out (dk x dv row-major, key dim outer); they may be the same buffer (in
// place), or a tree node may step from its parent's state straight into its
// own.  delta_out (may be null) receives the rank-one update's delta row.
void delta_rule_step(const float* S_in, float* S_out, const float* k, const float* v, const float* q, float decay,
                     float beta, int dk, int dv, float* out, float* delta_out = nullptr);
// The same step on one block of nb <= kDeltaCols columns: column j of the new
// state, delta[j] and out[j] depend on column j of S alone, so a run of tokens
// can step one block at a time with the block in L1 (CpuBackend::gdn).  v, out
// and delta_out point at the block's first column; S_in / S_out have row strides
// in floats (the same buffer for in place).  delta_rule_step is this per block.
// Blocks are delta_block_cols() wide: 64 where the AVX-512 loop runs, else 32 (the
// loops wait on add latency, so more columns in flight is what makes them faster;
// each column's sums run over i in order either way, so the bits do not change).
constexpr int kDeltaCols = 64;
int delta_block_cols();
void delta_rule_cols(const float* S_in, int64_t in_stride, float* S_out, int64_t out_stride, const float* k,
                     const float* v, const float* q, float decay, float beta, int dk, int nb, float* out,
                     float* delta_out);
// dst[i] = src[i] with stores that bypass the cache (no read of dst first): for
// data written now and read much later.  dst 32-byte aligned.  Call stream_fence()
// before another thread may read it.
void stream_copy(float* dst, const float* src, size_t n);
void stream_fence();
// The state part of delta_rule_step alone, for a known update:
// S = S * decay; S += k delta^T — the same operations in the same order.
void delta_rule_apply(float* S, const float* k, const float* delta, float decay, int dk, int dv);

}  // namespace dfl
