// constraint.h — structured output: which tokens may come next, decided by the caller's matcher (a JSON
// schema or grammar compiled by llguidance, in Python).
//
// The Generator asks once per step for a mask per verified node, before the verify runs (the tree's tokens
// are known then), prunes draft nodes their parent's mask forbids, and picks every token, the bonus
// included, among the allowed ones: a constrained reply is the constrained AR reply in every mode.  The
// distribution is defined once: disallowed logits become -inf before penalties, filters, temperature and
// the draw (or the greedy argmax).
#pragma once
#include <cstdint>
#include <functional>

namespace dfl {

class Constraint {
 public:
  virtual ~Constraint() = default;
  // For nodes 0..n-1 of a step: node 0 is the last decided token (already committed to the matcher), node
  // i > 0 the path of its ancestors' tokens after node 0 and its own (parents[i] < i).  Sets bit t of
  // masks[i * words + t / 32] (words = (n_vocab + 31) / 32) when token t may follow node i.  A node whose
  // own token its parent's mask forbids is never reached: its mask may be anything.  The caller keeps the
  // first `keep` nodes i > 0 (in order) whose parent is kept (node 0 is) and, under pruning, allowed by its
  // parent's mask; masks of the nodes after the keep-th are never read, so a matcher may stop there (a
  // pruned tree is drafted past its cap, and most of a mask's cost is the nodes beyond it).
  virtual void masks(int n, const int32_t* tokens, const int32_t* parents, int keep, uint32_t* masks) = 0;
  // The tokens just decided, in order: the prefill's, then each step's accepted drafts and bonus.
  virtual void commit(const int32_t* tokens, int n) = 0;
  // Up to cap tokens the constraint forces after the decided ones (each the only token it allows there),
  // in order: drafts that cannot miss.  Default: none known.
  virtual int forced(int32_t* /*out*/, int /*cap*/) { return 0; }
};

inline int mask_words(int n_vocab) { return (n_vocab + 31) / 32; }
inline bool mask_allows(const uint32_t* mask, int32_t t) { return (mask[t >> 5] >> (t & 31)) & 1u; }

// A constraint given as two callbacks (the C API's).
class CallbackConstraint final : public Constraint {
 public:
  using MasksFn = std::function<void(int, const int32_t*, const int32_t*, int, uint32_t*)>;
  using CommitFn = std::function<void(const int32_t*, int)>;
  using ForcedFn = std::function<int(int32_t*, int)>;
  CallbackConstraint(MasksFn m, CommitFn c, ForcedFn f = nullptr)
      : masks_(std::move(m)), commit_(std::move(c)), forced_(std::move(f)) {}
  void masks(int n, const int32_t* tokens, const int32_t* parents, int keep, uint32_t* out) override {
    masks_(n, tokens, parents, keep, out);
  }
  void commit(const int32_t* tokens, int n) override { commit_(tokens, n); }
  int forced(int32_t* out, int cap) override { return forced_ ? forced_(out, cap) : 0; }

 private:
  MasksFn masks_;
  CommitFn commit_;
  ForcedFn forced_;
};

}  // namespace dfl
