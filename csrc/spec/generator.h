// generator.h — the decode loop as an explicit state machine.
//
//   begin:  PREFILL (target over the prompt; features to the proposer that reads them)
//   next:   EMIT the prefill's token, then one STEP per call:
//           DRAFT (a Proposer, spec/proposer.h, proposes a chain or a tree) ->
//           VERIFY (one target forward over [root, drafts], chain parents) ->
//           ACCEPT (longest prefix equal to the target's argmax, + bonus) ->
//           COMMIT (commit_path gathers the accepted nodes' KV and states;
//                   their features go to the proposer)          ... -> DONE
// AR mode is the same STEP with a block of one token and no proposer.  Auto
// mode asks the AutoController (spec/adaptive.h) each step whether to draft
// and how large a tree to verify; its AR steps still feed the proposer's features.
// The Generator holds proposers in order of preference and picks, each step,
// the first that gives the shape the mode needs (chain, ranking, tree): it has
// no branch per kind of drafter.  Auto mode holds a portfolio: one controller
// per drafter that ranks (DFlash / DFlash2, a draft model, prompt lookup), and
// each step drafts with the one expected to give the most tokens per second
// (or none: an AR step), probing each as its own controller schedules.
// It prints nothing and records each step (tokens committed, times, target
// forwards, auto's choice) for the stats.
#pragma once
#include <chrono>
#include <functional>
#include <vector>

#include "runtime/context.h"
#include "spec/adaptive.h"
#include "spec/constraint.h"
#include "spec/ddtree.h"
#include "spec/proposer.h"
#include "spec/sampler.h"
#include "util/error.h"

namespace dfl {

enum class StopReason : int { Running = 0, Length = 1, Eos = 2, ContextFull = 3 };
enum class DecodeMode : int { AR = 0, Chain = 1, DDTree = 2, Auto = 3 };

struct GenParams {
  int max_new_tokens = 256;
  bool ignore_eos = false;
  std::vector<int32_t> eos_ids;
  DecodeMode mode = DecodeMode::AR;
  int block_size = 0;  // chain/ddtree: draft block incl. the root; 0 = the drafter's block_size
  TreeParams tree;     // ddtree: budget, top-K per depth, chain seed (auto: the largest budget it may choose)
  SamplerParams sampler;  // temperature 0 = greedy
  // Log-probabilities of the emitted tokens: -1 = off; k >= 0 = each token's
  // log-softmax of the target's raw logits and the k most likely alternatives
  // (speculative modes take them from the verify rows of the accepted path).
  int n_logprobs = -1;
};

constexpr int kMaxLogprobs = 20;
struct TokenLogprob {
  int32_t token = 0;
  float logp = 0.f;
  int n_top = 0;
  int32_t top_ids[kMaxLogprobs] = {};
  float top_logp[kMaxLogprobs] = {};
};

struct GenStats {
  int prompt_tokens = 0, generated_tokens = 0, steps = 0;
  StopReason stop = StopReason::Running;
  double prefill_s = 0, decode_s = 0;
};

struct StepRecord {
  int committed = 0;        // tokens this step added to the output (z-lab's acceptance length)
  int drafted = 0;          // draft nodes verified (chain: block - 1; ddtree: tree size)
  int accepted = 0;         // drafts on the accepted path
  int tree_depth = 0;       // deepest drafted node
  int target_forwards = 0;  // always 1; counted, not assumed
  int pruned = 0;           // draft nodes a constraint forbade (dropped before the verify)
  int masked = 0;           // nodes (the root included) the constraint was asked to mask, up to the last kept (mask_s)
  double draft_s = 0, tree_s = 0, verify_s = 0, commit_s = 0, mask_s = 0;
  // auto mode: the budget verified (0 = an AR step; -1 in other modes), whether
  // the step was a forced probe, and the estimates behind the choice
  int auto_budget = -1;
  bool probe = false;
  double expected = 0, est_tok_s = 0, est_ar_tok_s = 0;
  int drafter = -1;         // auto mode: the portfolio's drafter that drafted (-1: none, and outside auto)
  int declined_learnt = 0;  // auto mode: declined trees whose tokens this step decided (observe_declined)
  int draft_batch = 0;      // slots: the blocks its drafter forward made at once (0: its own forward, or none)
  int draft_depth = 0;      // the depths asked of the drafter below the root (0: no draft)
  int merged = 0;           // auto mode: verified nodes a weightless drafter (prompt lookup) added to the tree of the
                            // drafter that drafted (tree_merge.h)
};

// Called after each prefill chunk with (tokens done, total); returning false
// abandons the prefill (a progress bar, or a daemon whose client went away).
using PrefillProgress = std::function<bool(int done, int total)>;

class Generator {
 public:
  explicit Generator(Context& ctx);
  // The attached proposers, most preferred first (the caller owns them).  The first that reads target
  // features gets them; a step drafts with the first that gives the shape its mode needs.
  void set_proposers(std::vector<Proposer*> ps);
  // Auto mode's controller of the i-th drafter of the portfolio (0: the most preferred).
  const AutoController& auto_controller(size_t i = 0) const { return autos_.at(i); }
  size_t n_drafters() const { return drafters_.size(); }
  const char* drafter_name(size_t i) const { return drafters_.at(i)->name(); }
  void set_prefill_progress(PrefillProgress fn) { progress_ = std::move(fn); }
  // Structured output (constraint.h): null = none.  Kept across requests until changed; `prune` drops
  // draft nodes the constraint forbids before they cost verify rows.
  void set_constraint(Constraint* c, bool prune = true) { constraint_ = c, prune_ = prune; }

