// sampler.cpp — top-k / top-p / min-p / temperature sampling (llama.cpp order).
#include "spec/sampler.h"

#include <algorithm>
#include <cmath>

#include "util/error.h"

namespace dfl {

void validate_sampler(const SamplerParams& p, int n_vocab) {
  if (!(p.temperature >= 0.f) || !std::isfinite(p.temperature))
    fail("temperature must be a finite number >= 0 (got %g)", (double)p.temperature);
  if (p.top_k < 0) fail("top_k must be >= 0 (0 = off; got %d)", p.top_k);
  if (!(p.top_p > 0.f && p.top_p <= 1.f)) fail("top_p must be in (0, 1] (got %g)", (double)p.top_p);
  if (!(p.min_p >= 0.f && p.min_p <= 1.f)) fail("min_p must be in [0, 1] (got %g)", (double)p.min_p);
  if (!(p.typical_p > 0.f && p.typical_p <= 1.f)) fail("typical_p must be in (0, 1] (got %g)", (double)p.typical_p);
  if (!(p.repeat_penalty > 0.f) || !std::isfinite(p.repeat_penalty))
    fail("repeat_penalty must be a finite number > 0 (1 = off; got %g)", (double)p.repeat_penalty);
  if (!std::isfinite(p.frequency_penalty)) fail("frequency_penalty must be a finite number (got %g)", (double)p.frequency_penalty);
  if (!std::isfinite(p.presence_penalty)) fail("presence_penalty must be a finite number (got %g)", (double)p.presence_penalty);
  if (p.repeat_last_n < -1) fail("repeat_last_n must be >= -1 (-1 = the whole sequence, 0 = off; got %d)", p.repeat_last_n);
  for (size_t i = 0; i < p.logit_bias.size(); ++i) {
    const auto [t, b] = p.logit_bias[i];
    if (t < 0 || (n_vocab > 0 && t >= n_vocab))
      fail("logit_bias token id %d is outside the vocabulary (0..%d)", t, n_vocab - 1);
    if (!std::isfinite(b)) fail("logit_bias of token %d must be a finite number (got %g)", t, (double)b);
    if (i > 0 && t <= p.logit_bias[i - 1].first) fail("logit_bias gives token %d twice", t);
  }
}

void apply_penalties(float* logits, int n_vocab, const SamplerParams& p, const int32_t* hist, size_t n_hist,
                     std::vector<int32_t>& seen) {
  if (!p.penalized()) return;
  const size_t w = p.repeat_last_n < 0 ? n_hist : std::min(n_hist, (size_t)p.repeat_last_n);
  const int32_t* win = hist + (n_hist - w);
  seen.assign(win, win + w);
  std::sort(seen.begin(), seen.end());  // each distinct token once, with its count: a fixed order
  for (size_t i = 0; i < seen.size();) {
    size_t j = i;
    while (j < seen.size() && seen[j] == seen[i]) ++j;
    const int32_t t = seen[i];
    const float count = (float)(j - i);
    if (t >= 0 && t < n_vocab) {
      float& x = logits[t];
      x = x > 0.f ? x / p.repeat_penalty : x * p.repeat_penalty;
      x -= count * p.frequency_penalty + p.presence_penalty;
    }
    i = j;
  }
}

static uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

double position_uniform(uint64_t seed, int64_t pos) {
  const uint64_t h = mix64(mix64(seed) ^ mix64((uint64_t)pos ^ 0x5851f42d4c957f2dull));
  return (double)(h >> 11) * 0x1.0p-53;
}

int32_t sample_token(const float* logits, int n_vocab, const SamplerParams& p, int64_t pos,
                     std::vector<std::pair<float, int32_t>>& cand) {
  if (p.greedy()) return (int32_t)(std::max_element(logits, logits + n_vocab) - logits);
  // Candidates by descending logit, lower id first on ties: a total order, so
  // the draw depends on nothing but the logits and the position's number.
  auto better = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  cand.resize(n_vocab);
  for (int i = 0; i < n_vocab; ++i) cand[i] = {logits[i], i};
  size_t n = (size_t)n_vocab;
  if (p.top_k > 0 && (size_t)p.top_k < n) {
    std::partial_sort(cand.begin(), cand.begin() + p.top_k, cand.end(), better);
    n = (size_t)p.top_k;
  } else {
    std::sort(cand.begin(), cand.end(), better);
  }
  // locally typical (Meister et al., llama.cpp's typ_p): keep the tokens whose surprise -log p is closest to
  // the entropy H until their mass reaches typical_p, then back in logit order (ties by id) for the rest
  if (p.typical_p < 1.f) {
    const float mx = cand[0].first;
    std::vector<double> e(n);
    double sum = 0.0;
    for (size_t i = 0; i < n; ++i) sum += e[i] = std::exp((double)cand[i].first - mx);
    double ent = 0.0;
    for (size_t i = 0; i < n; ++i) ent -= e[i] / sum * std::log(e[i] / sum);
    std::vector<std::pair<double, size_t>> dev(n);  // (|surprise - H|, rank in logit order)
    for (size_t i = 0; i < n; ++i) dev[i] = {std::fabs(-std::log(e[i] / sum) - ent), i};
    std::stable_sort(dev.begin(), dev.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    double cum = 0.0;
    size_t keep = n;
    for (size_t i = 0; i < n; ++i) {
      cum += e[dev[i].second] / sum;
      if (cum >= p.typical_p) {
        keep = i + 1;
        break;
      }
    }
    std::vector<size_t> ranks(keep);
    for (size_t i = 0; i < keep; ++i) ranks[i] = dev[i].second;
    std::sort(ranks.begin(), ranks.end());
    for (size_t i = 0; i < keep; ++i) cand[i] = cand[ranks[i]];
    n = keep;
  }
  // top-p and min-p on the softmax (temperature 1) of the survivors
  if (p.top_p < 1.f || p.min_p > 0.f) {
    const float mx = cand[0].first;
    std::vector<double> e(n);
    double sum = 0.0;
    for (size_t i = 0; i < n; ++i) sum += e[i] = std::exp((double)cand[i].first - mx);
    if (p.top_p < 1.f) {
      double cum = 0.0;
      size_t keep = n;
      for (size_t i = 0; i < n; ++i) {
        cum += e[i] / sum;
        if (cum >= p.top_p) {
          keep = i + 1;
          break;
        }
      }
      n = keep;
    }
    if (p.min_p > 0.f) {
      // relative to the most probable token: p_i >= min_p * p_max  <=>  e_i >= min_p (e_0 = 1)
      size_t keep = 1;
      while (keep < n && e[keep] >= (double)p.min_p) ++keep;
      n = keep;
    }
  }
  // temperature, then the draw: the first candidate whose cumulative weight passes u
  const double inv_t = 1.0 / (double)p.temperature;
  const double mx = cand[0].first;
  std::vector<double> w(n);
  double total = 0.0;
  for (size_t i = 0; i < n; ++i) total += w[i] = std::exp(((double)cand[i].first - mx) * inv_t);
  const double target = position_uniform(p.seed, pos) * total;
  double cum = 0.0;
  for (size_t i = 0; i < n; ++i) {
    cum += w[i];
    if (target < cum) return cand[i].second;
  }
  return cand[n - 1].second;
}

}  // namespace dfl
