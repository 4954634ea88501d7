// lookup_proposer.cpp — prompt lookup (see lookup_proposer.h).
#include "spec/lookup_proposer.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "util/error.h"

namespace dfl {

namespace {
constexpr float kNoMatchLogp = -30.f;  // a depth without a voting match: never worth a verify row
// Before anything is learnt: the first-token hit rate per match-length bucket (2, 3, 4, 5-7, 8-15, 16+ tokens),
// as measured on the bundled pair (lookup_proposer.h), worth kPriorTrials observations.
constexpr double kPriorRate[6] = {0.5, 0.65, 0.75, 0.8, 0.9, 0.95};
constexpr double kPriorTrials = 2.0;
constexpr double kDecay = 0.98;  // per observation: the text changes, the rates follow
}  // namespace

int LookupProposer::bucket(int len) {
  return len <= 2 ? 0 : len == 3 ? 1 : len == 4 ? 2 : len < 8 ? 3 : len < 16 ? 4 : 5;
}

float LookupProposer::continue_logp() const {
  const int b = bucket(match_len_);
  return (float)std::log((hits_[b] + kPriorRate[b] * kPriorTrials) / (trials_[b] + kPriorTrials));
}

LookupProposer::LookupProposer(LookupParams p) : p_(p) {
  if (p_.ngram_min < 1 || p_.ngram_max < p_.ngram_min)
    fail("prompt lookup n-gram lengths %d..%d: need 1 <= min <= max", p_.ngram_min, p_.ngram_max);
  if (p_.max_matches < 1) fail("prompt lookup needs at least one match to vote (got %d)", p_.max_matches);
  if (p_.block < 2) fail("prompt lookup block %d: at least 2 (the root and one draft)", p_.block);
}

void LookupProposer::build(const DraftRequest& r) {
  const int n = r.root_pos + 1;  // the context: hist[0, root_pos), then the root
  auto at = [&](int i) { return i == r.root_pos ? r.root : r.hist[i]; };
  // the last draft's first token is decided once the root has moved past it: learn from it
  if (guess_bucket_ >= 0 && r.root_pos > guess_pos_) {
    const int b = guess_bucket_;
    hits_[b] = kDecay * hits_[b] + (at(guess_pos_ + 1) == guess_tok_ ? 1.0 : 0.0);
    trials_[b] = kDecay * trials_[b] + 1.0;
    guess_bucket_ = -1;
  }
  trie_.assign(1, Node{r.root, -1, 0, 0});
  total_ = 0;
  match_len_ = 0;
  for (int g = std::min(p_.ngram_max, n - 1); g >= p_.ngram_min && total_ == 0; --g) {
    // earlier places i where [i - g, i) equals the last g tokens [n - g, n), the most recent first
    for (int i = n - 1; i >= g && total_ < p_.max_matches; --i) {
      int k = 0;
      while (k < g && at(i - 1 - k) == at(n - 1 - k)) ++k;
      if (k < g) continue;
      while (k < kMaxMatch && i - 1 - k >= 0 && at(i - 1 - k) == at(n - 1 - k)) ++k;  // how far it reaches back
      match_len_ = std::max(match_len_, k);
      ++total_;
      int node = 0;
      for (int d = 1; d <= r.L && i + d - 1 < n; ++d) {  // the continuation, up to L tokens
        const int32_t t = at(i + d - 1);
        int child = -1;
        for (size_t c = 1; c < trie_.size(); ++c)
          if (trie_[c].parent == node && trie_[c].token == t) { child = (int)c; break; }
        if (child < 0) {
          trie_.push_back(Node{t, node, d, 0});
          child = (int)trie_.size() - 1;
        }
        ++trie_[(size_t)child].count;
        node = child;
      }
    }
  }
  // the guess to learn from: the most shared first token
  int best = -1;
  for (size_t c = 1; c < trie_.size(); ++c)
    if (trie_[c].depth == 1 && (best < 0 || trie_[c].count > trie_[(size_t)best].count)) best = (int)c;
  if (best > 0) guess_pos_ = r.root_pos, guess_tok_ = trie_[(size_t)best].token, guess_bucket_ = bucket(match_len_);
}

DraftTree LookupProposer::propose_tree(const DraftRequest& r, const TreeParams& tp, int) {
  build(r);
  DraftTree t;
  if (total_ == 0) return t;
  // best-first: more matches first, then shallower (a parent before its children), then older nodes
  std::vector<int> order((size_t)trie_.size() - 1);
  std::iota(order.begin(), order.end(), 1);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    const Node &x = trie_[(size_t)a], &y = trie_[(size_t)b];
    return x.count != y.count ? x.count > y.count : x.depth < y.depth;
  });
  std::vector<int> index(trie_.size(), -1);
  index[0] = 0;
  const float cont = continue_logp();
  for (int c : order) {
    if ((int)t.size() >= tp.budget) break;
    const Node& x = trie_[(size_t)c];
    if (index[(size_t)x.parent] < 0) continue;
    t.tokens.push_back(x.token);
    t.depth.push_back(x.depth);
    t.parent.push_back(index[(size_t)x.parent]);
    t.logp.push_back(std::log((float)x.count / (float)total_) + cont);
    index[(size_t)c] = t.size();
  }
  return t;
}

void LookupProposer::propose_topk(const DraftRequest& r, int K, int32_t* ids, float* logp) {
  build(r);
  const float cont = continue_logp();
  // depth d's candidates: the distinct tokens at depth d of the trie, by matches, the most recent first
  for (int d = 1; d <= r.L; ++d) {
    int k = 0;
    std::vector<int> at_d;
    for (size_t c = 1; c < trie_.size(); ++c)
      if (trie_[c].depth == d) at_d.push_back((int)c);
    std::stable_sort(at_d.begin(), at_d.end(),
                     [&](int a, int b) { return trie_[(size_t)a].count > trie_[(size_t)b].count; });
    for (int c : at_d) {
      if (k == K) break;
      const int32_t t = trie_[(size_t)c].token;
      bool seen = false;
      for (int j = 0; j < k; ++j) seen |= ids[(size_t)(d - 1) * K + j] == t;
      if (seen) continue;
      ids[(size_t)(d - 1) * K + k] = t;
      logp[(size_t)(d - 1) * K + k] = std::log((float)trie_[(size_t)c].count / (float)total_) + cont;
      ++k;
    }
    for (; k < K; ++k) {  // nothing more known at this depth
      ids[(size_t)(d - 1) * K + k] = r.root;
      logp[(size_t)(d - 1) * K + k] = kNoMatchLogp - (float)k;
    }
  }
}

void LookupProposer::propose_chain(const DraftRequest& r, int32_t* tokens) {
  build(r);
  // the most shared path, then the root repeated (a guess that costs a verify row, no more)
  int node = 0, d = 0;
  for (; d < r.L; ++d) {
    int best = -1;
    for (size_t c = 1; c < trie_.size(); ++c)
      if (trie_[c].parent == node && (best < 0 || trie_[c].count > trie_[(size_t)best].count)) best = (int)c;
    if (best < 0) break;
    tokens[d] = trie_[(size_t)best].token;
    node = best;
  }
  for (; d < r.L; ++d) tokens[d] = r.root;
}

}  // namespace dfl
