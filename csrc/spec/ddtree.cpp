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
  int pcand;       // the parent's candidate index at depth - 1 (0: the root)
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

namespace {
// Best-first under the budget.  child(d, pcand, r) = {candidate index, token, log-prob} of the r-th ranked
// child at depth d (1-based) of a parent that is candidate pcand of depth d-1 (0 for the root); ranks are
// in non-increasing log-prob order.
struct Child {
  int cand;
  int32_t token;
  float logp;
};
template <class ChildFn>
DraftTree best_first(int L, int K, const TreeParams& p, const ChildFn& child) {
  if (L < 1) fail("a draft tree needs at least one drafted depth");
  if (p.budget < 0) fail("tree budget must be >= 0 (got %d)", p.budget);
  if (K < 1) fail("a draft tree needs at least one candidate per depth");
  DraftTree t;
  std::vector<int> node_cand;  // the candidate index of each node (1-based node index - 1)
  std::priority_queue<Cand, std::vector<Cand>, Worse> heap;
  uint64_t seq = 0;
  auto add = [&](const Cand& c) {
    const Child ch = child(c.depth, c.pcand, c.rank);
    t.tokens.push_back(ch.token);
    t.depth.push_back(c.depth);
    t.parent.push_back(c.parent);
    t.logp.push_back(c.logw);
    node_cand.push_back(ch.cand);
    return t.size();  // 1-based index of the node just added
  };
  auto push_sibling = [&](const Cand& c) {
    if (c.rank + 1 < K)
      heap.push(Cand{c.logw - child(c.depth, c.pcand, c.rank).logp + child(c.depth, c.pcand, c.rank + 1).logp,
                     seq++, c.parent, c.depth, c.rank + 1, c.pcand});
  };
  auto first_child = [&](int idx, const Cand& c) {
    const int pc = node_cand[(size_t)idx - 1];
    return Cand{c.logw + child(c.depth + 1, pc, 0).logp, seq++, idx, c.depth + 1, 0, pc};
  };
  auto push_child = [&](int idx, const Cand& c) {
    if (c.depth < L) heap.push(first_child(idx, c));
  };

  if (p.budget == 0) return t;
  if (p.chain_seed) {
    // The greedy chain first; its nodes' siblings join the heap, and only the
    // last one's first child (the others' first children are the chain).
    Cand c{child(1, 0, 0).logp, seq++, 0, 1, 0, 0};
    for (;;) {
      const int idx = add(c);
      push_sibling(c);
      if (t.size() >= p.budget || c.depth >= L) {
        if (t.size() < p.budget) push_child(idx, c);
        break;
      }
      c = first_child(idx, c);
    }
  } else {
    heap.push(Cand{child(1, 0, 0).logp, seq++, 0, 1, 0, 0});
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
}  // namespace

DraftTree build_ddtree_topk(const int32_t* tok, const float* lp, int L, int K, const TreeParams& p) {
  return best_first(L, K, p, [&](int d, int, int r) {
    const size_t i = (size_t)(d - 1) * K + r;
    return Child{r, tok[i], lp[i]};
  });
}

DraftTree build_ddtree_lattice(const int32_t* ids, const float* lp, const float* edge, int L, int K,
                               const TreeParams& p) {
  if (L < 1 || K < 1) return best_first(L, K, p, [](int, int, int) { return Child{0, 0, 0.f}; });
  // Per (depth, parent candidate): the children in rank order and their log-probs.
  std::vector<int> order((size_t)L * K * K);
  std::vector<float> clp((size_t)L * K * K);
  for (int d = 0; d < L; ++d) {
    double mass = 0;  // the drafter's probability of this depth's candidates
    for (int j = 0; j < K; ++j) mass += std::exp((double)lp[(size_t)d * K + j]);
    const double log_mass = std::log(mass);
    for (int i = 0; i < (d == 0 ? 1 : K); ++i) {
      const float* e = edge + ((size_t)d * K + i) * K;
      int* o = order.data() + ((size_t)d * K + i) * K;
      std::iota(o, o + K, 0);
      std::stable_sort(o, o + K, [&](int a, int b) { return e[a] > e[b]; });
      const float mx = e[o[0]];
      double z = 0;
      for (int j = 0; j < K; ++j) z += std::exp((double)e[j] - mx);
      const double lz = mx + std::log(z);
      for (int r = 0; r < K; ++r) clp[((size_t)d * K + i) * K + r] = (float)(e[o[r]] - lz + log_mass);
    }
  }
  return best_first(L, K, p, [&](int d, int pc, int r) {
    const size_t row = ((size_t)(d - 1) * K + (d == 1 ? 0 : pc)) * K;
    const int j = order[row + r];
    return Child{j, ids[(size_t)(d - 1) * K + j], clp[row + r]};
  });
}

}  // namespace dfl
