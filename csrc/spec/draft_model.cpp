// draft_model.cpp — see draft_model.h.
#include "spec/draft_model.h"

#include <algorithm>
#include <memory>
#include <numeric>

#include "util/error.h"

namespace dfl {

DraftModelProposer::DraftModelProposer(const Model& draft, const Model& target, const ContextParams& p,
                                       DraftModelProposer* share)
    : ctx_(draft, p, share ? &share->ctx_ : nullptr) {
  if (draft.cfg.n_vocab != target.cfg.n_vocab)
    fail("draft model/target mismatch: the draft model has a vocabulary of %d tokens, the target %d",
         draft.cfg.n_vocab, target.cfg.n_vocab);
}

void DraftModelProposer::reset() {
  pf_.valid = false;
  ctx_.reset();
  seen_.clear();
  snap_base_ = -1;
  n_snap_ = 0;
  tree_base_ = -1;
}

size_t DraftModelProposer::state_bytes() const {
  size_t b = ctx_.state_bytes();
  for (const BackendBuf& s : snaps_) b += s.bytes;
  return b;
}

void DraftModelProposer::feed(const int32_t* tokens, int n, int32_t pos0) {
  const int chunk = ctx_.params().n_batch;
  for (int off = 0; off < n; off += chunk) {
    const int m = std::min(chunk, n - off);
    pos_.resize(m);
    for (int i = 0; i < m; ++i) pos_[i] = pos0 + off + i;
    Batch b{m, tokens + off, pos_.data(), nullptr};
    ctx_.forward(b, ForwardOutputs{}, true);
  }
  seen_.insert(seen_.end(), tokens, tokens + n);
}

void DraftModelProposer::sync(const int32_t* hist, int32_t s) {
  if (sync_prefix(hist, s) > 0) feed(hist + seen_.size(), s - (int)seen_.size(), (int32_t)seen_.size());
}

int DraftModelProposer::sync_prefix(const int32_t* hist, int32_t s) {
  pf_.valid = false;
  int c = 0;
  const int held = (int)seen_.size();
  while (c < held && c < s && seen_[c] == hist[c]) ++c;
  if (c < held) {
    const int k = c - snap_base_ - 1;  // the snapshot holding n_past == c
    if (k >= 0 && k < n_snap_) {
      ctx_.restore_recurrent(snaps_[(size_t)k]);
      ctx_.set_n_past(c);
      seen_.resize(c);
    } else {  // a new request (a different prompt): prefill it afresh
      reset();
    }
  }
  // The accepted path of the last expanded tree: its nodes were run (per-node
  // states kept by that forward), so they are committed by gather.
  if (tree_base_ >= 0 && (int)seen_.size() == tree_base_ && s > tree_base_ && hist[tree_base_] == run_tokens_[0]) {
    std::vector<int32_t> path{0};
    for (int32_t p = tree_base_ + 1; p < s; ++p) {
      int next = -1;
      for (int i = path.back() + 1; i < (int)run_tokens_.size() && next < 0; ++i)
        if (run_parent_[(size_t)i] == path.back() && run_tokens_[(size_t)i] == hist[p]) next = i;
      if (next < 0) break;
      path.push_back(next);
    }
    ctx_.commit_path(path.data(), (int)path.size());
    seen_.insert(seen_.end(), hist + tree_base_, hist + tree_base_ + path.size());
  }
  tree_base_ = -1;
  return std::max(0, s - (int)seen_.size());
}

void DraftModelProposer::ensure_snapshots(int L) {
  if ((int)snaps_.size() < L) {
    snaps_.reserve(L);
    while ((int)snaps_.size() < L) snaps_.push_back(ctx_.new_recurrent_snapshot());
  }
}

void DraftModelProposer::drafted(int d, int32_t tok) {
  seen_.push_back(tok);
  ctx_.save_recurrent(snaps_[(size_t)d]);
  n_snap_ = d + 1;
}

static std::unique_ptr<bool[]> all_true(size_t n) {
  std::unique_ptr<bool[]> b(new bool[n]);
  std::fill_n(b.get(), n, true);
  return b;
}

void DraftModelProposer::prefetch_many(Proposer* const* ps_all, const DraftRequest* rs_all, int n_all) {
  // slots that expand branches draft alone in propose_tree (a chain drafted here would only be rolled back)
  std::vector<Proposer*> ps;
  std::vector<DraftRequest> rs;
  for (int j = 0; j < n_all; ++j)
    if (!rs_all[j].expand) ps.push_back(ps_all[j]), rs.push_back(rs_all[j]);
  const int n = (int)ps.size();
  if (n == 0) return;
  std::vector<DraftModelProposer*> qs((size_t)n);
  int L = 0, K = 1, n_batch = ctx_.params().n_batch;
  for (int j = 0; j < n; ++j) {
    qs[(size_t)j] = static_cast<DraftModelProposer*>(ps[j]);  // (one batch key: one backend, one draft model)
    const DraftModelProposer& q = *qs[(size_t)j];
    if (rs[j].root_pos + rs[j].L > q.ctx_.params().n_ctx)
      fail("draft model: %d + %d positions exceed its context %d", rs[j].root_pos, rs[j].L, q.ctx_.params().n_ctx);
    L = std::max(L, rs[j].L);
    K = std::max(K, rs[j].K);
    n_batch = std::min(n_batch, q.ctx_.params().n_batch);
  }
  // the catch-ups: each context's unseen tokens, one forward for all when they fit a batch
  std::vector<Context*> cs;
  std::vector<Batch> bs;
  std::vector<std::vector<int32_t>> pos((size_t)n);
  int rows = 0;
  for (int j = 0; j < n; ++j) {
    DraftModelProposer& q = *qs[(size_t)j];
    const int m = q.sync_prefix(rs[j].hist, rs[j].root_pos);
    if (m <= 0) continue;
    const int32_t p0 = (int32_t)q.seen_.size();
    if (rows + m > n_batch) {  // too many for one forward: this slot alone, in chunks
      q.feed(rs[j].hist + p0, m, p0);
      continue;
    }
    pos[(size_t)j].resize((size_t)m);
    for (int i = 0; i < m; ++i) pos[(size_t)j][(size_t)i] = p0 + i;
    cs.push_back(&q.ctx_);
    bs.push_back(Batch{m, rs[j].hist + p0, pos[(size_t)j].data(), nullptr});
    rows += m;
  }
  if (!cs.empty()) {
    std::vector<ForwardOutputs> none(cs.size());
    const std::unique_ptr<bool[]> commit = all_true(cs.size());
    Context::forward_many(cs.data(), bs.data(), none.data(), commit.get(), (int)cs.size());
    for (size_t i = 0; i < cs.size(); ++i)
      for (int j = 0; j < n; ++j)
        if (&qs[(size_t)j]->ctx_ == cs[i]) {
          DraftModelProposer& q = *qs[(size_t)j];
          q.seen_.insert(q.seen_.end(), bs[i].tokens, bs[i].tokens + bs[i].n);
        }
  }
  // each depth of every chain still that deep, one token a context (as propose_topk runs them alone)
  std::vector<int32_t> tok((size_t)n), at_pos((size_t)n), row0((size_t)n, 0);
  for (int j = 0; j < n; ++j) {
    DraftModelProposer& q = *qs[(size_t)j];
    q.ensure_snapshots(rs[j].L);
    q.snap_base_ = rs[j].root_pos;
    q.n_snap_ = 0;
    q.pf_.start(rs[j], K);
    tok[(size_t)j] = rs[j].root;
  }
  for (int d = 0; d < L; ++d) {
    cs.clear(), bs.clear();
    std::vector<ForwardOutputs> outs;
    std::vector<int> at;
    for (int j = 0; j < n; ++j) {
      DraftModelProposer& q = *qs[(size_t)j];
      if (rs[j].L <= d) continue;
      at_pos[(size_t)j] = rs[j].root_pos + d;
      ForwardOutputs o;
      o.n_logits = 1;
      o.logit_rows = &row0[(size_t)j];
      o.topk = K;
      o.top_ids = q.pf_.ids.data() + (size_t)d * K;
      o.top_logp = q.pf_.logp.data() + (size_t)d * K;
      cs.push_back(&q.ctx_);
      bs.push_back(Batch{1, &tok[(size_t)j], &at_pos[(size_t)j], nullptr});
      outs.push_back(o);
      at.push_back(j);
    }
    const std::unique_ptr<bool[]> commit = all_true(cs.size());
    Context::forward_many(cs.data(), bs.data(), outs.data(), commit.get(), (int)cs.size());
    for (int j : at) {
      DraftModelProposer& q = *qs[(size_t)j];
      q.drafted(d, tok[(size_t)j]);
      tok[(size_t)j] = q.pf_.ids[(size_t)d * K];
    }
  }
}

void DraftModelProposer::propose_topk(const DraftRequest& r, int K, int32_t* ids, float* logp) {
  const int32_t* hist = r.hist;
  const int32_t s = r.root_pos, root = r.root;
  const int L = r.L;
  if (s + L > ctx_.params().n_ctx) fail("draft model: %d + %d positions exceed its context %d", s, L, ctx_.params().n_ctx);
  if (pf_.take(r, K, ids, logp)) return;  // drafted by prefetch_many with the other slots (its context did)
  sync(hist, s);  // agree with the target on [0, s)
  // the root, then the draft's own greedy chain: one token per forward,
  //    each depth's top-K kept, the state after every position snapshotted
  ensure_snapshots(L);
  snap_base_ = s;
  n_snap_ = 0;
  int32_t tok = root;
  for (int d = 0; d < L; ++d) {
    const int32_t pos = s + d;
    Batch b{1, &tok, &pos, nullptr};
    ForwardOutputs o;
    int32_t row = 0;
    o.n_logits = 1;
    o.logit_rows = &row;
    o.topk = K;
    o.top_ids = ids + (size_t)d * K;
    o.top_logp = logp + (size_t)d * K;
    ctx_.forward(b, o, true);
    drafted(d, tok);
    tok = ids[(size_t)d * K];
  }
}

DraftTree DraftModelProposer::propose_tree(const DraftRequest& r, const TreeParams& tp, int K) {
  const int32_t* hist = r.hist;
  const int32_t s = r.root_pos, root = r.root;
  int L = r.L;
  const int budget = tp.budget, width = tp.expand;
  const bool chain_seed = tp.chain_seed;
  if (width < 1 || K < 1) fail("draft model: expanding branches needs width >= 1 and K >= 1 (got %d, %d)", width, K);
  const Qwen35Config& c = ctx_.model().cfg;
  K = std::min(K, c.n_vocab);
  // Every node run sits at slot n_past + i of one verify batch: stop growing where they would not fit.
  const int room = std::min(ctx_.params().n_ctx - s, ctx_.params().n_batch);
  L = std::min(L, room >= 1 ? 1 + (room - 1) / width : 0);
  sync(hist, s);  // agree with the target on [0, s)
  n_snap_ = 0;    // the chain's snapshots no longer describe this context
  DraftTree t;
  if (L < 1 || budget < 1) return t;

  struct Cand {
    int32_t token;
    int32_t parent_run;  // the run node it is a child of (0 = the root)
    int32_t depth;
    float cum;           // cumulative draft log-probability of its path
    int32_t run = -1;    // its run index once expanded
    bool greedy = false; // on the draft's greedy path (the chain seed)
  };
  std::vector<Cand> cands;
  run_tokens_.assign(1, root);
  run_parent_.assign(1, -1);
  std::vector<int32_t> run_depth(1, 0);
  std::vector<float> run_cum(1, 0.f);
  std::vector<int32_t> frontier{0}, ids;
  std::vector<float> logp;
  int32_t greedy_run = 0;  // the greedy path's node at the newest depth (a run node), -1 once it stops
  for (int d = 1; d <= L; ++d) {
    const int n = (int)run_tokens_.size();
    pos_.resize((size_t)n);
    for (int i = 0; i < n; ++i) pos_[(size_t)i] = s + run_depth[(size_t)i];
    ids.resize(frontier.size() * (size_t)K), logp.resize(frontier.size() * (size_t)K);
    Batch b{n, run_tokens_.data(), pos_.data(), run_parent_.data()};
    ForwardOutputs o;
    o.n_logits = (int)frontier.size();
    o.logit_rows = frontier.data();
    o.topk = K, o.top_ids = ids.data(), o.top_logp = logp.data();
    ctx_.forward(b, o, /*commit=*/false);
    const size_t first = cands.size();
    for (size_t f = 0; f < frontier.size(); ++f)
      for (int j = 0; j < K; ++j)
        cands.push_back({ids[f * K + j], frontier[f], d, run_cum[(size_t)frontier[f]] + logp[f * K + j], -1,
                         chain_seed && j == 0 && frontier[f] == greedy_run});
    if (d == L) break;
    // the `width` most probable nodes of this depth run next (ties: the earlier
    // candidate), the greedy path's first when it seeds the tree
    std::vector<int32_t> order(cands.size() - first);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b2) {
      const Cand &x = cands[first + a], &y = cands[first + b2];
      return x.greedy != y.greedy ? x.greedy : x.cum > y.cum;
    });
    frontier.clear();
    greedy_run = -1;
    for (int k = 0; k < width && k < (int)order.size(); ++k) {
      Cand& cd = cands[first + (size_t)order[(size_t)k]];
      cd.run = (int32_t)run_tokens_.size();
      run_tokens_.push_back(cd.token);
      run_parent_.push_back(cd.parent_run);
      run_depth.push_back(d);
      run_cum.push_back(cd.cum);
      frontier.push_back(cd.run);
      if (cd.greedy) greedy_run = cd.run;
    }
  }
  tree_base_ = s;

  // The greedy path first when it seeds the tree (by depth), then the most
  // probable nodes, best first, up to the budget.  A child's cumulative
  // log-probability never exceeds its parent's (log-softmax <= 0) and ties go
  // to the shallower node, so each node's parent is already in the tree.
  std::vector<int32_t> order(cands.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b2) {
    const Cand &x = cands[(size_t)a], &y = cands[(size_t)b2];
    if (x.greedy != y.greedy) return x.greedy;
    if (x.greedy) return x.depth < y.depth;
    return x.cum != y.cum ? x.cum > y.cum : x.depth < y.depth;
  });
  std::vector<int32_t> out_of_run(run_tokens_.size(), -1);
  out_of_run[0] = 0;
  for (int32_t ci : order) {
    if (t.size() >= budget) break;
    const Cand& cd = cands[(size_t)ci];
    const int32_t parent = out_of_run[(size_t)cd.parent_run];
    if (parent < 0) continue;  // its parent was not taken (cannot happen; kept safe)
    t.tokens.push_back(cd.token);
    t.depth.push_back(cd.depth);
    t.parent.push_back(parent);
    t.logp.push_back(cd.cum);
    if (cd.run >= 0) out_of_run[(size_t)cd.run] = t.size();
  }
  return t;
}

}  // namespace dfl
