// hook_proposers.h — callbacks as Proposers: the C API's draft, tree and
// top-k hooks (tests, oracles, external drafters) draft through the same seam
// as the built-in drafters.  Each declares the one shape its callback gives.
#pragma once
#include <functional>
#include <utility>

#include "spec/proposer.h"
#include "util/error.h"

namespace dfl {

// Writes n draft tokens for the block whose root `root` sits at position root_pos.
using ChainFn = std::function<void(int32_t root_pos, int32_t root, int n, int32_t* tokens)>;
// Writes up to cap nodes (tokens, parents; parent 0 = the root, node i's parent < i); returns how many.
using TreeFn = std::function<int(int32_t root_pos, int32_t root, int cap, int32_t* tokens, int32_t* parents)>;
// Writes the top-K ids and log-probs of depths 1..L ([L][K]).
using TopkFn = std::function<void(int32_t root_pos, int32_t root, int L, int K, int32_t* ids, float* logp)>;

class ChainHookProposer final : public Proposer {
 public:
  explicit ChainHookProposer(ChainFn fn) : fn_(std::move(fn)) {}
  const char* name() const override { return "chain hook"; }
  unsigned capabilities() const override { return Chain; }
  void propose_chain(const DraftRequest& r, int32_t* tokens) override { fn_(r.root_pos, r.root, r.L, tokens); }

 private:
  ChainFn fn_;
};

class TreeHookProposer final : public Proposer {
 public:
  explicit TreeHookProposer(TreeFn fn) : fn_(std::move(fn)) {}
  const char* name() const override { return "tree hook"; }
  unsigned capabilities() const override { return Tree; }
  DraftTree propose_tree(const DraftRequest& r, const TreeParams& tp, int) override {
    const int cap = tp.budget;
    DraftTree t;
    t.tokens.resize((size_t)cap), t.parent.resize((size_t)cap);
    const int n = fn_(r.root_pos, r.root, cap, t.tokens.data(), t.parent.data());
    if (n < 0 || n > cap) fail("tree hook returned %d nodes (capacity %d)", n, cap);
    t.tokens.resize((size_t)n), t.parent.resize((size_t)n), t.depth.resize((size_t)n), t.logp.assign((size_t)n, 0.f);
    for (int i = 1; i <= n; ++i) {
      const int32_t par = t.parent[(size_t)i - 1];
      if (par < 0 || par >= i) fail("tree hook: node %d has parent %d (must be in 0..%d)", i, par, i - 1);
      t.depth[(size_t)i - 1] = par == 0 ? 1 : t.depth[(size_t)par - 1] + 1;
    }
    return t;
  }

 private:
  TreeFn fn_;
};

class TopkHookProposer final : public Proposer {
 public:
  explicit TopkHookProposer(TopkFn fn) : fn_(std::move(fn)) {}
  const char* name() const override { return "top-k hook"; }
  unsigned capabilities() const override { return Rank; }
  void propose_topk(const DraftRequest& r, int K, int32_t* ids, float* logp) override {
    fn_(r.root_pos, r.root, r.L, K, ids, logp);
  }

 private:
  TopkFn fn_;
};

}  // namespace dfl
