// ddtree.cpp — best-first draft tree construction.
#include "spec/ddtree.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <queue>

#include "util/error.h"

namespace dfl {

int DraftTree::max_depth() const { return depth.empty() ? 0 : *std::max_element(depth.begin(), depth.end()); }

namespace {
struct Cand {
  float logw;      // cumulative log-prob of the path ending in this candidate
  uint64_t seq;    // push order: the tie-break
  int parent, depth, rank;
};
struct Worse {
  bool operator()(const Cand& a, const Cand& b) const {
    return a.logw < b.logw || (a.logw == b.logw && a.seq > b.seq);
  }
};
}  // namespace

int ddtree_k(const TreeParams& p, int n_vocab) { return std::min(p.topk > 0 ? p.topk : std::max(p.budget, 1), n_vocab); }

DraftTree build_ddtree(const float* logits, int L, int n_vocab, const TreeParams& p) {
  if (L < 1) fail("a draft tree needs at least one drafted depth");
  if (p.budget < 0) fail("tree budget must be >= 0 (got %d)", p.budget);
  const int K = ddtree_k(p, n_vocab);
  std::vector<int32_t> tok((size_t)L * K);
  std::vector<float> lp((size_t)L * K);
  for (int d = 0; d < L; ++d)
    topk_logprobs(logits + (size_t)d * n_vocab, n_vocab, K, tok.data() + (size_t)d * K, lp.data() + (size_t)d * K);
  return build_ddtree_topk(tok.data(), lp.data(), L, K, p);
}

DraftTree build_ddtree_topk(const int32_t* tok, const float* lp, int L, int K, const TreeParams& p) {
  if (L < 1) fail("a draft tree needs at least one drafted depth");
  if (p.budget < 0) fail("tree budget must be >= 0 (got %d)", p.budget);
  if (K < 1) fail("a draft tree needs at least one candidate per depth");
  auto T = [&](int d, int r) { return tok[(size_t)(d - 1) * K + r]; };
  auto LP = [&](int d, int r) { return lp[(size_t)(d - 1) * K + r]; };

  DraftTree t;
  std::priority_queue<Cand, std::vector<Cand>, Worse> heap;
  uint64_t seq = 0;
  auto add = [&](const Cand& c) {
    t.tokens.push_back(T(c.depth, c.rank));
    t.depth.push_back(c.depth);
    t.parent.push_back(c.parent);
    t.logp.push_back(c.logw);
    const int idx = t.size();  // 1-based index of the node just added
    return idx;
  };
  auto push_sibling = [&](const Cand& c) {
    if (c.rank + 1 < K)
      heap.push(Cand{c.logw - LP(c.depth, c.rank) + LP(c.depth, c.rank + 1), seq++, c.parent, c.depth, c.rank + 1});
  };
  auto push_child = [&](int idx, const Cand& c) {
    if (c.depth < L) heap.push(Cand{c.logw + LP(c.depth + 1, 0), seq++, idx, c.depth + 1, 0});
  };

  if (p.budget == 0) return t;
  if (p.chain_seed) {
    // The greedy chain first; its nodes' siblings join the heap, and only the
    // last one's first child (the others' first children are the chain).
    Cand c{LP(1, 0), seq++, 0, 1, 0};
    for (;;) {
      const int idx = add(c);
      push_sibling(c);
      if (t.size() >= p.budget || c.depth >= L) {
        if (t.size() < p.budget) push_child(idx, c);
        break;
      }
      c = Cand{c.logw + LP(c.depth + 1, 0), seq++, idx, c.depth + 1, 0};
    }
  } else {
    heap.push(Cand{LP(1, 0), seq++, 0, 1, 0});
  }
  while (t.size() < p.budget && !heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    const int idx = add(c);
    push_sibling(c);
    push_child(idx, c);
  }
  return t;
}

}  // namespace dfl
