// topk.cpp — the reference top-k of a logits row (every backend's device top-k equals it).
#include "backend/topk.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace dfl {

void topk_logprobs(const float* row, int n_vocab, int k, int32_t* tokens, float* logp) {
  float mx = -INFINITY;
  for (int i = 0; i < n_vocab; ++i) mx = std::max(mx, row[i]);
  double sum = 0.0;
  for (int i = 0; i < n_vocab; ++i) sum += std::exp((double)row[i] - mx);
  const float lse = mx + (float)std::log(sum);
  std::vector<int32_t> idx(n_vocab);
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                    [&](int32_t a, int32_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
  for (int i = 0; i < k; ++i) {
    tokens[i] = idx[i];
    logp[i] = row[idx[i]] - lse;
  }
}

}  // namespace dfl
