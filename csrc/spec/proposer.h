// proposer.h — every draft source behind one interface.
//
// The Generator verifies what a Proposer drafts; it never knows which kind of
// drafter it holds.  A proposer answers in one of three shapes, each a
// capability it declares:
//   Rank   per depth 1..L below the root, its K best tokens with log-probs
//          ([L][K], best first): chain mode takes the top-1 path, DDTree and
//          auto build their best-first tree from it;
//   Chain  a chain of L tokens (a proposer that cannot rank: a test hook);
//   Tree   a whole tree under a node budget (a tree hook; a draft model
//          expanding branches with Expand; a drafter whose children depend
//          on their parent's token, DFlash2's selector, with OwnTree).
// Its lifecycle follows the request: reset at begin, the kept prefix of a
// prefix-cache hit, the prompt after the prefill, and every committed step.
// A proposer that reads the target's hidden features (DFlash) names the
// layers; the Generator captures them in the same forward and hands each
// committed position's rows over (prefill chunks, then accepted paths) — the
// feature ring is the proposer's, not the loop's.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "spec/ddtree.h"

namespace dfl {

// The block to draft: root at root_pos, L tokens below it; hist[0, root_pos) are the committed tokens.
struct DraftRequest {
  int32_t root_pos = 0;
  int32_t root = 0;
  const int32_t* hist = nullptr;
  int L = 0;
  int K = 0;  // prefetch_many's hint: the ranks per depth the step's propose call will ask for (0: not known)
  bool expand = false;  // prefetch_many's hint: the step expands branches (propose_tree with tp.expand > 0)
};

// A ranking proposer's prefetch_many result kept for its slot's propose_topk this step: ranks [L][k] for one
// root, valid for any K <= k (top-k lists are best first, lower id first on ties: a smaller K is a prefix).
struct PrefetchedRanks {
  bool valid = false;
  int32_t root_pos = 0, root = 0;
  int L = 0, k = 0;
  std::vector<int32_t> ids;
  std::vector<float> logp;
  void start(const DraftRequest& r, int k_) {
    valid = true, root_pos = r.root_pos, root = r.root, L = r.L, k = k_;
    ids.resize((size_t)(L > 0 ? L : 0) * k), logp.resize(ids.size());
  }
  // Writes request r's [r.L][K] ranks when they were prefetched, and spends them; false: draft as usual.
  bool take(const DraftRequest& r, int K, int32_t* out_ids, float* out_logp) {
    const bool hit = valid && root_pos == r.root_pos && root == r.root && L == r.L && K <= k;
    valid = false;
    if (!hit) return false;
    for (int d = 0; d < L; ++d)
      for (int j = 0; j < K; ++j) {
        out_ids[(size_t)d * K + j] = ids[(size_t)d * k + j];
        out_logp[(size_t)d * K + j] = logp[(size_t)d * k + j];
      }
    return true;
  }
};

class Proposer {
 public:
  enum Capability : unsigned { Rank = 1u, Chain = 2u, Tree = 4u, Expand = 8u, OwnTree = 16u };
  virtual ~Proposer() = default;
  virtual const char* name() const = 0;
  virtual unsigned capabilities() const = 0;
  bool can(Capability c) const { return (capabilities() & c) != 0; }
  // Draft tokens per step, the root included, when the request sets none (0: no default).
  virtual int default_block() const { return 0; }
  // Whether each depth below the root costs a forward of its own (an autoregressive drafter: the MTP head, a
  // draft model): auto mode then drafts no deeper than the tree it expects to verify needs, and one depth
  // more to see whether it should grow (a one-forward block drafter keeps its block).
  virtual bool drafts_by_depth() const { return false; }
  // Whether it drafts without a forward of its own (prompt lookup: a scan of the context): auto mode then adds
  // its tree to the step of a drafter that does run one (tree_merge.h), for the price of verify rows alone.
  virtual bool weightless() const { return false; }

  // Rank: ids / logp [r.L][K].
  virtual void propose_topk(const DraftRequest& r, int K, int32_t* ids, float* logp);
  // Chain: r.L tokens; by default the top-1 of each depth.
  virtual void propose_chain(const DraftRequest& r, int32_t* tokens);
  // Tree: at most tp.budget nodes in builder order (DraftTree: parent before child, parent 0 = the root).
  // Log-probs are filled where the proposer knows them (a hook's tree carries 0).  Tree: always this shape;
  // Expand: this shape when the request asks for expanding branches (tp.expand > 0);
  // OwnTree: this shape for DDTree and auto (best-first with log-probs, as the builder's), instead of Rank.
  virtual DraftTree propose_tree(const DraftRequest& r, const TreeParams& tp, int K);

  // Slots (Generator::next_many): proposers whose drafts for several slots can run as one forward give the
  // same non-null key (a DFlash drafter: its draft model); prefetch_many(ps, rs, n) then drafts every slot's
  // request at once, called on ps[0] with each ps[k] of that key, and each keeps its own result for its slot's
  // propose_* call this step (the same bits as drafting alone).
  virtual const void* batch_key() const { return nullptr; }
  virtual void prefetch_many(Proposer* const* /*ps*/, const DraftRequest* /*rs*/, int /*n*/) {}

  // Lifecycle: every attached proposer is reset when a request begins; in a request that drafts (any mode
  // but AR) it then sees the prompt once the target has it (a proposer with a context of its own catches up)
  // and, when it reads features, every committed position (a prefix-cache hit's kept positions as skipped).
  virtual void reset() {}
  virtual void prompt_done(const int32_t* /*prompt*/, int /*n*/) {}

  // Target features (DFlash, the MTP head): the target layers whose output to capture (null: none), how many
  // of the newest positions can still reach the drafter, and the captured rows of committed positions: rows[i]
  // of `captured` (on the target's backend) is position pos0 + i; rows null = consecutive; captured null = the
  // positions are skipped (never needed); tokens: the tokens at those positions (null with captured null).
  // Several proposers may read features at once (DFlash and the MTP head in one portfolio): the forward
  // captures the union of their layers, so `captured` points at this proposer's first layer in row 0 and
  // `stride` floats separate one row from the next (its own layers, in its order, lie consecutively).
  virtual const std::vector<int32_t>* feature_layers() const { return nullptr; }
  virtual int feature_capacity() const { return 0; }
  virtual void take_features(int32_t /*pos0*/, int /*n*/, const float* /*captured*/, size_t /*stride*/,
                             const int32_t* /*rows*/, const int32_t* /*tokens*/) {}

  // Bytes of state it keeps per context (KV, rings, snapshots): what a memory plan counts.
  virtual size_t state_bytes() const { return 0; }

 private:
  std::vector<int32_t> chain_ids_;  // propose_chain's top-1 ranking
  std::vector<float> chain_logp_;
};

}  // namespace dfl
