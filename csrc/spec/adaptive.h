// adaptive.h — `auto` mode: each step, AR or a DDTree of the budget that
// maximises expected tokens per second, from what the engine measures while
// it decodes.
//
// Two things are estimated online:
//  * cost, for this device and pair: one AR step; the drafter forward, tree
//    build and commit of a speculative step; a verify forward as a function of
//    its node count (a table of per-size averages, interpolated between sizes
//    seen and extrapolated by the last slope);
//  * acceptance, for the current text: a node's chance to be on the accepted
//    path is its draft path probability (the product the DDTree builder ranks
//    by) times a per-depth calibration learnt from the nodes verified so far.
// Because the builder adds nodes best-first, the tree of budget b is the first
// b nodes of the largest tree, and its expected accepted length is a prefix
// sum: one draft prices every budget.  Before a step the controller decides
// whether drafting pays, using the last drafted tree as the forecast; after
// drafting it picks the budget (0 = verify the root alone, an AR step).  The
// forecast is trusted only while recent speculative steps really delivered
// more tokens per second than AR: a forecast that keeps losing is overruled.
//
// Exploration is bounded: while AR wins, a probe (a forced speculative step)
// runs after enough AR steps that its measured loss is at most kProbeShare of
// the AR time between probes.  A probe refreshes the acceptance statistics
// (which decay, so they follow the text); when they change enough that the
// forecast beats AR, speculation resumes at once.  Every choice is lossless,
// so the output is AR's whatever the controller decides.
#pragma once
#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

