// drafter.cpp — DFlash block forward over a feature ring and draft KV ring.
#include "runtime/drafter.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "quant/quant.h"
#include "backend/topk.h"
#include "util/error.h"

namespace dfl {

namespace {
constexpr int kProjectChunk = 64;  // context positions projected per matmul batch

int hw_threads() {
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : (int)n;
}
}  // namespace

Drafter::Drafter(const DraftModel& draft, const Model& target, const DrafterParams& p, Backend* backend)
    : d_(draft), t_(target), cap_(p.ring_capacity) {
  const DraftConfig& c = d_.cfg;
  validate_pair(c, target.cfg);
  if (cap_ <= 0) fail("feature ring capacity must be positive (got %d)", cap_);
  if (backend) {
    be_ = backend;
  } else {
    own_pool_ = std::make_unique<ThreadPool>(p.n_threads > 0 ? p.n_threads : hw_threads());
    own_be_ = make_cpu_backend(target, *own_pool_);
    be_ = own_be_.get();
  }
  // The drafter's tensors join the backend's weights (the target's embedding and
  // lm_head are the target model's, already there).
  std::vector<std::pair<const void*, size_t>> t;
  d_.for_each_tensor([&](const Weight& w) { t.push_back({w.data, (size_t)w.rows * w.row_bytes}); },
                     [&](const std::vector<float>& v) { t.push_back({v.data(), v.size() * 4}); });
  be_->add_weights(&d_, t);
  // z-lab: q/k RMSNorm per head, RoPE (maybe scaled) over the whole head.
  attn_ = AttnShape{c.n_head, c.n_head_kv, c.head_dim, c.rope, c.rms_eps, false, DType::F32};
  ring_ = BackendBuf(*be_, (size_t)cap_ * c.fc_in() * 4);
  block_rows_ = std::max(c.block_size, 2);
  for (int l = 0; l < c.n_layer; ++l) {
    k_.emplace_back(*be_, (size_t)(cap_ + block_rows_) * c.kv_dim() * 4);
    v_.emplace_back(*be_, (size_t)(cap_ + block_rows_) * c.kv_dim() * 4);
  }
}

// Room for a block of B rows after the context ring (the config's block size
// unless a caller asks for more); the ring's rows move to the new buffers.
void Drafter::ensure_block_rows(int B) {
  if (B <= block_rows_) return;
  const size_t row = (size_t)d_.cfg.kv_dim() * 4;
  for (auto* kv : {&k_, &v_})
    for (BackendBuf& b : *kv) {
      BackendBuf nb(*be_, (size_t)(cap_ + B) * row);
      be_->copy(nb.p, b.p, (size_t)cap_ * row);
      b = std::move(nb);
    }
  block_rows_ = B;
}

Drafter::~Drafter() = default;

void Drafter::reset() {
  n_pos_ = 0;
  consumed_ = 0;
}

size_t Drafter::state_bytes() const {
  size_t b = ring_.bytes;
  for (auto& k : k_) b += k.bytes;
  for (auto& v : v_) b += v.bytes;
  return b;
}

void Drafter::ensure_scratch(int rows) {
  if (rows <= scratch_rows_) return;
  const DraftConfig& c = d_.cfg;
  Backend& be = *be_;
  const size_t r = (size_t)rows;
  x_ = BackendBuf(be, r * c.hidden * 4);
  hn_ = BackendBuf(be, r * c.hidden * 4);
  q_ = BackendBuf(be, r * c.q_dim() * 4);
  kb_ = BackendBuf(be, r * c.kv_dim() * 4);
  vb_ = BackendBuf(be, r * c.kv_dim() * 4);
  att_ = BackendBuf(be, r * c.q_dim() * 4);
  out_ = BackendBuf(be, r * c.hidden * 4);
  g_ = BackendBuf(be, r * c.n_ff * 4);
  u_ = BackendBuf(be, r * c.n_ff * 4);
  ctx_ = BackendBuf(be, r * c.hidden * 4);
  if (c.dflash2) {
    dl_ = BackendBuf(be, r * 2 * c.conv_kernel * c.conv_groups() * 4);
    cv_ = BackendBuf(be, r * c.hidden * 4);
  }
  scratch_rows_ = rows;
}

void Drafter::push_features(int32_t pos0, int n, const float* feats) {
  if (pos0 != n_pos_) fail("features for position %d pushed, but the drafter expects position %d next", pos0, n_pos_);
  if (n < 0) fail("negative feature count");
  const size_t w = (size_t)feature_width();
  const int skip = std::max(0, n - cap_);
  // Contiguous runs of ring rows: at most two per push (the ring wraps once).
  for (int i = skip; i < n;) {
    const int slot = (pos0 + i) % cap_;
    const int run = std::min(n - i, cap_ - slot);
    be_->upload(ring_.f() + (size_t)slot * w, feats + (size_t)i * w, (size_t)run * w * 4);
    i += run;
  }
  n_pos_ += n;
  // Positions that fell out of the ring before being consumed are never projected.
  consumed_ = std::max(consumed_, n_pos_ - cap_);
}

void Drafter::push_features_from_backend(int32_t pos0, int n, const float* src, size_t src_stride,
                                          const int32_t* rows) {
  if (pos0 != n_pos_) fail("features for position %d pushed, but the drafter expects position %d next", pos0, n_pos_);
  if (n < 0) fail("negative feature count");
  const size_t w = (size_t)feature_width();
  if (src_stride < w) fail("captured rows of %zu floats cannot hold the drafter's %zu", src_stride, w);
  for (int i = std::max(0, n - cap_); i < n;) {
    const int slot = (pos0 + i) % cap_;
    if (rows) {  // one row at a time: path nodes are not consecutive
      be_->copy(ring_.f() + (size_t)slot * w, src + (size_t)rows[i] * src_stride, w * 4);
      ++i;
    } else {     // contiguous runs, split where the ring wraps
      const int run = std::min(n - i, cap_ - slot);
      if (src_stride == w)
        be_->copy(ring_.f() + (size_t)slot * w, src + (size_t)i * w, (size_t)run * w * 4);
      else  // other readers' layers in between
        be_->copy_rows(ring_.f() + (size_t)slot * w, w * 4, src + (size_t)i * src_stride, src_stride * 4, w * 4,
                       (size_t)run);
      i += run;
    }
  }
  be_->submit();  // a step's last GPU work: queued now, not at the next step's first op
  n_pos_ += n;
  consumed_ = std::max(consumed_, n_pos_ - cap_);
}

void Drafter::skip_features(int32_t pos0, int n) {
  if (pos0 != n_pos_) fail("features for position %d skipped, but the drafter expects position %d next", pos0, n_pos_);
  n_pos_ += n;
  consumed_ = std::max(consumed_, n_pos_);
}

void Drafter::consume_features() {
  while (consumed_ < n_pos_) {
    // chunks never cross the ring's wrap, so each is one run of ring slots
    int n = std::min({kProjectChunk, n_pos_ - consumed_, cap_ - consumed_ % cap_});
    project_context(consumed_, n);
    consumed_ += n;
  }
}

void Drafter::project_context(int32_t pos0, int n) {
  const DraftConfig& c = d_.cfg;
  Backend& be = *be_;
  ++epoch_;  // its scratch: a block result prefetched there is gone
  const int H = c.hidden;
  const size_t w = (size_t)feature_width();
  ensure_scratch(std::max(n, kProjectChunk));
  const int slot0 = pos0 % cap_;
  ChunkPlan& P = plan_a_;
  P = ChunkPlan{};
  P.n = n;
  P.kv_slot0 = slot0;  // the ring slots of positions pos0..
  for (int i = 0; i < n; ++i) {
    P.tokens.push_back(0);
    P.pos.push_back(pos0 + i);
    P.n_prefix.push_back(0);
    P.extra_begin.push_back(0);
    P.extra_count.push_back(0);
    P.parent.push_back(i - 1);
  }
  be.begin_chunk(P);
  be.matmul(d_.fc, ring_.f() + (size_t)slot0 * w, n, ctx_.f());
  be.rmsnorm(ctx_.f(), be.vec(d_.hidden_norm), n, H, c.rms_eps, ctx_.f());
  AttnShape kv_only = attn_;
  kv_only.n_head = 0;
  for (int l = 0; l < c.n_layer; ++l) {
    const DraftLayerWeights& L = d_.layers[l];
    be.matmul(L.wk, ctx_.f(), n, kb_.f());
    be.matmul(L.wv, ctx_.f(), n, vb_.f());
    // k_norm + RoPE at the positions, rows stored at their ring slots
    be.attn_store(nullptr, kb_.f(), vb_.f(),
                  AttnLayer{kv_only, k_[l].u8(), v_[l].u8(), nullptr, be.vec(L.k_norm)});
  }
}

void Drafter::plan_block(const int32_t* tokens, int B, bool causal, int64_t W, ChunkPlan& P) const {
  const int32_t s = n_pos_, lo = std::max(0, s - cap_);
  auto visible = [&](int64_t qp, int64_t kp) {
    if (causal && kp > qp) return false;
    if (W > 0 && (qp - kp >= W || (!causal && kp - qp >= W))) return false;
    return true;
  };
  P = ChunkPlan{};
  P.n = B;
  P.kv_slot0 = cap_;  // the block's K/V go to slots cap..cap+B-1, after the context ring
  // Without a causal mask or a window every block token sees the same slots: one list they all share (the
  // plan is then the context once, not once per block token — 16x less to build and upload).
  const bool shared = !causal && W <= 0;
  for (int i = 0; i < B; ++i) {
    const int64_t qp = s + i;
    P.tokens.push_back(tokens[i]);
    P.pos.push_back((int32_t)qp);
    P.n_prefix.push_back(0);
    P.parent.push_back(i - 1);
    if (shared && i > 0) {
      P.extra_begin.push_back(P.extra_begin[0]);
      P.extra_count.push_back(P.extra_count[0]);
      continue;
    }
    P.extra_begin.push_back((int32_t)P.extra_slots.size());
    // keys in order: cached context (ascending positions), then the block (slots cap..)
    const int64_t c0 = W > 0 ? std::max<int64_t>(lo, qp - W + 1) : lo;
    for (int64_t p = c0; p < s; ++p)
      if (visible(qp, p)) P.extra_slots.push_back((int32_t)(p % cap_));
    for (int b = 0; b < B; ++b)
      if (visible(qp, s + b)) P.extra_slots.push_back(cap_ + b);
    P.extra_count.push_back((int32_t)P.extra_slots.size() - P.extra_begin.back());
    P.max_visible = std::max(P.max_visible, P.extra_count.back());
  }
}

void Drafter::propose(const int32_t* block_tokens, int n_block, float* logits) {
  const BlockResult r = forward_block(block_tokens, n_block);
  const DraftConfig& c = d_.cfg;
  const size_t nl = (size_t)(n_block - 1) * t_.cfg.n_vocab;
  be_->download(logits, r.logits, nl * 4);
  if (c.final_logit_softcapping > 0.f) {
    const float cap = c.final_logit_softcapping;
    for (size_t i = 0; i < nl; ++i) logits[i] = std::tanh(logits[i] / cap) * cap;
  }
}

void Drafter::propose_topk(const int32_t* block_tokens, int n_block, int k, int32_t* ids, float* logp) {
  topk_block(block_tokens, n_block, k, ids, logp);
}

Drafter::BlockResult Drafter::topk_block(const int32_t* block_tokens, int n_block, int k, int32_t* ids, float* logp) {
  const int V = t_.cfg.n_vocab, rows = n_block - 1;
  if (k < 1 || k > V) fail("draft top-k of %d over a vocabulary of %d", k, V);
  const BlockResult r = forward_block(block_tokens, n_block);
  if (d_.cfg.final_logit_softcapping > 0.f) {  // soft-capping happens on the host: rank there too
    std::vector<float> logits((size_t)std::max(rows, 0) * V);
    be_->download(logits.data(), r.logits, logits.size() * 4);
    const float cap = d_.cfg.final_logit_softcapping;
    for (float& x : logits) x = std::tanh(x / cap) * cap;
    for (int i = 0; i < rows; ++i)
      topk_logprobs(logits.data() + (size_t)i * V, V, k, ids + (size_t)i * k, logp + (size_t)i * k);
    return r;
  }
  const size_t n = (size_t)rows * k;
  if (top_.bytes < n * 8) top_ = BackendBuf(*be_, n * 8);
  int32_t* d_ids = reinterpret_cast<int32_t*>(top_.u8());
  float* d_lp = reinterpret_cast<float*>(top_.u8() + n * 4);
  be_->row_topk(r.logits, rows, V, k, d_ids, d_lp);
  std::vector<uint8_t> both(n * 8);  // ids then log-probs: one transfer
  be_->download(both.data(), top_.p, both.size());
  std::memcpy(ids, both.data(), n * 4);
  std::memcpy(logp, both.data() + n * 4, n * 4);
  return r;
}

// The selector's scoring of one block: the block forward (candidates and their log-probs) and g_t = P h_t;
// then edge(t, pred, out) = the K scores of depth t's candidates after token `pred` (unary + bilinear).
struct Drafter::SelectorScores {
  Drafter& d;
  int rows, K, Rk;
  const int32_t* ids;
  const float* lp;
  std::vector<float> g, a, b;
  std::vector<uint8_t> raw;
  void code(const Weight& w, int32_t tok, float* out) {  // a codebook row from the host copy of the weights
    std::memcpy(raw.data(), w.row(tok), w.row_bytes);  // (copied first: the mapping need not be aligned)
    dequantize_row(w.type, raw.data(), out, Rk);
  }
  void edge(int t, int32_t pred, float* out) {
    const DraftModel& w = d.d_;
    code(w.selector.predecessor, pred, a.data());
    const float* gt = g.data() + (size_t)t * Rk;
    for (int r = 0; r < Rk; ++r) a[(size_t)r] *= gt[r];
    for (int j = 0; j < K; ++j) {
      code(w.selector.successor, ids[(size_t)t * K + j], b.data());
      float s = 0.f;
      for (int r = 0; r < Rk; ++r) s += a[(size_t)r] * b[(size_t)r];
      out[j] = s + lp[(size_t)t * K + j];
    }
  }
};

Drafter::SelectorScores Drafter::selector_scores(const int32_t* block_tokens, int n_block, int32_t* cand_ids,
                                                 float* cand_logp) {
  const DraftConfig& c = d_.cfg;
  if (!c.dflash2) fail("internal: the candidate selector belongs to DFlash2 drafters");
  const int rows = n_block - 1, K = c.selector_top_k, Rk = c.selector_rank;
  const BlockResult r = topk_block(block_tokens, n_block, K, cand_ids, cand_logp);  // r.hn: the final-normed rows
  Backend& be = *be_;
  const size_t ng = (size_t)rows * Rk;
  if (sel_.bytes < ng * 4) sel_ = BackendBuf(be, ng * 4);
  be.matmul(d_.selector.hidden_projection, r.hn, rows, sel_.f());
  SelectorScores S{*this, rows, K, Rk, cand_ids, cand_logp, std::vector<float>(ng), std::vector<float>((size_t)Rk),
                   std::vector<float>((size_t)Rk),
                   std::vector<uint8_t>(std::max(d_.selector.predecessor.row_bytes, d_.selector.successor.row_bytes))};
  be.download(S.g.data(), sel_.f(), ng * 4);
  return S;
}

void Drafter::propose_lattice(const int32_t* block_tokens, int n_block, int32_t* cand_ids, float* cand_logp,
                              float* edge) {
  SelectorScores S = selector_scores(block_tokens, n_block, cand_ids, cand_logp);
  const int K = S.K;
  for (int t = 0; t < S.rows; ++t)
    for (int i = 0; i < K; ++i) {
      float* e = edge + ((size_t)t * K + i) * K;
      if (t == 0 && i > 0) std::memcpy(e, edge, (size_t)K * 4);  // the root's row stands for every row
      else S.edge(t, t == 0 ? block_tokens[0] : cand_ids[(size_t)(t - 1) * K + i], e);
    }
}

void Drafter::propose_path(const int32_t* block_tokens, int n_block, int32_t* path, int32_t* cand_ids,
                           float* cand_logp) {
  const int rows = n_block - 1, K = d_.cfg.selector_top_k;
  std::vector<int32_t> ids((size_t)rows * K);
  std::vector<float> lp((size_t)rows * K), e((size_t)K);
  SelectorScores S = selector_scores(block_tokens, n_block, ids.data(), lp.data());
  // the greedy walk reads one lattice row a depth: the chosen token's
  int32_t prev = block_tokens[0];
  for (int t = 0; t < rows; ++t) {
    S.edge(t, prev, e.data());
    int best = 0;
    for (int j = 1; j < K; ++j)
      if (e[(size_t)j] > e[(size_t)best]) best = j;
    path[t] = prev = ids[(size_t)t * K + best];
  }
  if (cand_ids) std::memcpy(cand_ids, ids.data(), ids.size() * 4);
  if (cand_logp) std::memcpy(cand_logp, lp.data(), lp.size() * 4);
}

Drafter::BlockResult Drafter::forward_block(const int32_t* block_tokens, int n_block) {
  Prefetched& pf = prefetched_;
  if (pf.lead && pf.lead->epoch_ == pf.epoch && pf.pos == n_pos_ && consumed_ == n_pos_ &&
      (int)pf.block.size() == n_block && std::equal(pf.block.begin(), pf.block.end(), block_tokens)) {
    pf.lead = nullptr;  // one use: the step that prefetched it
    return pf.r;
  }
  pf.lead = nullptr;
  Drafter* self = this;
  BlockResult r;
  forward_blocks(&self, &block_tokens, &n_block, 1, &r);
  return r;
}

void Drafter::prefetch_blocks(Drafter* const* ds, const int32_t* const* blocks, const int* n_block, int n) {
  if (n <= 0) return;
  std::vector<BlockResult> rs((size_t)n);
  forward_blocks(ds, blocks, n_block, n, rs.data());
  for (int k = 0; k < n; ++k) {
    Prefetched& pf = ds[k]->prefetched_;
    pf.lead = ds[0];
    pf.epoch = ds[0]->epoch_;
    pf.pos = ds[k]->n_pos_;
    pf.block.assign(blocks[k], blocks[k] + n_block[k]);
    pf.r = rs[(size_t)k];
  }
}

void Drafter::forward_blocks(Drafter* const* ds, const int32_t* const* blocks, const int* n_block, int n,
                             BlockResult* out) {
  Drafter& lead = *ds[0];
  const DraftConfig& c = lead.d_.cfg;
  const Qwen35Config& tc = lead.t_.cfg;
  const int H = c.hidden;
  int R = 0, P = 0;  // rows in all, and rows past each block's root (the lm_head's)
  std::vector<int> row0((size_t)n), prow0((size_t)n);
  for (int k = 0; k < n; ++k) {
    Drafter& d = *ds[k];
    if (&d.d_ != &lead.d_ || d.be_ != lead.be_)
      fail("internal: drafters batched in one forward must share a draft model and a backend");
    const int B = n_block[k];
    if (B < 2) fail("a draft block needs at least 2 positions (got %d)", B);
    for (int i = 0; i < B; ++i)
      if (blocks[k][i] < 0 || blocks[k][i] >= tc.n_vocab)
        fail("draft block token %d at index %d is outside the vocabulary", blocks[k][i], i);
    d.consume_features();
    d.ensure_block_rows(B);
    row0[(size_t)k] = R, prow0[(size_t)k] = P;
    R += B, P += B - 1;
  }
  lead.ensure_scratch(R);
  ++lead.epoch_;
  Backend& be = *lead.be_;
  // Layer kinds share a plan: (causal, window) per layer.  One block re-uploads its plan only when the kind
  // changes; several take turns, each block's plan before its attention.
  auto kind = [&](int l) {
    const bool causal = c.is_causal >= 0 ? c.is_causal == 1 : c.is_sliding[l] != 0;  // z-lab's rule
    return std::make_pair(causal, (int64_t)(c.is_sliding[l] ? c.sliding_window : 0));
  };
  std::vector<std::pair<bool, int64_t>> planned((size_t)n, {false, -1});
  auto use_plan = [&](int k, int l) {
    Drafter& d = *ds[k];
    const auto kd = kind(l);
    if (kd != planned[(size_t)k]) {
      d.plan_block(blocks[k], n_block[k], kd.first, kd.second, d.plan_b_);
      planned[(size_t)k] = kd;
    } else if (n == 1) {
      return;  // already the backend's plan
    }
    be.begin_chunk(d.plan_b_);
  };
  float* x = lead.x_.f();
  if (n == 1) {
    use_plan(0, 0);
  } else {  // the embedding reads every block's tokens: one plan of all rows
    ChunkPlan& A = lead.plan_all_;
    A = ChunkPlan{};
    A.n = R;
    for (int k = 0; k < n; ++k)
      for (int i = 0; i < n_block[k]; ++i) A.tokens.push_back(blocks[k][i]), A.pos.push_back(ds[k]->n_pos_ + i);
    be.begin_chunk(A);
  }
  be.embed(lead.t_.tok_embd, x);
  if (c.input_embedding_scale != 1.f) be.scale(x, c.input_embedding_scale, (size_t)R * H);

  // DFlash2: each sublayer between two grouped dynamic convolutions whose per-token kernels come from one
  // projection of the sublayer's normed input (side 0 on that input, side 1 on the sublayer's output); the
  // convolution runs along each block's own rows
  const int T = c.conv_kernel, G = c.conv_groups();
  float *hn = lead.hn_.f(), *dl = lead.dl_.f(), *cv = lead.cv_.f(), *out_ = lead.out_.f();
  auto conv = [&](const float* u, const DraftConvWeights& cw, int side) {
    for (int k = 0; k < n; ++k) {
      const size_t r0 = (size_t)row0[(size_t)k];
      be.grouped_conv(u + r0 * H, be.vec(cw.base), dl + r0 * 2 * T * G, side, n_block[k], H, T, G, cv + r0 * H);
    }
  };
  auto conv_in = [&](const DraftConvWeights& cw) -> const float* {  // hn -> the sublayer's input
    if (!c.dflash2) return hn;
    be.matmul(cw.proj, hn, R, dl);
    conv(hn, cw, 0);
    return cv;
  };
  auto add_out = [&](const DraftConvWeights& cw) {  // x += the sublayer's output, convolved for DFlash2
    if (c.dflash2) conv(out_, cw, 1);
    be.add(x, c.dflash2 ? cv : out_, (size_t)R * H);
  };
  const size_t qd = (size_t)c.q_dim(), kvd = (size_t)c.kv_dim();
  for (int l = 0; l < c.n_layer; ++l) {
    const DraftLayerWeights& L = lead.d_.layers[l];
    be.rmsnorm(x, be.vec(L.input_norm), R, H, c.rms_eps, hn);
    const float* a_in = conv_in(L.attn_conv);
    be.matmul(L.wq, a_in, R, lead.q_.f());
    be.matmul(L.wk, a_in, R, lead.kb_.f());
    be.matmul(L.wv, a_in, R, lead.vb_.f());
    for (int k = 0; k < n; ++k) {  // each block on its own drafter's context (plan: its slots cap..)
      Drafter& d = *ds[k];
      const size_t r0 = (size_t)row0[(size_t)k];
      use_plan(k, l);
      const AttnLayer A{d.attn_, d.k_[l].u8(), d.v_[l].u8(), be.vec(L.q_norm), be.vec(L.k_norm)};
      be.attn_store(lead.q_.f() + r0 * qd, lead.kb_.f() + r0 * kvd, lead.vb_.f() + r0 * kvd, A);
      be.attention(lead.q_.f() + r0 * qd, A, lead.att_.f() + r0 * qd);
    }
    be.matmul(L.wo, lead.att_.f(), R, out_);
    add_out(L.attn_conv);

    be.rmsnorm(x, be.vec(L.post_norm), R, H, c.rms_eps, hn);
    const float* m_in = conv_in(L.mlp_conv);
    be.matmul(L.gate, m_in, R, lead.g_.f());
    be.matmul(L.up, m_in, R, lead.u_.f());
    be.swiglu(lead.g_.f(), lead.u_.f(), (size_t)R * c.n_ff);
    be.matmul(L.down, lead.g_.f(), R, out_);
    add_out(L.mlp_conv);
  }

  // The draft's own final norm over each block's rows past its root (packed: block k's at prow0[k]), then the
  // target's lm_head over them all.
  for (int k = 0; k < n; ++k)
    be.rmsnorm(x + ((size_t)row0[(size_t)k] + 1) * H, be.vec(lead.d_.norm), n_block[k] - 1, H, c.rms_eps,
               hn + (size_t)prow0[(size_t)k] * H);
  const size_t nl = (size_t)P * tc.n_vocab;
  if (lead.logits_.bytes < nl * 4) lead.logits_ = BackendBuf(be, nl * 4);
  be.matmul(lead.t_.output, hn, P, lead.logits_.f());
  if (c.output_multiplier != 1.f) be.scale(lead.logits_.f(), c.output_multiplier, nl);
  for (int k = 0; k < n; ++k)
    out[k] = BlockResult{lead.logits_.f() + (size_t)prow0[(size_t)k] * tc.n_vocab, hn + (size_t)prow0[(size_t)k] * H};
}

}  // namespace dfl
