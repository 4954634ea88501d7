// topk.cpp — the reference top-k of a logits row (every backend's device top-k equals it).
#include "backend/topk.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

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
  float mx = -INFINITY;
  for (int i = 0; i < n_vocab; ++i) mx = std::max(mx, row[i]);
  double sum = 0.0;
  for (int i = 0; i < n_vocab; ++i) sum += std::exp((double)row[i] - mx);
  const float lse = mx + (float)std::log(sum);
  for (int i = 0; i < k; ++i) logp[i] = row[tokens[i]] - lse;
}

}  // namespace dfl