namespace dfl {

struct StepRecord;

// What the chooser knows about costs (seconds) and acceptance.
struct AutoEstimates {
  double ar_s = 0;                        // one AR step (0: not measured yet)
  // draft_s: the drafter forward of the block being decided (AutoController::price_block: draft_rows_s at its
  // rows); a block drafter's forward grows with its rows (on a CPU a 16-row DFlash block costs 4x a 4-row one)
  double draft_s = 0, tree_s = 0, commit_s = 0;
  std::map<int, double> draft_rows_s;     // drafter forward time by block rows (root included)
  std::map<int, double> verify_s;         // verify forward time by node count (root included)
  std::vector<double> depth_calib;        // [depth] multiplier on the draft path probability
  // Structured output: a constraint's masks are host time of the step that asks for them (llguidance walks
  // the tree: every drafted node, an overdraft of up to 3x the budget under pruning, against the root alone in
  // an AR step).  Kept apart from the drafter's costs (tree_s), which hold for every request, and priced only
  // while the request has a constraint.
  double mask_ar_s = 0;                   // an AR step's masks (learnt on constrained AR steps, by every drafter)
  double mask_tree_s = 0;                 // this drafter's tree's masks (learnt on its constrained tree steps)
  bool constrained = false;               // the current request has a constraint
  // what the current request's steps pay for masks: an AR step's, a tree's (0 without a constraint)
  double ar_masks_s() const { return constrained ? mask_ar_s : 0.0; }
  double tree_masks_s() const { return constrained ? mask_tree_s : 0.0; }
  // Verify time of n nodes: verify_s (and ar_s at 1 node) interpolated between
  // sizes seen, extrapolated beyond by the last slope.
  std::vector<std::pair<int, double>> verify_points() const;
  static double verify_at(const std::vector<std::pair<int, double>>& points, int n_nodes);
  // A draft of `rows` block rows: draft_rows_s interpolated the same way (0: none timed yet).
  double draft_at(int rows) const;
  // Depths deeper than any seen take the deepest one's calibration (a drafter
  // wrong at depth d is no better below it); none seen: 1.
  double calib(int depth) const {
    if (depth_calib.size() <= 1) return 1.0;
    return depth_calib[(size_t)std::min<int>(depth, (int)depth_calib.size() - 1)];
  }
};

struct AutoChoice {
  int budget = 0;             // draft nodes to verify (0: AR)
  double expected = 0;        // expected committed tokens (bonus included)
  double tok_s = 0;           // expected tokens per second of that step
  double ar_tok_s = 0;        // expected tokens per second of an AR step
  int depth = 0;              // the deepest of those nodes (0: AR)
};

// The worst case of a drafter's smallest step against an AR step (seconds): draft, tree, commit and a 2-node
// verify for the one token it is sure to give.  slots: the requests of a shared step (Generator::next_many),
// each of which waits the whole of it, so the loss counts once for each (as a probe's does).  The verify term
// is never below nothing: in a shared step the AR estimate is the whole batch's step while the verify sizes
// may have been timed for this request alone (the warm-up), and a 2-node tree never makes a forward cheaper.
double worst_loss_s(const AutoEstimates& e, int slots = 1);

// The best budget in [min_budget, n] for a drafted tree whose nodes (in the
// builder's order) have these depths and path log-probabilities.  The draft
// is priced in (`with_draft`) when deciding before drafting.
// A tree must beat AR's tokens/s by min_gain (a share) to be chosen over it.  slots: the requests whose
// steps share this one's forward (their rows in one batch: the estimates' step times are such steps').  A
// tree then pays only if the batch as a whole gains: its step gives slots - 1 + (1 + accepted) tokens in its
// cost, against slots tokens in an AR step's — the bar rises as slots fill (tok_s / ar_tok_s: the batch's).
AutoChoice choose_budget(const AutoEstimates& e, const int32_t* depth, const float* logp, int n, int min_budget,
                         bool with_draft, double max_loss = 1e300, double min_gain = 0, int slots = 1,
                         double slack = 0, double max_worst = 1e300);

// Auto mode's promise for each request: never below 0.95x AR's speed, short requests included.  Every
// speculative step is a bet whose worst case (no draft accepted: its whole time for one token) costs more than
// an AR step.  The request's allowance is kShare of its AR time (max_new_tokens AR steps) plus what its bets
// have won so far, less what they have lost, counted in AR steps of the time each was made; a bet whose worst
// case exceeds its share of what is left is not made (a smaller tree, or AR).  Early in a short request little
// is at stake, so only cheap bets run; once a tree has won, larger ones may.  Probes, which explore rather than
// bet, draw on a share of their own, kProbeShare, spent by whichever drafter of a portfolio probes (each
// drafter's spacing, AutoController::kProbeShare, only says how often it may; a portfolio of two drafters that
// probe could otherwise spend twice the share); the two together are 3% of the request's AR time, so that
// the promise keeps 2% for what no step prices (a drafter's feature copies on AR steps, a step's timing drift)
// (at 3% + 2% a request whose drafters never paid spent the whole 5%: the tiny pair's MTP head alone measured
// 0.945x AR over 40 HumanEval requests).  (A request that stops early at an EOS had a smaller AR time than
// its max_new_tokens promised: it can end below the floor by up to the allowance.)
class LossAllowance {
 public:
  static constexpr double kShare = 0.02, kProbeShare = 0.01;
  void begin(int max_new_tokens) { n_new_ = std::max(max_new_tokens, 0), lost_ = 0, probe_lost_ = 0; }
  // A step that drafted, once done (ar_s: the AR step's time then): a verified tree's whole time against AR's
  // for the tokens it gave; a declined one's draft alone (its verify was an AR step).  A probe's loss is
  // charged to the probes' share (what a probe wins gives the bets nothing: exploring is not a bet).
  // expected_s: what the step was expected to cost (AutoController::expected_step_s; 0: unknown); its time
  // counts at most kOutlier times that.  The allowance bounds what wrong bets lose, not the machine's noise:
  // a stall (another process, a page fault storm) would have hit an AR step alike, and one 100 ms stall on a
  // loaded machine had spent a 256-token request's whole allowance (20 AR steps of 2.5 ms) on a tree that won.
  void settle(const StepRecord& rec, double ar_s, double expected_s = 0);
  // Seconds one step may lose in its worst case (AR steps of ar_s).  A bet: kOneBet of what is left, so a
  // first bet that fails leaves room for the next (one 8-node tree missing at once would otherwise end a short
  // request's bets).  A probe: what is left of the probes' share.
  static constexpr double kOneBet = 0.5;
  double bet_s(double ar_s, bool probe = false) const {
    if (probe) return std::max(0.0, kProbeShare * n_new_ - probe_lost_) * ar_s;
    return kOneBet * std::max(0.0, kShare * n_new_ - lost_) * ar_s;
  }