  // n_keep > 0: the context already holds the committed state of
  // prompt[0, n_keep) (restored from a prefix cache, n_past == n_keep); only
  // the rest is prefilled.  The forward is batch-invariant, so this decodes
  // exactly as a cold begin would (the drafter starts with no features of the
  // kept positions: only its acceptance can differ).
  void begin(const int32_t* prompt, int n_prompt, const GenParams& p, int n_keep = 0);
  // Appends the tokens decided by one step; returns how many (0 when done).
  int next(std::vector<int32_t>& out);
  // One step of each of n generators (slots) whose contexts share a backend: their drafts are made one by one,
  // their verify batches run as one Context::forward_many (the row-wise work once for all; as few as the batch
  // size allows when they hold more rows than one), then each accepts and commits on its own.  outs[k] gets generator k's tokens; returns how many in all (0: all done).  Each
  // generator decides exactly what its own next() would.
  static int next_many(Generator* const* gs, int n, std::vector<int32_t>* outs);
  // Auto mode: times verify forwards of 2, 4, 8 ... max_nodes nodes (a chain after the committed text, never
  // committed: the state is untouched) and gives each size's time to every drafter's controller, so a drafter's
  // first tree of a size is priced by a measurement, not by extrapolating from an AR step (on a CPU an 8-node
  // verify costs two or more AR steps; the extrapolation said 1.7).  Decoder's warm-up calls it at load.
  void measure_verify(int max_nodes);
  bool done() const { return done_; }
  const GenStats& stats() const { return stats_; }
  const std::vector<StepRecord>& steps() const { return steps_; }
  // One entry per emitted token when GenParams::n_logprobs >= 0.
  const std::vector<TokenLogprob>& logprobs() const { return logprobs_; }

