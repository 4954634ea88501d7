// dflash_proposer.h — a DFlash drafter (runtime/drafter.h) as a Proposer.
//
// One drafter forward over [root, mask x L] ranks every depth at once; the
// target features it conditions on arrive through take_features, into the
// drafter's ring (committed positions only, in position order).  A DFlash2
// drafter's chain is its candidate selector's path and its tree is built from
// the selector's lattice (TreeParams::Scores::Selector) or, as DFlash's, from
// the per-depth draft distribution alone (Scores::Draft).
#pragma once
#include <vector>

#include "runtime/drafter.h"
#include "spec/proposer.h"

namespace dfl {

class DFlashProposer final : public Proposer {
 public:
  explicit DFlashProposer(Drafter& d) : d_(d) {}
  const char* name() const override { return "dflash"; }
  unsigned capabilities() const override { return Rank | Chain | (d_.config().dflash2 ? OwnTree : 0u); }
  int default_block() const override { return d_.config().block_size; }
  void propose_topk(const DraftRequest& r, int K, int32_t* ids, float* logp) override {
    d_.propose_topk(block(r), r.L + 1, K, ids, logp);
  }
  // DFlash2: the candidate selector's path; DFlash: the top-1 of each depth
  void propose_chain(const DraftRequest& r, int32_t* tokens) override {
    if (!d_.config().dflash2) return Proposer::propose_chain(r, tokens);
    d_.propose_path(block(r), r.L + 1, tokens);
  }
  DraftTree propose_tree(const DraftRequest& r, const TreeParams& tp, int K) override {
    const int32_t* b = block(r);
    if (tp.scores == TreeParams::Scores::Draft) {
      ids_.resize((size_t)r.L * K), logp_.resize((size_t)r.L * K);
      d_.propose_topk(b, r.L + 1, K, ids_.data(), logp_.data());
      return build_ddtree_topk(ids_.data(), logp_.data(), r.L, K, tp);
    }
    const int S = d_.config().selector_top_k;  // the lattice's candidates per depth
    ids_.resize((size_t)r.L * S), logp_.resize((size_t)r.L * S), edge_.resize((size_t)r.L * S * S);
    d_.propose_lattice(b, r.L + 1, ids_.data(), logp_.data(), edge_.data());
    return build_ddtree_lattice(ids_.data(), logp_.data(), edge_.data(), r.L, S, tp);
  }
  const void* batch_key() const override { return d_.draft_model(); }
  void prefetch_many(Proposer* const* ps, const DraftRequest* rs, int n) override {
    std::vector<Drafter*> ds((size_t)n);
    std::vector<const int32_t*> bp((size_t)n);
    std::vector<int> nb((size_t)n);
    for (int k = 0; k < n; ++k) {
      DFlashProposer& q = static_cast<DFlashProposer&>(*ps[k]);  // (one batch key: DFlash proposers alike)
      ds[(size_t)k] = &q.d_;
      bp[(size_t)k] = q.block(rs[k]);  // each slot's block in its own proposer, as its propose call makes it
      nb[(size_t)k] = rs[k].L + 1;
    }
    Drafter::prefetch_blocks(ds.data(), bp.data(), nb.data(), n);
  }
  void reset() override { d_.reset(); }
  const std::vector<int32_t>* feature_layers() const override { return &d_.config().target_layer_ids; }
  int feature_capacity() const override { return d_.capacity(); }
  void take_features(int32_t pos0, int n, const float* captured, size_t stride, const int32_t* rows,
                     const int32_t* /*tokens*/) override {
    if (captured) d_.push_features_from_backend(pos0, n, captured, stride, rows);
    else d_.skip_features(pos0, n);
  }
  size_t state_bytes() const override { return d_.state_bytes(); }
  // the prompt's context K/V with the prefill: left to the first draft, a 1000-token prompt's projection made
  // that probe cost ~20 AR steps of the bundled pair and auto mode stop asking DFlash for the request
  void prompt_done(const int32_t*, int) override { d_.catch_up(); }
  Drafter& drafter() { return d_; }

 private:
  // The block the drafter reads for request r: root, then mask tokens (in block_).
  const int32_t* block(const DraftRequest& r) {
    block_.assign((size_t)r.L + 1, d_.config().mask_token_id);
    block_[0] = r.root;
    return block_.data();
  }
  Drafter& d_;
  std::vector<int32_t> block_;  // the block the drafter reads: root, then mask tokens
  std::vector<int32_t> ids_;    // a tree's candidates [L][K]
  std::vector<float> logp_, edge_;
};

}  // namespace dfl
