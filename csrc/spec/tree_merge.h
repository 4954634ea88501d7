// tree_merge.h — two drafters' trees under one root, as one tree for one verify.
//
// Auto mode drafts a step with one drafter of its portfolio.  A drafter that costs next to nothing (prompt
// lookup: a scan of the context) can add its tree to that drafter's at the price of verify rows only: where the
// text repeats, its continuation often runs past the model drafter's guesses, or holds the token the model
// drafter missed.  The union is priced as any tree, node by node, so the added nodes are verified only where
// they pay for their rows.
//
// Each node carries its estimated acceptance q: the chance, by its own drafter's calibration, that it lies on
// the accepted path.  A node both trees hold is one node with the larger q.  Siblings are exclusive (at most
// one child of a node is accepted), so where two drafters' children of one node claim more than their parent,
// their q is scaled down to the parent's.  The union lists its nodes best-first by q, parents first: its
// first b nodes are the best tree of b nodes, as the DDTree builder's are.
#pragma once
#include <cstdint>
#include <vector>

#include "spec/ddtree.h"

namespace dfl {

struct TreeUnion {
  DraftTree tree;                      // builder order; logp: log q
  std::vector<double> q;               // per node: its estimated acceptance
  std::vector<int32_t> from_a, from_b;  // per node: its 1-based index in a / in b (0: not there)
};

// qa / qb: each tree's nodes' acceptance (indexed like its nodes, 0..size-1), each in [0, 1].
TreeUnion merge_trees(const DraftTree& a, const double* qa, const DraftTree& b, const double* qb);

}  // namespace dfl