 private:
  // How many top entries a row needs: the choice (1) and the asked alternatives.
  int row_k() const { return std::max(1, p_.n_logprobs); }
  // Where a verify's top-k log-probs go: only logprobs read them (the choice is the first id)
  float* logp_rows() { return p_.n_logprobs >= 0 ? top_logp_.data() : nullptr; }
  // Records the log-probability of `token` from row `node` of the last forward.
  void record_logprob(int node, int32_t token);
  void prefill(const int32_t* prompt, int n, int first);
  int step(std::vector<int32_t>& out);
  // A step in two halves around its target forward (which next_many shares among slots): plan_step drafts and
  // fills work_ (false: nothing to do, the request ended); finish_step accepts, commits and emits.
  bool plan_step(int slots);  // slots: the requests stepping with this one (next_many), what auto's choice pays for
  // plan_step's halves: decide (auto's choice of drafter, the block size; false: the request ended), then
  // draft and fill the batch.  Between them next_many drafts, in one drafter forward, the blocks of the slots
  // whose drafters can share one (block_proposer: the proposer and request draft_step will use; null: none).
  bool decide_step(int slots);
  void draft_step();
  Proposer* block_proposer(DraftRequest* r) const;
  // The proposers a tree step asks (draft_tree, block_proposer): a hook's whole tree (DDTree mode), else the one
  // that builds the tree itself (expanding branches, or its own tree), else the ranker and the builder.
  struct TreeDrafter {
    Proposer *whole = nullptr, *expander = nullptr, *rank = nullptr;
  };
  TreeDrafter tree_drafter() const;
  // Tree nodes that fit: the budget, the KV room left and the verify batch.
  int tree_cap(int room) const { return std::min({p_.tree.budget, room - 1, ctx_.params().n_batch - 1}); }
  // A tree step's parameters with `room` positions left: its budget (kOverdraft times the cap under a pruning
  // constraint) and, unless a hook gives the whole tree, the ranks per depth it asks for (topk).
  TreeParams step_tree(int room, bool whole) const;
  int finish_step(std::vector<int32_t>& out);
  struct StepWork {
    StepRecord rec;
    int32_t s = 0;
    int remaining = 0;
    int slots = 1;
    int V = 1, room = 0;  // the step's block (root included) and the context room left
    bool speculate = false, look = false, commit = false;
    int64_t fwd0 = 0;
    Batch b;
    ForwardOutputs o;
    std::vector<int32_t> rows;
    std::chrono::steady_clock::time_point t0;
    // auto mode: a weightless drafter's tree added to the chosen drafter's (tree_merge.h): the two trees as drafted,
    // the weightless drafter (-1: no union this step) and where each node of the union is in the chosen one's (0:
    // not).  A node of the tree verified carries its union node as its tag (0: forced by a constraint).
    int merged_with = -1;
    DraftTree own, added;
    std::vector<int32_t> union_from_own;
    int32_t own_index(int32_t tag) const { return tag > 0 ? union_from_own[(size_t)tag - 1] : 0; }
  };
  StepWork work_;
  // The first attached proposer with capability c (null: none).
  Proposer* first(Proposer::Capability c) const;
  // Draft tokens per step when the request sets none: the first positive default (0: none).
  int default_block() const;
  DraftRequest request(int32_t s, int V) const { return DraftRequest{s, pending_, hist_.data(), V - 1}; }
  // The drafter that ranks for this step's tree: auto's choice, else the first that ranks.
  Proposer* ranker() const { return chosen_ >= 0 ? drafters_[(size_t)chosen_] : first(Proposer::Rank); }
  // Draft tokens per step (the root included) with drafter k of the portfolio: the request's block size, else
  // the drafter's own default, else the request's block.
  int block_of(int k) const;
  void draft_chain(int32_t s, int V, StepRecord& rec);
  void draft_tree(int32_t s, int V, int room, StepRecord& rec, bool probe, bool look);
  // Auto mode, a step drafted by a drafter that costs a forward: a weightless drafter's tree (prompt lookup's, when
  // it has a match) joins the drafted tree t (tree_merge.h), every node priced by its own drafter's
  // calibration in the chosen controller's terms, cut to `cap` nodes.
  void merge_weightless_drafter(int32_t s, int room, const TreeParams& tp, int cap, DraftTree& t);
  bool merge_trees_ = true;  // DFLASH27B_TREE_MERGE=0 turns the union off (bench/portfolio_cpu.py's A/B)
  // The most a step drafted with controller ac may lose in its worst case (seconds): the request's allowance
  // for a bet or a probe; a drafter's first, measuring probe is not the request's to bound.
  double allowed_loss_s(const AutoController& ac, bool probe) const;
  bool is_eos(int32_t t) const;
  // The target's choice for the token at absolute position pos from one raw
  // logits row, the sequence before it being hist_ then extra[0, n_extra)
  // (a tree node's ancestors): penalties first, then the sampler.
  // mask: the tokens allowed there (a constraint's), null = all.
  int32_t pick(const float* row, int64_t pos, const int32_t* extra = nullptr, int n_extra = 0,
               const uint32_t* mask = nullptr);
  // Whole logits rows must come back (sampling, penalties or a constraint), not just the device's top-k.
  bool need_rows() const { return !greedy() || p_.sampler.penalized() || p_.sampler.biased() || constraint_; }
  // The constraint's masks for the step's chain (tokens_ / parent_ / depth_), pruned as constrain_tree does
  // (trees go through constrain_tree directly, before auto prices them).
  void constrain_step(StepRecord& rec);
  // Up to cap tokens the constraint forces after the decided ones.
  std::vector<int32_t> forced_tokens(int cap);
  // The same for a drafted tree before auto mode prices it: masks, the forbidden nodes dropped, the rest cut to
  // `cap` nodes in builder order (a tree drafted kOverdraft times larger keeps `cap` allowed nodes).
  void constrain_tree(DraftTree& t, int cap, StepRecord& rec);
  static constexpr int kOverdraft = 3;
  bool capturing() const { return !readers_.empty() && p_.mode != DecodeMode::AR; }
  // Hands committed positions' captured rows (or their skipping: captured null) to every feature reader.
  void give_features(int32_t pos0, int n, const float* captured, const int32_t* rows, const int32_t* tokens);

