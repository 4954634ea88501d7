// draft_model.h — classic draft-model speculation: a small qwen35 model of the
// same vocabulary drafts for the target.
//
// The draft model runs in its own Context (its own KV cache and delta-net
// state) through the same forward as the target.  To draft the block rooted
// at position s it first holds exactly the target's committed tokens [0, s)
// — rolling its delta-net state back to the last position both agree on from
// a per-position snapshot taken while drafting (a gather, never a replay of
// drafted tokens) and feeding the tokens it has not seen — then runs the root
// and its own greedy chain one token at a time, keeping each depth's top-K
// (one greedy path with per-depth alternatives: what the DDTree builder needs).
//
// Or it expands branches (propose_tree): depth by depth, the `width` most
// probable nodes of the newest depth run as one tree batch (with every node
// run before them: no per-branch state survives a forward), each giving its
// own top-K children, so every node's probability is the draft's real
// conditional, not the greedy path's.  The accepted path is then committed in
// the draft context by gather (commit_path), as in the target.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "runtime/context.h"
#include "spec/ddtree.h"
#include "spec/proposer.h"

namespace dfl {

// Draft tokens per step of a draft model unless the request sets a block (root + 8).
constexpr int kDraftModelBlock = 9;

class DraftModelProposer final : public Proposer {
 public:
  // draft: a qwen35 model with the target's vocabulary size (the caller checks
  // the tokens themselves); p: the target context's parameters (device, KV type, ...).
  // share: the same draft model's proposer of another slot: this one's context decodes on its backend, so the
  // slots' drafts can run as one forward (prefetch_many).
  DraftModelProposer(const Model& draft, const Model& target, const ContextParams& p,
                     DraftModelProposer* share = nullptr);
  const Model& draft_model() const { return ctx_.model(); }
  const char* name() const override { return "draft model"; }
  unsigned capabilities() const override { return Rank | Chain | Expand; }
  int default_block() const override { return kDraftModelBlock; }
  bool drafts_by_depth() const override { return true; }
  void reset() override;
  void prompt_done(const int32_t* prompt, int n) override { sync(prompt, n); }
  // Makes the draft context hold exactly hist[0, s): keeps the common prefix,
  // rolls the delta-net state back to it from a snapshot, feeds the rest (the
  // prompt's prefill when called at the start of a request).
  void sync(const int32_t* hist, int32_t s);
  // r.hist[0, s): the target's committed tokens; r.root: the token at position s = r.root_pos.
  // Writes ids/logp [L][K]: per depth 1..L the draft's top-K (log-softmax,
  // descending), its greedy token first.
  void propose_topk(const DraftRequest& r, int K, int32_t* ids, float* logp) override;
  // Expanding branches: the `budget` most probable nodes (cumulative draft
  // log-probability; a parent always before its children) of a tree grown L
  // depths deep from the root, running `width` nodes per depth with K
  // children each.  Costs L draft forwards of 1, 1 + width, ... nodes.
  // chain_seed: the greedy path is always run and comes first in the tree.
  // (budget = tp.budget, width = tp.expand, chain_seed = tp.chain_seed)
  DraftTree propose_tree(const DraftRequest& r, const TreeParams& tp, int K) override;
  size_t state_bytes() const override;
  // Slots whose draft contexts share a backend: every slot's catch-up (the tokens its context has not seen)
  // in one forward, then each depth of every slot's greedy chain in one (Context::forward_many, each context's
  // rows the bits they get alone); each slot keeps its ranks for its propose_topk this step.  Expanding
  // branches (propose_tree) still drafts slot by slot.
  const void* batch_key() const override { return &ctx_.backend(); }
  void prefetch_many(Proposer* const* ps, const DraftRequest* rs, int n) override;

 private:
  void feed(const int32_t* tokens, int n, int32_t pos0);  // commits n tokens at pos0.. (no logits)
  // sync without its feed: rolls back to the prefix shared with hist[0, s), commits an expanded tree's
  // accepted path; returns the tokens still to feed (hist[n_seen, s)).
  int sync_prefix(const int32_t* hist, int32_t s);
  void ensure_snapshots(int L);
  // After depth d's forward of a chain drafted from the root at s: the state is snapshot d.
  void drafted(int d, int32_t tok);

  PrefetchedRanks pf_;  // prefetch_many's ranks for this slot's next propose_topk

  Context ctx_;
  std::vector<int32_t> seen_;       // the tokens the draft context holds, positions [0, n_past)
  int32_t snap_base_ = -1;          // snapshot k: the state with n_past == snap_base_ + k + 1 (the root's position + k + 1)
  int n_snap_ = 0;
  std::vector<BackendBuf> snaps_;   // recurrent-state snapshots, one per drafted position
  std::vector<int32_t> pos_;
  // The nodes the last propose_tree ran (root first; its per-node states are
  // still in the context until the next forward): what sync commits by gather.
  int32_t tree_base_ = -1;
  std::vector<int32_t> run_tokens_, run_parent_;
};

}  // namespace dfl
