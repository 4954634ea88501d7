// lookup_proposer.h — prompt lookup: drafts what followed the same words earlier in the context.
//
// The context (prompt and reply so far, then the root) ends in an n-gram; every earlier place where the
// longest such n-gram (ngram_max down to ngram_min tokens) occurs proposes the tokens that followed it
// there.  The continuations of the most recent matches form a trie; a node's probability is the share of
// matches that agree with its path, so the tree is best-first by that share (a child never more probable
// than its parent) and the chain is the most shared path.  No weights, no forward: a step without a match
// drafts nothing and costs a scan.  What llama.cpp's ngram speculation and vLLM's prompt lookup do; code
// edits and tool-call turns that repeat the context are where it earns.
//
// How far a match reaches back says how far to trust it: on the bundled pair's HumanEval and agent replies
// the first drafted token holds 50% of the time after a 2-token match, 76% after 4, 95%+ after 8 or more.
// So each match's length is measured (up to kMaxMatch tokens, past ngram_max), and a node's log-probability
// is its share of the votes times the chance that a match that long continues, which the proposer learns
// as it goes (a decayed hit rate per length bucket, from whether its last first token was the one decided).
// Auto mode then prices a long match's tree and a 2-token coincidence's differently from the first step of
// a request on, instead of averaging them in one calibration per depth.
#pragma once
#include <vector>

#include "spec/proposer.h"

namespace dfl {

struct LookupParams {
  int ngram_min = 2, ngram_max = 4;  // n-gram lengths tried, longest first
  int max_matches = 8;               // the most recent matches that vote
  int block = 8;                     // draft tokens per step incl. the root when the request sets none
};

class LookupProposer final : public Proposer {
 public:
  explicit LookupProposer(LookupParams p = {});
  const char* name() const override { return "lookup"; }
  unsigned capabilities() const override { return Rank | Chain | OwnTree; }
  int default_block() const override { return p_.block; }
  bool weightless() const override { return true; }
  void propose_topk(const DraftRequest& r, int K, int32_t* ids, float* logp) override;
  void propose_chain(const DraftRequest& r, int32_t* tokens) override;
  DraftTree propose_tree(const DraftRequest& r, const TreeParams& tp, int K) override;
  const LookupParams& params() const { return p_; }
  void reset() override { guess_bucket_ = -1; }  // what it learnt of match lengths is kept across requests

 private:
  struct Node {
    int32_t token;
    int parent, depth, count;
  };
  // The trie of continuations (node 0 = the root) for the request; total = matches that voted (0 = none).
  void build(const DraftRequest& r);
  // The learnt chance that a match of this many tokens continues with its next token (the logp offset).
  static constexpr int kMaxMatch = 32, kBuckets = 6;
  static int bucket(int match_len);
  float continue_logp() const;
  LookupParams p_;
  std::vector<Node> trie_;
  int total_ = 0;
  int match_len_ = 0;  // the longest voting match, in tokens (at most kMaxMatch)
  // The last draft's first token, at position guess_pos_ + 1, from a match of bucket guess_bucket_ (-1: none
  // waiting); per bucket, decayed counts of first tokens that were the decided one.
  int32_t guess_pos_ = 0, guess_tok_ = 0;
  int guess_bucket_ = -1;
  double hits_[kBuckets] = {}, trials_[kBuckets] = {};
};

}  // namespace dfl
