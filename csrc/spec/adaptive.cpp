// adaptive.cpp — the auto-mode controller (see adaptive.h).
#include "spec/adaptive.h"

#include <algorithm>
#include <cmath>

#include "spec/generator.h"

namespace dfl {

namespace {
constexpr double kTimeEma = 0.3;    // weight of a new timing
constexpr double kAcceptDecay = 0.8;  // per speculative step: how fast the acceptance statistics forget
constexpr double kCalibPrior = 0.5;   // pseudo-count pulling an unseen depth's calibration to 1
constexpr double kUnknownSlope = 0.1; // per extra node, as a share of one node's cost, before two sizes are seen
// A new timing counts at most AutoController::kOutlier times what is expected.
// One stalled step (another process, a page fault storm) must not price a tree
// size out for good: the controller seldom revisits a size it believes slow, so
// an outlier left unbounded would stay in the estimate.  A real rise still gets
// through, 30% a step (kTimeEma of the doubled value).
constexpr double kOutlier = AutoController::kOutlier;

// `expected`: the bound's reference for a first timing (0: none, the timing is taken as it is).
void ema(double& v, double x, double expected = 0) {
  const double ref = v > 0 ? v : expected;
  if (ref > 0) x = std::min(x, kOutlier * ref);
  v = v > 0 ? (1 - kTimeEma) * v + kTimeEma * x : x;
}
}  // namespace

std::vector<std::pair<int, double>> AutoEstimates::verify_points() const {
  std::vector<std::pair<int, double>> pts(verify_s.begin(), verify_s.end());  // ascending node counts
  if (ar_s > 0 && (pts.empty() || pts.front().first != 1)) pts.insert(pts.begin(), {1, ar_s});
  return pts;
}

double AutoEstimates::verify_at(const std::vector<std::pair<int, double>>& pts, int n) {
  if (pts.empty()) return 0;
  auto hi = std::lower_bound(pts.begin(), pts.end(), std::make_pair(n, -1.0));
  if (hi != pts.end() && hi->first == n) return hi->second;
  if (hi == pts.begin()) return hi->second;  // below every size seen: no cheaper than the smallest
  auto lo = std::prev(hi);
  if (hi != pts.end())  // between two sizes seen
    return lo->second + (hi->second - lo->second) * (n - lo->first) / (double)(hi->first - lo->first);
  // beyond the largest size seen: the last slope (never negative)
  double slope = kUnknownSlope * lo->second;
  if (lo != pts.begin()) {
    auto lo2 = std::prev(lo);
    slope = std::max(0.0, (lo->second - lo2->second) / (double)(lo->first - lo2->first));
  }
  return lo->second + slope * (n - lo->first);
}

double AutoEstimates::draft_at(int rows) const {
  if (draft_rows_s.empty()) return 0;
  const std::vector<std::pair<int, double>> pts(draft_rows_s.begin(), draft_rows_s.end());
  return verify_at(pts, rows);
}

AutoChoice choose_budget(const AutoEstimates& e, const int32_t* depth, const float* logp, int n, int min_budget,
                         bool with_draft, double max_loss, double min_gain, int slots, double slack,
                         double max_worst) {
  AutoChoice best;
  const std::vector<std::pair<int, double>> verify = e.verify_points();  // once per call, not per budget
  // under a constraint a step's masks are host time of that step, an AR step's (the root) and a tree's (every
  // drafted node) alike
  const double ar = (e.ar_s > 0 ? e.ar_s : AutoEstimates::verify_at(verify, 1)) + e.ar_masks_s();
  const double others = std::max(slots, 1) - 1.0;  // the other slots' tokens of the shared step
  best.ar_tok_s = ar > 0 ? (others + 1.0) / ar : 0.0;
  best.budget = 0;
  best.expected = 1.0;
  best.tok_s = best.ar_tok_s;
  bool have = min_budget <= 0;
  const double fixed = (with_draft ? e.draft_s : 0.0) + e.tree_s + e.commit_s + e.tree_masks_s();
  double accepted = 0;  // expected accepted drafts of the first b nodes
  int deepest = 0;
  for (int b = 1; b <= n; ++b) {
    accepted += std::min(1.0, e.calib(depth[b - 1]) * std::exp((double)logp[b - 1]));
    deepest = std::max(deepest, (int)depth[b - 1]);
    if (b < min_budget) continue;
    const double cost = fixed + AutoEstimates::verify_at(verify, b + 1);
    if (cost - ar > max_worst) break;  // its worst case (one token for the whole step) is more than the request affords
    const double rate = cost > 0 ? (others + 1.0 + accepted) / cost : 0.0;
    // a probe's tree grows only while its expected loss against AR stays affordable (its smallest always is)
    if (b > std::max(min_budget, 1) && cost - ar * (1.0 + accepted) > max_loss) break;
    // AR is beaten only by more than min_gain, a smaller tree by a larger one only by more than slack (ties
    // keep the smaller tree)
    if (!have || rate > best.tok_s * (1.0 + (best.budget == 0 ? min_gain : slack))) {
      best.budget = b;
      best.depth = deepest;
      best.expected = 1.0 + accepted;
      best.tok_s = rate;
      have = true;
    }
  }
  return best;  // (a probe with no budget affordable: AR)
}

void LossAllowance::settle(const StepRecord& rec, double ar_s, double expected_s) {
  if (ar_s <= 0) return;
  const double spent = AutoController::bounded(
      rec.draft_s + rec.tree_s + (rec.auto_budget > 0 ? rec.verify_s + rec.commit_s : 0.0), expected_s);
  const double loss = spent / ar_s - (rec.auto_budget > 0 ? rec.committed : 0);
  if (rec.probe) probe_lost_ += std::max(0.0, loss);
  else lost_ += loss;
}

double worst_loss_s(const AutoEstimates& e, int slots) {
  const double verify_extra = std::max(0.0, AutoEstimates::verify_at(e.verify_points(), 2) - e.ar_s);
  const double mask_extra = std::max(0.0, e.tree_masks_s() - e.ar_masks_s());
  return std::max(slots, 1) * (e.draft_s + e.tree_s + e.commit_s + verify_extra + mask_extra);
}

AutoController::Wish AutoController::wish(int remaining, int slots) const {
  Wish w;
  w.forecast = choose_budget(e_, last_depth_.data(), last_logp_.data(), (int)last_depth_.size(), 0,
                             /*with_draft=*/true, 1e300, 0, slots);
  const AutoChoice& c = w.forecast;
  if (e_.ar_s <= 0) return w;                   // the first step measures AR
  if (!have_spec_) {                            // the second one measures speculation, small
    w.draft = w.probe = true;
  } else if (c.budget > 0 && c.tok_s > c.ar_tok_s && spec_rate_ > c.ar_tok_s / std::max(slots, 1)) {
    w.draft = true;
  } else if (since_probe_ + 1 >= probe_gap_ * std::max(slots, 1) &&
             (probe_loss_ < 0 || probe_loss_ * std::max(slots, 1) <= kRequestShare * ar_step_s() * remaining)) {
    // (a probe stalls every slot of a shared step: it is spaced and bounded by what it costs them all)
    w.draft = w.probe = true;
  } else if (e_.draft_s + e_.tree_s + e_.tree_masks_s() < kFreeDraftShare * ar_step_s()) {
    // (under a constraint a look's tree is masked before it is priced: its masks count)
    // a drafter that costs next to nothing (prompt lookup) drafts every step: the budget is then chosen on this
    // step's own tree (0 = an AR step), not on the last one's forecast
    w.draft = w.look = true;
  }
  return w;
}

void AutoController::decided(const Wish& w, bool drafted, int remaining) {
  remaining_ = remaining;
  if (drafted) {
    since_probe_ = 0;
  } else if (w.draft || e_.ar_s > 0) {  // (before AR is measured nothing counts)
    ++since_probe_;
  }
}

AutoChoice AutoController::choose(const int32_t* depth, const float* logp, int n, bool probe, bool look, int slots,
                                  double max_worst) {
  last_depth_.assign(depth, depth + n);
  last_logp_.assign(logp, logp + n);
  if (!have_spec_) {  // first probe: a small fixed tree, to measure
    const int b = std::min(kFirstProbeBudget, n);
    return choose_budget(e_, depth, logp, b, b, false, 1e300, 0, 1, 0, max_worst);
  }
  // a probe may cost at most what the request affords it (wish's remaining tokens)
  const double max_loss = probe ? kRequestShare * ar_step_s() * remaining_ : 1e300;
  return choose_budget(e_, depth, logp, n, probe ? 1 : 0, /*with_draft=*/false, max_loss,
                       look ? kLookGain : probe ? 0.0 : kSpecGain, slots, kTreeSlack, max_worst);
}

void AutoController::price_block(int rows) {
  block_rows_ = std::max(rows, 0);
  if (!e_.draft_rows_s.empty()) e_.draft_s = e_.draft_at(block_rows_);
}

void AutoController::observe_ar(double step_s) { ema(e_.ar_s, step_s); }

void AutoController::observe_ar_masks(double s) {
  if (s > 0) ema(e_.mask_ar_s, s);
}

void AutoController::observe_verify(int n_nodes, double s) {
  if (n_nodes >= 2 && s > 0) ema(e_.verify_s[n_nodes], s);
}

void AutoController::learn_acceptance(const int32_t* depth, const float* logp, int n, const uint8_t* on_path) {
  // acceptance per depth: decayed sums of predicted path probability and of hits
  for (double& p : pred_) p *= kAcceptDecay;
  for (double& h : hit_) h *= kAcceptDecay;
  for (int i = 0; i < n; ++i) {
    const size_t d = (size_t)depth[i];
    if (pred_.size() <= d) pred_.resize(d + 1, 0.0), hit_.resize(d + 1, 0.0);
    pred_[d] += std::min(1.0, std::exp((double)logp[i]));
    hit_[d] += on_path[i] ? 1.0 : 0.0;
  }
  e_.depth_calib.assign(pred_.size(), 1.0);
  for (size_t d = 0; d < pred_.size(); ++d) e_.depth_calib[d] = (hit_[d] + kCalibPrior) / (pred_[d] + kCalibPrior);
}

void AutoController::observe_declined(const int32_t* depth, const float* logp, int n, const uint8_t* on_path) {
  if (n > 0) learn_acceptance(depth, logp, n, on_path);
}

void AutoController::new_request() {
  for (double& p : pred_) p *= kNewRequestWeight;
  for (double& h : hit_) h *= kNewRequestWeight;
  for (size_t d = 0; d < pred_.size(); ++d) e_.depth_calib[d] = (hit_[d] + kCalibPrior) / (pred_[d] + kCalibPrior);
}

double AutoController::expected_step_s(int budget) const {
  const double drafted = e_.draft_at(block_rows_) + e_.tree_s + e_.tree_masks_s();
  if (budget <= 0) return e_.draft_rows_s.empty() ? 0.0 : drafted;
  if (e_.ar_s <= 0) return 0.0;
  // (before the first verified step, the verify is what the AR step predicts for its size, the commit nothing)
  return drafted + e_.commit_s + AutoEstimates::verify_at(e_.verify_points(), budget + 1);
}

void AutoController::observe_spec(const StepRecord& rec, const int32_t* depth, const float* logp, int budget,
                                  const std::vector<uint8_t>& on_path, int n_learn) {
  const bool was_probe = rec.probe;
  // What the step was expected to cost, before its timings move the estimates: one stalled step (a page fault
  // storm, a constraint's first masks: llguidance's first walk of a tree took 3-10 ms where later ones take
  // 0.2 ms a node) counts at most kOutlier times that in the realized rate and a probe's loss, or a forecast
  // that wins would be overruled for the rest of the request.  A constraint's masks are priced apart
  // (mask_tree_s), so they are left out of the drafter's costs (tree_s).
  const double mask_s = std::min(rec.mask_s, rec.tree_s);
  const double expected_s = budget > 0 ? expected_step_s(budget) : 0.0;
  // learnt for the rows price_block priced (the step's block); a size's first timing is bounded by what its
  // neighbours predict (taken before the new entry exists)
  const double draft_expected = e_.draft_at(block_rows_);
  double& drafted = e_.draft_rows_s[block_rows_];
  ema(drafted, rec.draft_s, draft_expected);
  e_.draft_s = drafted;
  ema(e_.tree_s, rec.tree_s - mask_s);
  if (rec.masked > 0) ema(e_.mask_tree_s, mask_s);
  if (budget <= 0) return;  // drafted, then AR won: nothing verified, nothing learnt about acceptance
  have_spec_ = true;
  ema(e_.commit_s, rec.commit_s);
  const double spent = bounded(rec.draft_s + rec.tree_s + rec.verify_s + rec.commit_s, expected_s);
  if (spent > 0) spec_rate_ = spec_rate_ > 0 ? 0.5 * spec_rate_ + 0.5 * rec.committed / spent : rec.committed / spent;
  // a size not timed yet is bounded by what the sizes around it predict
  const double expected = AutoEstimates::verify_at(e_.verify_points(), budget + 1);
  ema(e_.verify_s[budget + 1], rec.verify_s, expected);
  learn_acceptance(depth, logp, n_learn < 0 ? budget : n_learn, on_path.data());
  if (was_probe && e_.ar_s > 0) {
    // Space the next probe so its measured loss is at most kProbeShare of the
    // AR time in between.
    const double loss = std::max(0.0, spent - ar_step_s() * rec.committed);
    probe_loss_ = loss;
    const double gap = std::ceil(loss / (kProbeShare * ar_step_s()));
    probe_gap_ = (int)std::clamp(gap, (double)kMinProbeGap, (double)kMaxProbeGap);
  }
}

}  // namespace dfl
