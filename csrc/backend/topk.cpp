// topk.cpp — the reference top-k of a logits row (every backend's device top-k equals it).
#include "backend/topk.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace dfl {

namespace {

// Above this k the selection below would shift more than partial_sort sorts.
constexpr int kSelectMax = 64;

// The k best of the row into tokens, best first, in one pass: a sorted buffer of the best so far.  Indices
// rise, so an element equal to the buffer's last comes after it (ties: the lower id first), and NaN is never
// picked (as the CUDA kernel).  False when fewer than k elements are numbers (the caller sorts instead).
bool select_topk(const float* row, int n_vocab, int k, int32_t* tokens) {
  float best[kSelectMax];
  int have = 0;
  if (k == 1) {  // greedy's one row a step: a plain argmax
    int32_t at = -1;
    float mx = 0.f;
    for (int i = 0; i < n_vocab; ++i)
      if (row[i] > mx || (at < 0 && row[i] == row[i])) mx = row[i], at = i;
    tokens[0] = at;
    return at >= 0;
  }
  for (int i = 0; i < n_vocab; ++i) {
    const float v = row[i];
    if (!(v == v) || (have == k && !(v > best[k - 1]))) continue;
    int s = have < k ? have++ : k - 1;  // the slot it takes: past every element >= v
    for (; s > 0 && best[s - 1] < v; --s) best[s] = best[s - 1], tokens[s] = tokens[s - 1];
    best[s] = v, tokens[s] = i;
  }
  return have == k;
}

#ifdef __AVX2__
// exp(x) for 4 doubles x <= 0: 2^n exp(r), r = x - n ln2 in [-ln2/2, ln2/2] (ln2 in two parts), exp(r) by its
// Taylor series to r^13 (the next term < 2e-16); below -708 (a term under 1e-307 of a sum >= 1) it is 0.
inline __m256d exp_neg4(__m256d x) {
  const __m256d n = _mm256_round_pd(_mm256_mul_pd(x, _mm256_set1_pd(1.4426950408889634)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256d r = _mm256_fmadd_pd(n, _mm256_set1_pd(-6.93147180369123816490e-01), x);
  r = _mm256_fmadd_pd(n, _mm256_set1_pd(-1.90821492927058770002e-10), r);
  __m256d p = _mm256_set1_pd(1.0 / 6227020800.0);  // 1/13!
  static const double inv_fact[13] = {1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0, 1.0 / 362880.0,
                                      1.0 / 40320.0,     1.0 / 5040.0,      1.0 / 720.0,      1.0 / 120.0,
                                      1.0 / 24.0,        1.0 / 6.0,         0.5,              1.0,
                                      1.0};
  for (double c : inv_fact) p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(c));
  const __m256d tiny = _mm256_cmp_pd(x, _mm256_set1_pd(-708.0), _CMP_LT_OQ);
  const __m128i ni = _mm256_cvtpd_epi32(_mm256_max_pd(n, _mm256_set1_pd(-1022.0)));
  const __m256i bits = _mm256_slli_epi64(_mm256_add_epi64(_mm256_cvtepi32_epi64(ni), _mm256_set1_epi64x(1023)), 52);
  return _mm256_andnot_pd(tiny, _mm256_mul_pd(p, _mm256_castsi256_pd(bits)));
}
#endif

// log(sum_i exp(row[i])) over the row, as mx + log(sum exp(row[i] - mx)) with the sum in double; NaN in the
// row gives NaN.  The AVX2 loop adds 8 lanes and meets them at the end, the scalar one in index order: the
// float result differs between the two only where the double sum's last bits decide a float rounding.
float log_sum_exp(const float* row, int n) {
  float mx = -INFINITY;
  int i = 0;
#ifdef __AVX2__
  __m256 vmx = _mm256_set1_ps(-INFINITY);
  for (; i + 8 <= n; i += 8) vmx = _mm256_max_ps(_mm256_loadu_ps(row + i), vmx);  // a NaN element is passed over
  alignas(32) float m8[8];
  _mm256_store_ps(m8, vmx);
  for (float v : m8) mx = std::max(mx, v);
#endif
  for (; i < n; ++i) mx = std::max(mx, row[i]);
  double sum = 0.0;
  i = 0;
#ifdef __AVX2__
  if (std::isfinite(mx)) {  // else every difference is NaN or -inf: the scalar loop says which
    const __m256d m = _mm256_set1_pd((double)mx);
    __m256d s0 = _mm256_setzero_pd(), s1 = s0, bad = s0;
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(row + i);
      const __m256d x0 = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)), m);
      const __m256d x1 = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)), m);
      bad = _mm256_or_pd(bad, _mm256_cmp_pd(x0, x1, _CMP_UNORD_Q));
      s0 = _mm256_add_pd(s0, exp_neg4(x0));
      s1 = _mm256_add_pd(s1, exp_neg4(x1));
    }
    if (_mm256_movemask_pd(bad)) return NAN;
    alignas(32) double l[4];
    _mm256_store_pd(l, _mm256_add_pd(s0, s1));
    sum = (l[0] + l[2]) + (l[1] + l[3]);
  }
#endif
  for (; i < n; ++i) sum += std::exp((double)row[i] - mx);
  return mx + (float)std::log(sum);
}

}  // namespace

void topk_logprobs(const float* row, int n_vocab, int k, int32_t* tokens, float* logp) {
  if (k > kSelectMax || !select_topk(row, n_vocab, k, tokens)) {
    std::vector<int32_t> idx(n_vocab);
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                      [&](int32_t a, int32_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
    std::copy(idx.begin(), idx.begin() + k, tokens);
  }
  if (!logp) return;  // ids only: the log-sum-exp is most of the cost of a row (greedy needs none)
  const float lse = log_sum_exp(row, n_vocab);
  for (int i = 0; i < k; ++i) logp[i] = row[tokens[i]] - lse;
}

}  // namespace dfl
