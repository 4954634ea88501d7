// drafter.cpp — DFlash block forward over a feature ring and draft KV ring.
#include "model/drafter.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "quant/quant.h"
#include "util/error.h"

namespace dfl {

namespace {
constexpr int kProjectChunk = 64;  // context positions projected per matmul batch

int hw_threads() {
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : (int)n;
}
}  // namespace

Drafter::Drafter(const DraftModel& draft, const Model& target, const DrafterParams& p, ThreadPool* pool)
    : d_(draft), t_(target), cap_(p.ring_capacity) {
  const DraftConfig& c = d_.cfg;
  validate_pair(c, target.cfg);
  if (cap_ <= 0) fail("feature ring capacity must be positive (got %d)", cap_);
  if (!c.rope_scaling_type.empty())
    fail("drafter rope_scaling type '%s' is not supported by this version (only unscaled RoPE)",
         c.rope_scaling_type.c_str());
  if (pool) {
    pool_ = pool;
  } else {
    own_pool_ = std::make_unique<ThreadPool>(p.n_threads > 0 ? p.n_threads : hw_threads());
    pool_ = own_pool_.get();
  }
  ring_.assign((size_t)cap_ * c.fc_in(), 0.f);
  k_.assign(c.n_layer, std::vector<float>((size_t)cap_ * c.kv_dim(), 0.f));
  v_.assign(c.n_layer, std::vector<float>((size_t)cap_ * c.kv_dim(), 0.f));
}

Drafter::~Drafter() = default;

void Drafter::reset() {
  n_pos_ = 0;
  consumed_ = 0;
}

size_t Drafter::state_bytes() const {
  size_t b = ring_.size() * 4;
  for (auto& k : k_) b += k.size() * 4;
  for (auto& v : v_) b += v.size() * 4;
  return b;
}

void Drafter::push_features(int32_t pos0, int n, const float* feats) {
  if (pos0 != n_pos_) fail("features for position %d pushed, but the drafter expects position %d next", pos0, n_pos_);
  if (n < 0) fail("negative feature count");
  const size_t w = (size_t)feature_width();
  // Only the newest `cap_` positions can ever be read again.
  const int skip = std::max(0, n - cap_);
  for (int i = skip; i < n; ++i)
    std::memcpy(ring_.data() + (size_t)((pos0 + i) % cap_) * w, feats + (size_t)i * w, w * 4);
  n_pos_ += n;
  // Positions that fell out of the ring before being consumed are never projected.
  consumed_ = std::max(consumed_, n_pos_ - cap_);
}

void Drafter::skip_features(int32_t pos0, int n) {
  if (pos0 != n_pos_) fail("features for position %d skipped, but the drafter expects position %d next", pos0, n_pos_);
  n_pos_ += n;
  consumed_ = std::max(consumed_, n_pos_);
}

void Drafter::consume_features() {
  while (consumed_ < n_pos_) {
    int n = std::min(kProjectChunk, n_pos_ - consumed_);
    project_context(consumed_, n);
    consumed_ += n;
  }
}

void Drafter::project_context(int32_t pos0, int n) {
  const DraftConfig& c = d_.cfg;
  const int H = c.hidden, hd = c.head_dim, kvd = c.kv_dim();
  const size_t w = (size_t)feature_width();
  std::vector<float>& f = g_;  // scratch: gathered ring rows
  f.resize((size_t)n * w);
  for (int i = 0; i < n; ++i)
    std::memcpy(f.data() + (size_t)i * w, ring_.data() + (size_t)((pos0 + i) % cap_) * w, w * 4);
  ctx_.resize((size_t)n * H);
  matmul(*pool_, d_.fc, f.data(), n, ctx_.data(), act_);
  rmsnorm_rows(ctx_.data(), d_.hidden_norm.data(), n, H, c.rms_eps, ctx_.data());
  kb_.resize((size_t)n * kvd);
  vb_.resize((size_t)n * kvd);
  for (int l = 0; l < c.n_layer; ++l) {
    const DraftLayerWeights& L = d_.layers[l];
    matmul(*pool_, L.wk, ctx_.data(), n, kb_.data(), act_);
    matmul(*pool_, L.wv, ctx_.data(), n, vb_.data(), act_);
    for (int i = 0; i < n; ++i) {
      const int32_t pos = pos0 + i;
      float* k = kb_.data() + (size_t)i * kvd;
      for (int m = 0; m < c.n_head_kv; ++m) {
        rmsnorm_rows(k + m * hd, L.k_norm.data(), 1, hd, c.rms_eps, k + m * hd);
        rope_neox(k + m * hd, hd, pos, (float)c.rope_theta);
      }
      const size_t slot = (size_t)(pos % cap_) * kvd;
      std::memcpy(k_[l].data() + slot, k, (size_t)kvd * 4);
      std::memcpy(v_[l].data() + slot, vb_.data() + (size_t)i * kvd, (size_t)kvd * 4);
    }
  }
}

void Drafter::propose(const int32_t* block_tokens, int n_block, float* logits) {
  const DraftConfig& c = d_.cfg;
  const Qwen35Config& tc = t_.cfg;
  if (n_block < 2) fail("a draft block needs at least 2 positions (got %d)", n_block);
  for (int i = 0; i < n_block; ++i)
    if (block_tokens[i] < 0 || block_tokens[i] >= tc.n_vocab)
      fail("draft block token %d at index %d is outside the vocabulary", block_tokens[i], i);
  consume_features();

  const int B = n_block, H = c.hidden, hd = c.head_dim, qd = c.q_dim(), kvd = c.kv_dim();
  const int32_t s = n_pos_;                      // position of the root
  const int32_t lo = std::max(0, s - cap_);      // oldest context position still in the ring
  x_.resize((size_t)B * H);
  hn_.resize((size_t)B * H);
  q_.resize((size_t)B * qd);
  kb_.resize((size_t)B * kvd);
  vb_.resize((size_t)B * kvd);
  att_.resize((size_t)B * qd);
  out_.resize((size_t)B * H);
  g_.resize((size_t)B * c.n_ff);
  u_.resize((size_t)B * c.n_ff);
  for (int i = 0; i < B; ++i) {
    float* xi = x_.data() + (size_t)i * H;
    embed_row(t_.tok_embd, block_tokens[i], xi);
    if (c.input_embedding_scale != 1.f)
      for (int j = 0; j < H; ++j) xi[j] *= c.input_embedding_scale;
  }
  const float scale = 1.f / std::sqrt((float)hd);
  const int group = c.n_head / c.n_head_kv;

  for (int l = 0; l < c.n_layer; ++l) {
    const DraftLayerWeights& L = d_.layers[l];
    // z-lab: sliding layers are causal unless the config's is_causal says otherwise (for every layer).
    const bool causal = c.is_causal >= 0 ? c.is_causal == 1 : c.is_sliding[l] != 0;
    const int64_t W = c.is_sliding[l] ? c.sliding_window : 0;
    rmsnorm_rows(x_.data(), L.input_norm.data(), B, H, c.rms_eps, hn_.data());
    matmul(*pool_, L.wq, hn_.data(), B, q_.data(), act_);
    matmul(*pool_, L.wk, hn_.data(), B, kb_.data(), act_);
    matmul(*pool_, L.wv, hn_.data(), B, vb_.data(), act_);
    for (int i = 0; i < B; ++i) {
      for (int j = 0; j < c.n_head; ++j) {
        float* q = q_.data() + (size_t)i * qd + (size_t)j * hd;
        rmsnorm_rows(q, L.q_norm.data(), 1, hd, c.rms_eps, q);
        rope_neox(q, hd, s + i, (float)c.rope_theta);
      }
      for (int m = 0; m < c.n_head_kv; ++m) {
        float* k = kb_.data() + (size_t)i * kvd + (size_t)m * hd;
        rmsnorm_rows(k, L.k_norm.data(), 1, hd, c.rms_eps, k);
        rope_neox(k, hd, s + i, (float)c.rope_theta);
      }
    }
    auto visible = [&](int64_t qp, int64_t kp) {
      if (causal && kp > qp) return false;
      if (W > 0 && (qp - kp >= W || (!causal && kp - qp >= W))) return false;
      return true;
    };
    const std::vector<float>& Kc = k_[l];
    const std::vector<float>& Vc = v_[l];
    pool_->parallel_for((int64_t)B * c.n_head, 1, [&](int64_t w0, int64_t w1) {
      thread_local std::vector<float> sc;
      for (int64_t wi = w0; wi < w1; ++wi) {
        const int i = (int)(wi / c.n_head), j = (int)(wi % c.n_head), m = j / group;
        const int64_t qp = s + i;
        const float* q = q_.data() + (size_t)i * qd + (size_t)j * hd;
        // keys in order: cached context (ascending positions), then the block
        const int64_t c0 = W > 0 ? std::max<int64_t>(lo, qp - W + 1) : lo;
        sc.assign((size_t)(std::max<int64_t>(0, s - c0) + B), -INFINITY);
        float mx = -INFINITY;
        size_t n_sc = 0;
        for (int64_t p = c0; p < s; ++p, ++n_sc) {
          if (!visible(qp, p)) continue;
          const float* k = Kc.data() + (size_t)(p % cap_) * kvd + (size_t)m * hd;
          float d = 0.f;
          for (int e = 0; e < hd; ++e) d += q[e] * k[e];
          sc[n_sc] = d * scale;
          mx = std::max(mx, sc[n_sc]);
        }
        for (int b = 0; b < B; ++b, ++n_sc) {
          if (!visible(qp, s + b)) continue;
          const float* k = kb_.data() + (size_t)b * kvd + (size_t)m * hd;
          float d = 0.f;
          for (int e = 0; e < hd; ++e) d += q[e] * k[e];
          sc[n_sc] = d * scale;
          mx = std::max(mx, sc[n_sc]);
        }
        float sum = 0.f;
        for (size_t t = 0; t < n_sc; ++t) {
          sc[t] = sc[t] == -INFINITY ? 0.f : std::exp(sc[t] - mx);
          sum += sc[t];
        }
        float* o = att_.data() + (size_t)i * qd + (size_t)j * hd;
        std::fill(o, o + hd, 0.f);
        size_t t = 0;
        for (int64_t p = c0; p < s; ++p, ++t) {
          if (sc[t] == 0.f) continue;
          const float* v = Vc.data() + (size_t)(p % cap_) * kvd + (size_t)m * hd;
          for (int e = 0; e < hd; ++e) o[e] += sc[t] * v[e];
        }
        for (int b = 0; b < B; ++b, ++t) {
          if (sc[t] == 0.f) continue;
          const float* v = vb_.data() + (size_t)b * kvd + (size_t)m * hd;
          for (int e = 0; e < hd; ++e) o[e] += sc[t] * v[e];
        }
        const float inv = 1.f / sum;
        for (int e = 0; e < hd; ++e) o[e] *= inv;
      }
    });
    matmul(*pool_, L.wo, att_.data(), B, out_.data(), act_);
    for (size_t i = 0; i < (size_t)B * H; ++i) x_[i] += out_[i];

    rmsnorm_rows(x_.data(), L.post_norm.data(), B, H, c.rms_eps, hn_.data());
    matmul(*pool_, L.gate, hn_.data(), B, g_.data(), act_);
    matmul(*pool_, L.up, hn_.data(), B, u_.data(), act_);
    for (size_t i = 0; i < (size_t)B * c.n_ff; ++i) g_[i] = silu(g_[i]) * u_[i];
    matmul(*pool_, L.down, g_.data(), B, out_.data(), act_);
    for (size_t i = 0; i < (size_t)B * H; ++i) x_[i] += out_[i];
  }

  // The draft's own final norm, then the target's lm_head for positions 1..B-1.
  rmsnorm_rows(x_.data() + H, d_.norm.data(), B - 1, H, c.rms_eps, hn_.data());
  matmul(*pool_, t_.output, hn_.data(), B - 1, logits, act_);
  const size_t nl = (size_t)(B - 1) * tc.n_vocab;
  if (c.output_multiplier != 1.f)
    for (size_t i = 0; i < nl; ++i) logits[i] *= c.output_multiplier;
  if (c.final_logit_softcapping > 0.f) {
    const float cap = c.final_logit_softcapping;
    for (size_t i = 0; i < nl; ++i) logits[i] = std::tanh(logits[i] / cap) * cap;
  }
}

}  // namespace dfl
