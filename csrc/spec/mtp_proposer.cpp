// mtp_proposer.cpp — the MTP head drafting for its own trunk (spec/mtp_proposer.h).
#include "spec/mtp_proposer.h"

#include <algorithm>
#include <vector>

#include "util/error.h"

namespace dfl {

MtpProposer::MtpProposer(Context& ctx, int block) : ctx_(ctx), block_(block) {
  const Model& m = ctx.model();
  if (!m.mtp.present())
    fail("the target has no MTP head (qwen35.nextn_predict_layers is 0): use a GGUF converted with it "
         "(llama.cpp's converter without --no-mtp; the \"-MTP\" files)");
  if (block < 2) fail("MTP draft block must be at least 2 (the root and one draft token), got %d", block);
  layers_ = {m.cfg.n_layer - 1};
  Backend& be = ctx.backend();
  const size_t row = (size_t)m.cfg.n_embd * 4;
  last_h_ = BackendBuf(be, row);
  head_ = BackendBuf(be, row);
  rows_ = BackendBuf(be, (size_t)ctx.params().n_batch * row);
  reset();
}

void MtpProposer::reset() {
  pf_.valid = false;
  n_pos_ = n_written_ = 0;
  wait_tok_.clear();
  std::vector<float> zero((size_t)ctx_.model().cfg.n_embd, 0.f);
  ctx_.backend().upload(last_h_.p, zero.data(), zero.size() * 4);
}

size_t MtpProposer::state_bytes() const { return last_h_.bytes + head_.bytes + rows_.bytes; }

void MtpProposer::flush() {
  const int m = (int)wait_tok_.size();
  if (m > 0)
    ctx_.mtp_forward(wait_tok_.data(), m, n_written_, rows_.f(), /*post_norm=*/false, 0, nullptr, nullptr, nullptr);
  n_written_ += m;
  wait_tok_.clear();
}

void MtpProposer::take_features(int32_t pos0, int n, const float* captured, size_t stride, const int32_t* rows,
                                const int32_t* tokens) {
  if (n <= 0) return;
  pf_.valid = false;
  Backend& be = ctx_.backend();
  const int H = ctx_.model().cfg.n_embd;
  const size_t row = (size_t)H * 4;
  if (!captured || !tokens || pos0 != n_pos_) {
    // positions not seen (a prefix-cache hit's kept prompt): their slots keep whatever they held; the head
    // only drafts less well until it reads new positions
    flush();
    n_pos_ = n_written_ = pos0 + n;
    std::vector<float> zero((size_t)H, 0.f);
    be.upload(last_h_.p, zero.data(), row);
    return;
  }
  // row i waits as (token at pos0 + i, the trunk's hidden at pos0 + i - 1): last_h_, then captured rows
  // 0 .. n - 2 (consecutive ones, a prefill chunk's, in one copy)
  const int nb = ctx_.params().n_batch;
  for (int i = 0; i < n;) {
    if ((int)wait_tok_.size() == nb) flush();
    float* dst = rows_.f() + wait_tok_.size() * H;
    int m = 1;
    if (i == 0) {
      be.copy(dst, last_h_.f(), row);
    } else if (rows) {
      be.copy(dst, captured + (size_t)rows[i - 1] * stride, row);
    } else {
      m = std::min(n - i, nb - (int)wait_tok_.size());
      be.copy_rows(dst, row, captured + (size_t)(i - 1) * stride, stride * 4, row, (size_t)m);
    }
    wait_tok_.insert(wait_tok_.end(), tokens + i, tokens + i + m);
    i += m;
  }
  be.copy(last_h_.f(), captured + (size_t)(rows ? rows[n - 1] : n - 1) * stride, row);
  n_pos_ = pos0 + n;
}

void MtpProposer::prefetch_many(Proposer* const* ps, const DraftRequest* rs, int n) {
  std::vector<MtpProposer*> qs((size_t)n);
  std::vector<Context*> cs;
  std::vector<Context::MtpRows> rows;
  for (int j = 0; j < n; ++j) {
    MtpProposer& q = *static_cast<MtpProposer*>(ps[j]);  // (one batch key: one head, MTP proposers alike)
    qs[(size_t)j] = &q;
    q.pf_.valid = false;
    if (rs[j].root_pos != q.n_pos_)
      fail("MTP head: the draft's root is at %d but the head has read positions up to %d", rs[j].root_pos, q.n_pos_);
    if (!q.wait_tok_.empty()) {  // the committed rows each slot's head has not written yet
      cs.push_back(&q.ctx_);
      rows.push_back({q.wait_tok_.data(), (int)q.wait_tok_.size(), q.n_written_, q.rows_.f(), nullptr, nullptr,
                      nullptr, nullptr});
    }
  }
  Context::mtp_forward_many(cs.data(), rows.data(), (int)rows.size(), /*post_norm=*/false, 0);
  int L = 0, K = 1;
  for (int j = 0; j < n; ++j) {
    MtpProposer& q = *qs[(size_t)j];
    q.n_written_ += (int)q.wait_tok_.size();
    q.wait_tok_.clear();
    L = std::max(L, rs[j].L);
    K = std::max(K, rs[j].K);
  }
  // depth d of every chain still that deep: (root or the depth before's top-1, the trunk's hidden or the head's
  // own output) at slot root_pos + d, as propose_topk takes them one slot at a time
  std::vector<int32_t> tok((size_t)n);
  for (int j = 0; j < n; ++j) {
    MtpProposer& q = *qs[(size_t)j];
    q.pf_.start(rs[j], K);
    tok[(size_t)j] = rs[j].root;
  }
  for (int d = 0; d < L; ++d) {
    cs.clear(), rows.clear();
    std::vector<int> at;
    for (int j = 0; j < n; ++j) {
      MtpProposer& q = *qs[(size_t)j];
      if (rs[j].L <= d) continue;
      cs.push_back(&q.ctx_);
      rows.push_back({&tok[(size_t)j], 1, rs[j].root_pos + d, d == 0 ? q.last_h_.f() : q.head_.f(),
                      q.pf_.ids.data() + (size_t)d * K, q.pf_.logp.data() + (size_t)d * K, q.head_.f(), nullptr});
      at.push_back(j);
    }
    Context::mtp_forward_many(cs.data(), rows.data(), (int)rows.size(), /*post_norm=*/d > 0, K);
    for (int j : at) tok[(size_t)j] = qs[(size_t)j]->pf_.ids[(size_t)d * K];
  }
}

void MtpProposer::propose_topk(const DraftRequest& r, int K, int32_t* ids, float* logp) {
  if (r.L <= 0) return;
  if (r.root_pos != n_pos_)
    fail("MTP head: the draft's root is at %d but the head has read positions up to %d", r.root_pos, n_pos_);
  if (pf_.take(r, K, ids, logp)) return;  // drafted by prefetch_many with the other slots
  flush();
  int32_t tok = r.root;
  const float* h = last_h_.f();
  bool post = false;
  for (int d = 0; d < r.L; ++d) {
    ctx_.mtp_forward(&tok, 1, r.root_pos + d, h, post, K, ids + (size_t)d * K, logp + (size_t)d * K, head_.f());
    tok = ids[(size_t)d * K];
    h = head_.f();
    post = true;
  }
}

}  // namespace dfl
