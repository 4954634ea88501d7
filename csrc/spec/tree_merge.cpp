// tree_merge.cpp — the union of two draft trees (see tree_merge.h).
#include "spec/tree_merge.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <queue>
#include <utility>

namespace dfl {

TreeUnion merge_trees(const DraftTree& a, const double* qa, const DraftTree& b, const double* qb) {
  // The union in a topological order of its own (a's nodes, then b's that a lacks): node u of the union
  // (1-based; 0 = the root) has parent par[u], depth dep[u], token tok[u] and raw acceptance q[u].
  std::vector<int32_t> tok{0}, dep{0}, par{-1}, ia{0}, ib{0};
  std::vector<double> q{1.0};
  std::map<std::pair<int32_t, int32_t>, int32_t> child;  // (union parent, token) -> union node
  std::vector<int32_t> a_at((size_t)a.size() + 1, 0), b_at((size_t)b.size() + 1, 0);  // tree node -> union node
  auto add = [&](const DraftTree& t, const double* qt, std::vector<int32_t>& at, std::vector<int32_t>& own,
                 int i) {
    const int32_t p = at[(size_t)t.parent[(size_t)i - 1]];
    const int32_t token = t.tokens[(size_t)i - 1];
    const double qi = std::clamp(qt[i - 1], 0.0, 1.0);
    auto it = child.find({p, token});
    if (it != child.end()) {  // held by both: one node, the larger estimate
      const int32_t u = it->second;
      q[(size_t)u] = std::max(q[(size_t)u], qi);
      own[(size_t)u] = i;
      at[(size_t)i] = u;
      return;
    }
    const int32_t u = (int32_t)tok.size();
    tok.push_back(token), dep.push_back(t.depth[(size_t)i - 1]), par.push_back(p), q.push_back(qi);
    ia.push_back(0), ib.push_back(0);
    own[(size_t)u] = i;
    child.emplace(std::make_pair(p, token), u);
    at[(size_t)i] = u;
  };
  for (int i = 1; i <= a.size(); ++i) add(a, qa, a_at, ia, i);
  for (int i = 1; i <= b.size(); ++i) add(b, qb, b_at, ib, i);
  TreeUnion out;

  // Siblings are exclusive: a node's children together claim at most the node's own chance (scaled down
  // together where two drafters' guesses overclaim), so no child claims more than its parent.  Parents come
  // before their children in this order, so each parent's final q is known when its children are scaled.
  const size_t N = tok.size();
  std::vector<double> claim(N, 0.0);
  for (size_t u = 1; u < N; ++u) claim[(size_t)par[u]] += q[u];
  for (size_t u = 1; u < N; ++u) {
    const size_t p = (size_t)par[u];
    if (claim[p] > q[p]) q[u] = std::min(q[u] * (q[p] / claim[p]), q[p]);  // (min: the division's rounding)
  }

  // Best-first, parents first: a heap of the nodes whose parent is listed, the larger q first, ties to the
  // earlier union node (a's order, then b's).
  std::vector<std::vector<int32_t>> kids(N);
  for (size_t u = 1; u < N; ++u) kids[(size_t)par[u]].push_back((int32_t)u);
  auto worse = [&](int32_t x, int32_t y) { return q[(size_t)x] < q[(size_t)y] || (q[(size_t)x] == q[(size_t)y] && x > y); };
  std::priority_queue<int32_t, std::vector<int32_t>, decltype(worse)> heap(worse);
  std::vector<int32_t> listed(N, 0);  // union node -> its index in the output (1-based)
  for (int32_t k : kids[0]) heap.push(k);
  while (!heap.empty()) {
    const int32_t u = heap.top();
    heap.pop();
    out.tree.tokens.push_back(tok[(size_t)u]);
    out.tree.depth.push_back(dep[(size_t)u]);
    out.tree.parent.push_back(listed[(size_t)par[(size_t)u]]);
    out.tree.logp.push_back((float)std::log(std::max(q[(size_t)u], 1e-30)));
    out.q.push_back(q[(size_t)u]);
    out.from_a.push_back(ia[(size_t)u]);
    out.from_b.push_back(ib[(size_t)u]);
    listed[(size_t)u] = out.tree.size();
    for (int32_t k : kids[(size_t)u]) heap.push(k);
  }
  return out;
}

}  // namespace dfl