  Context& ctx_;
  std::vector<Proposer*> proposers_;
  // The proposers that read the target's hidden features, where each one's layers start in a captured row
  // (in floats), and the layers captured: the union of theirs, each reader's own consecutive and in its order.
  std::vector<Proposer*> readers_;
  std::vector<size_t> reader_offset_;
  int feature_capacity_ = 0;  // the most newest positions any reader can use
  // Auto mode: one controller per drafter that ranks (drafters_), kept across requests (the costs belong to
  // this device and pair); the drafter of the step in flight (-1: none) and its drafted tree (builder order)
  // for its observation.
  std::vector<Proposer*> drafters_;
  std::vector<AutoController> autos_;
  LossAllowance allowance_;  // the request's: what auto's bets may still lose
  int chosen_ = -1;
  DraftTree auto_tree_;
  // Trees auto mode drafted and declined (AR won the step), waiting for the tokens they guessed to be decided;
  // then their drafter's controller learns which nodes the text followed (observe_declined).
  struct Declined {
    int drafter;
    int32_t root_pos;
    DraftTree tree;
  };
  static constexpr size_t kMaxDeclined = 16;
  std::vector<Declined> declined_;
  int resolve_declined();  // returns how many it learnt from
  PrefillProgress progress_;
  Constraint* constraint_ = nullptr;
  bool prune_ = true;
  std::vector<uint32_t> masks_;  // [node][mask_words]
  bool masks_ready_ = false;  // constrain_tree ran for this step's tree
  GenParams p_;
  int block_ = 1;
  GenStats stats_;
  std::vector<StepRecord> steps_;
  std::vector<TokenLogprob> logprobs_;
  std::vector<float> logits_;
  // Greedy decoding needs only each row's argmax and the drafts' top-K: they
  // are computed where the logits are (top_ids_ / top_logp_), no rows move.
  bool greedy() const { return p_.sampler.temperature <= 0.f; }
  std::vector<int32_t> top_ids_;
  std::vector<float> top_logp_;
  std::vector<std::pair<float, int32_t>> sample_scratch_;
  std::vector<int32_t> hist_;          // the tokens at positions [0, n_past): what penalties count
  std::vector<int32_t> penalty_scratch_;
  std::vector<float> row_scratch_;
  // the step's verify batch: node 0 = root, then drafts (chain: parent i-1)
  std::vector<int32_t> tokens_, parent_, depth_, pos_, capture_;
  int32_t pending_ = -1;  // decided but not yet fed to the target
  bool first_emitted_ = false;
  bool done_ = true;
};

}  // namespace dfl
