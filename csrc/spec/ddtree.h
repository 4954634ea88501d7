// ddtree.h — DDTree: the draft tree under a node budget (best-first by draft log-probability).
//
// One draft forward gives a distribution per depth 1..L.  Treating them as
// independent, a path's surrogate probability is the product of its tokens'
// probabilities; the `budget` most probable prefixes form a tree (a child is
// never more probable than its parent), which a heap builds best-first from
// the top-K tokens of each depth.  Optionally the drafter's greedy chain is
// inserted first (chain seed) so the tree always contains what chain
// decoding would have verified.
#pragma once
#include <cstdint>
#include <vector>

#include "backend/topk.h"

namespace dfl {

struct TreeParams {
  int budget = 22;         // non-root nodes
  int topk = 0;            // candidates per depth; 0 = budget (as the reference)
  bool chain_seed = true;  // insert the greedy chain first
  // A draft model only: 0 = one draft pass, its greedy path with per-depth
  // alternatives (the builder above); w > 0 = expanding branches: each depth
  // runs the w most probable nodes of the depth before (draft_model.h).
  int expand = 0;
  // A DFlash2 drafter only: build the tree from its candidate selector's transition scores (a child's order
  // and probability depend on its parent's token, build_ddtree_lattice), or from the draft probabilities
  // alone (each depth's ranking independent of the parent, as DFlash).
  enum class Scores { Selector, Draft } scores = Scores::Selector;
};

// Non-root nodes in topological order (parent < index).  Index 0 is the root
// (the last committed token, not stored here); node i (1-based) is
// tokens[i-1] at depth depth[i-1] with parent parent[i-1] (0 = the root).
struct DraftTree {
  std::vector<int32_t> tokens, depth, parent;
  std::vector<float> logp;  // cumulative draft log-probability of the node's path
  // Optional, per node (empty: none): a label the generator's rewrites of a tree (a constraint's forced chain
  // grafted, forbidden nodes pruned) carry along, so a union's nodes keep their origin (tree_merge.h)
  std::vector<int32_t> tag;
  int size() const { return (int)tokens.size(); }
  int max_depth() const;
};

// logits: [L][n_vocab] draft logits for depths 1..L.  Ties in log-probability
// break by depth-major rank order (earlier pushed first), so the result is
// deterministic.
DraftTree build_ddtree(const float* logits, int L, int n_vocab, const TreeParams& p);
// Candidates per depth the builder uses: topk, else the budget (at least 1), at most n_vocab.
int ddtree_k(const TreeParams& p, int n_vocab);
// The same tree from each depth's top-K already ranked (ids, log-probs [L][K]
// as topk_logprobs gives them), e.g. computed on the GPU next to the logits.
DraftTree build_ddtree_topk(const int32_t* ids, const float* logp, int L, int K, const TreeParams& p);
// The tree when a child's probability depends on its parent's token (DFlash2's candidate selector): depth d
// has candidates ids[d-1][0..K) with draft log-probs logp[d-1][..]; edge[d-1][i][j] scores candidate j of
// depth d after candidate i of depth d-1 (for depth 1 row 0 is the root's; the other rows are not read).
// A child's log-prob is the draft mass of its depth's candidates, shared out by the softmax of its parent's
// edge row: the candidates' order follows the selector, their total stays the drafter's.  Children rank by
// edge score, the lower index first on ties, so rank 0 everywhere is the selector's greedy path.
DraftTree build_ddtree_lattice(const int32_t* ids, const float* logp, const float* edge, int L, int K,
                               const TreeParams& p);

}  // namespace dfl
