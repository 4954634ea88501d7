// draft_model.cpp — see draft_model.h.
#include "spec/draft_model.h"

#include <algorithm>

#include "util/error.h"

namespace dfl {

DraftModelProposer::DraftModelProposer(const Model& draft, const Model& target, const ContextParams& p)
    : ctx_(draft, p) {
  if (draft.cfg.n_vocab != target.cfg.n_vocab)
    fail("draft model/target mismatch: the draft model has a vocabulary of %d tokens, the target %d",
         draft.cfg.n_vocab, target.cfg.n_vocab);
}

void DraftModelProposer::reset() {
  ctx_.reset();
  seen_.clear();
  snap_base_ = -1;
  n_snap_ = 0;
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
  if ((int)seen_.size() < s) feed(hist + seen_.size(), s - (int)seen_.size(), (int32_t)seen_.size());
}

void DraftModelProposer::propose_topk(const int32_t* hist, int32_t s, int32_t root, int L, int K, int32_t* ids,
                                      float* logp) {
  if (s + L > ctx_.params().n_ctx) fail("draft model: %d + %d positions exceed its context %d", s, L, ctx_.params().n_ctx);
  sync(hist, s);  // agree with the target on [0, s)
  // the root, then the draft's own greedy chain: one token per forward,
  //    each depth's top-K kept, the state after every position snapshotted
  if ((int)snaps_.size() < L) {
    snaps_.reserve(L);
    while ((int)snaps_.size() < L) snaps_.push_back(ctx_.new_recurrent_snapshot());
  }
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
    seen_.push_back(tok);
    ctx_.save_recurrent(snaps_[(size_t)d]);
    n_snap_ = d + 1;
    tok = ids[(size_t)d * K];
  }
}

}  // namespace dfl