 private:
  int n_new_ = 0;
  double lost_ = 0;        // AR steps the bets lost so far (negative: won)
  double probe_lost_ = 0;  // AR steps the probes lost so far
};

class AutoController {
 public:
  static constexpr double kProbeShare = 0.02;  // a probe's measured loss vs the AR time between probes
  static constexpr int kMinProbeGap = 8, kMaxProbeGap = 512;
  static constexpr int kFirstProbeBudget = 1;  // small: its job is to measure, not to win

  // Before a step: whether to draft (else an AR step), in two halves for a portfolio of drafters (one
  // controller each) of which one step drafts with at most one: wish() says what this drafter would do (no
  // state changes), decided() records whether it did.  A wish's `probe` is a forced exploration; its
  // `forecast` is the choice the last drafted tree predicts.  remaining: the request's tokens still to come;
  // a probe whose measured loss would exceed kRequestShare of their AR time waits for a longer request (the
  // request's LossAllowance bounds what all its probes spend, by the same share).
  static constexpr double kRequestShare = LossAllowance::kProbeShare;
  static constexpr double kFreeDraftShare = 0.05;  // draft + tree time below this share of an AR step: draft always
  struct Wish {
    bool draft = false, probe = false;
    bool look = false;  // a free drafter drafting to see this step's own tree, not expected to win
    AutoChoice forecast;
    // a portfolio's order: an expected winner, then a due probe, then a free look
    int rank() const { return !draft ? 0 : look ? 1 : probe ? 2 : 3; }
  };
  Wish wish(int remaining = 1 << 30, int slots = 1) const;
  // Before wish(): the rows of the block this drafter would draft this step (its block, shortened at a
  // request's end); the estimates' draft_s is then that block's, and the step's draft time is learnt for them.
  void price_block(int rows);
  // dfl::worst_loss_s of this drafter's estimates: a step is not drafted when it exceeds the request's
  // LossAllowance.
  double worst_loss_s(int slots = 1) const { return dfl::worst_loss_s(e_, slots); }
  void decided(const Wish& w, bool drafted, int remaining = 1 << 30);
  // After drafting a tree of n nodes (builder order): the budget to verify.  A look's tree must beat AR by
  // kLookGain: a free drafter looks every step, and bets that win by less on average lose often enough to
  // put a short request below AR's speed (two or three failed 3-node trees cost 5% of a 32-token request on
  // the bundled pair; with 0.15 the lowest 32-token request was 0.92x AR, with 0.3 0.96x, long requests
  // unchanged: bench/portfolio_cpu.py).
  static constexpr double kLookGain = 0.3;
  // Any other tree must beat AR by kSpecGain, and a larger tree the smaller one by kTreeSlack: a 16-node tree
  // expected to win 5% over AR lost 6 AR steps of a 32-token request when its first node missed; the
  // estimates are not sharp enough to stake that much on a few percent.
  static constexpr double kSpecGain = 0.1, kTreeSlack = 0.03;
  // max_worst: the request's LossAllowance less the draft already spent (seconds): the largest worst-case loss
  // a budget may have; none fits: AR.
  AutoChoice choose(const int32_t* depth, const float* logp, int n, bool probe, bool look = false, int slots = 1,
                    double max_worst = 1e300);
  // After the step: its timings, and for a speculative one which of the
  // verified nodes (1..budget) were accepted (`on_path`, indexed like depth).
  void observe_ar(double step_s);
  // A constrained AR step's masks (s seconds).  set_constrained: whether the request now beginning has a
  // constraint (AR steps and trees are then priced with their masks).
  void observe_ar_masks(double s);
  void set_constrained(bool on) { e_.constrained = on; }
  // An AR step of the current request: the forward, and under a constraint its masks.
  double ar_step_s() const { return e_.ar_s + e_.ar_masks_s(); }
  // A verify forward of n_nodes (root included) timed outside a step (Generator::measure_verify, at load).
  void observe_verify(int n_nodes, double s);
  // n_learn: the nodes (of depth / logp / on_path) that are this drafter's to learn acceptance from (-1: all
  // `budget`; a union with another drafter's tree passes its own verified nodes only).
  void observe_spec(const StepRecord& rec, const int32_t* depth, const float* logp, int budget,
                    const std::vector<uint8_t>& on_path, int n_learn = -1);
  // What a drafted step is expected to cost before its timings move the estimates (seconds; 0 before an AR
  // step, or a draft, has been timed): its block's draft, the tree, its masks, and for budget > 0 the verify of
  // budget + 1 nodes and the commit.  The bound on what one stalled step counts (kOutlier times this).
  double expected_step_s(int budget) const;
  static constexpr double kOutlier = 2.0;
  // A step's time as it counts (in the realized rate, a probe's loss, the allowance): at most kOutlier times
  // what it was expected to cost (0: unknown, as it is).
  static double bounded(double spent_s, double expected_s) {
    return expected_s > 0 ? std::min(spent_s, kOutlier * expected_s) : spent_s;
  }
  // A drafted tree that was not verified (AR won the step) once its tokens are decided: which of its n nodes
  // the decided tokens follow.  Acceptance only, no cost: a declined look still teaches what the drafter is
  // worth on the current text, so the estimate does not go stale while the drafter stops being verified.
  void observe_declined(const int32_t* depth, const float* logp, int n, const uint8_t* on_path);
  // A new request: the acceptance statistics (another text's) weigh as kNewRequestWeight of their mass, so
  // the new text's first steps outweigh them; costs (this device's) stay.
  static constexpr double kNewRequestWeight = 0.25;
  void new_request();
  const AutoEstimates& estimates() const { return e_; }
  // After choose() on a tree that holds another drafter's nodes (tree_merge.h): the forecast for the next
  // step is this drafter's own tree, not the union (the other drafter's nodes are priced where they come).
  void keep_forecast(const int32_t* depth, const float* logp, int n) {
    last_depth_.assign(depth, depth + n);
    last_logp_.assign(logp, logp + n);
  }
  // Whether a speculative step of this drafter has been measured: until then its probe is the one that
  // measures (once a decoder, at its warm-up), which no request's allowance bounds.
  bool measured() const { return have_spec_; }

 private:
  // The decayed per-depth sums, one observation of n nodes (predicted path probability vs on the path).
  void learn_acceptance(const int32_t* depth, const float* logp, int n, const uint8_t* on_path);
  AutoEstimates e_;
  std::vector<double> pred_, hit_;          // per depth: decayed sums of predicted and observed acceptance
  std::vector<int32_t> last_depth_;         // the last drafted tree: the forecast for the next step
  std::vector<float> last_logp_;
  bool have_spec_ = false;
  double spec_rate_ = 0;                    // realized tokens/s of recent speculative steps (EMA)
  int since_probe_ = 0, probe_gap_ = kMinProbeGap;
  double probe_loss_ = -1;                  // the last probe's measured loss (s; -1: none yet)
  int remaining_ = 1 << 30;                 // the request's tokens still to come (decided()'s)
  int block_rows_ = 0;                      // the rows of the block price_block priced (every step, before wish)
};

}  // namespace dfl
