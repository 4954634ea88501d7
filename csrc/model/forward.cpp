// forward.cpp — the qwen35 forward over a batch of (token, position, parent).
//
// Layer loop as llama.cpp's qwen35 builder: pre-norm, gated attention or
// Gated DeltaNet, residual, post-norm, SwiGLU, residual.  Two facts shape it:
//  * Delta-net layers always use the recurrent (token-by-token) form, even
//    for prefill, so a token's state is bit-identical however the batch was
//    cut.  Each node starts from its parent's state: the committed state for
//    parent -1, else the parent node's persisted state.
//  * Attention always reads K/V back from the cache (after writing the
//    batch's own rows), visiting slots in ascending order, so a token sees the
//    same numbers in the same order alone or in a batch; tree nodes see the
//    committed context plus their ancestors (ancestor-only mask).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "model/context.h"
#include "ops/cpu_ops.h"
#include "quant/quant.h"

namespace dfl {

struct Context::Impl {
  ThreadPool pool;
  size_t kv_row = 0;                          // bytes of one K (or V) row of kv_dim values
  std::vector<std::vector<uint8_t>> k, v;     // per layer (empty for delta-net layers)
  std::vector<std::vector<float>> conv, rec;  // per layer committed state (empty for attention)
  std::vector<std::vector<float>> node_conv, node_rec;  // per layer, per verified node
  int node_cap = 0;
  std::vector<int32_t> node_parent;           // parents of the last verified batch
  // scratch, sized for n_batch tokens
  std::vector<float> x, hn, out, a0, a1, a2, a3, a4;
  ActScratch act;

  explicit Impl(int threads) : pool(threads) {}
};

static int default_threads() {
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : (int)n;
}

Context::Context(const Model& model, const ContextParams& p) : model_(model), params_(p) {
  const Qwen35Config& c = model.cfg;
  if (p.n_ctx <= 0) fail("context length must be positive (got %d)", p.n_ctx);
  if (p.n_batch <= 0) fail("batch size must be positive (got %d)", p.n_batch);
  if (p.kv_type != DType::F32 && p.kv_type != DType::F16 && p.kv_type != DType::Q8_0 &&
      p.kv_type != DType::Q4_0 && p.kv_type != DType::BF16)
    fail("unsupported KV cache type %s", type_traits((uint32_t)p.kv_type) ? type_traits((uint32_t)p.kv_type)->name : "?");
  impl_ = std::make_unique<Impl>(p.n_threads > 0 ? p.n_threads : default_threads());
  Impl& I = *impl_;
  I.kv_row = row_bytes(p.kv_type, c.kv_dim());
  I.k.resize(c.n_layer);
  I.v.resize(c.n_layer);
  I.conv.resize(c.n_layer);
  I.rec.resize(c.n_layer);
  I.node_conv.resize(c.n_layer);
  I.node_rec.resize(c.n_layer);
  for (int l = 0; l < c.n_layer; ++l) {
    if (c.is_recurrent[l]) {
      I.conv[l].assign((size_t)(c.conv_kernel - 1) * c.conv_channels(), 0.f);
      I.rec[l].assign((size_t)c.ssm_nv * c.ssm_dk * c.ssm_dv, 0.f);
    } else {
      I.k[l].assign((size_t)p.n_ctx * I.kv_row, 0);
      I.v[l].assign((size_t)p.n_ctx * I.kv_row, 0);
    }
  }
  const size_t nb = (size_t)p.n_batch;
  size_t widest = std::max({(size_t)2 * c.q_dim(), (size_t)c.conv_channels(), (size_t)c.n_ff,
                            (size_t)c.n_embd, (size_t)c.ssm_inner()});
  I.x.resize(nb * c.n_embd);
  I.hn.resize(nb * c.n_embd);
  I.out.resize(nb * c.n_embd);
  I.a0.resize(nb * widest);
  I.a1.resize(nb * widest);
  I.a2.resize(nb * widest);
  I.a3.resize(nb * std::max(c.ssm_nv, 1));
  I.a4.resize(nb * std::max(c.ssm_nv, 1));
  I.act.reserve((int64_t)nb * widest);
}

Context::~Context() = default;

void Context::reset() {
  n_past_ = 0;
  n_verify_ = 0;
  for (auto& s : impl_->conv) std::fill(s.begin(), s.end(), 0.f);
  for (auto& s : impl_->rec) std::fill(s.begin(), s.end(), 0.f);
}

size_t Context::state_bytes() const {
  size_t b = 0;
  for (auto& s : impl_->k) b += s.size();
  for (auto& s : impl_->v) b += s.size();
  for (auto& s : impl_->conv) b += s.size() * 4;
  for (auto& s : impl_->rec) b += s.size() * 4;
  return b;
}

ThreadPool& Context::pool() { return impl_->pool; }

size_t Context::committed_state_size() const {
  const Impl& I = *impl_;
  size_t b = 0;
  for (int l = 0; l < model_.cfg.n_layer; ++l)
    b += model_.cfg.is_recurrent[l] ? (I.conv[l].size() + I.rec[l].size()) * 4 : 2 * (size_t)n_past_ * I.kv_row;
  return b;
}

void Context::copy_committed_state(uint8_t* dst) const {
  const Impl& I = *impl_;
  for (int l = 0; l < model_.cfg.n_layer; ++l) {
    if (model_.cfg.is_recurrent[l]) {
      std::memcpy(dst, I.conv[l].data(), I.conv[l].size() * 4);
      dst += I.conv[l].size() * 4;
      std::memcpy(dst, I.rec[l].data(), I.rec[l].size() * 4);
      dst += I.rec[l].size() * 4;
    } else {
      const size_t n = (size_t)n_past_ * I.kv_row;
      std::memcpy(dst, I.k[l].data(), n);
      std::memcpy(dst + n, I.v[l].data(), n);
      dst += 2 * n;
    }
  }
}

void Context::forward(const Batch& b, const ForwardOutputs& out, bool commit) {
  const Qwen35Config& c = model_.cfg;
  if (b.n <= 0) fail("empty batch");
  for (int i = 0; i < b.n; ++i) {
    if (b.tokens[i] < 0 || b.tokens[i] >= c.n_vocab)
      fail("token id %d at batch index %d is outside the vocabulary (0..%d)", b.tokens[i], i, c.n_vocab - 1);
    if (b.pos[i] < 0) fail("negative position %d at batch index %d", b.pos[i], i);
    int par = b.parent ? b.parent[i] : i - 1;
    if (par < -1 || par >= i) fail("parent %d of batch index %d must be -1 or an earlier index", par, i);
    if (commit && par != i - 1) fail("a committing forward takes a chain (parent[i] = i-1)");
  }
  if (n_past_ + b.n > params_.n_ctx)
    fail("context full: %d tokens held + %d new exceed the context length %d", n_past_, b.n, params_.n_ctx);
  for (int i = 0; i < out.n_logits; ++i)
    if (out.logit_rows[i] < 0 || out.logit_rows[i] >= b.n) fail("logit row %d outside the batch", out.logit_rows[i]);
  for (int i = 0; i < out.n_capture; ++i)
    if (out.capture_layers[i] < 0 || out.capture_layers[i] >= c.n_layer)
      fail("capture layer %d outside 0..%d", out.capture_layers[i], c.n_layer - 1);
  ++n_forwards_;
  if (commit) {
    n_verify_ = 0;
    for (int off = 0; off < b.n; off += params_.n_batch) {
      int n = std::min(params_.n_batch, b.n - off);
      run_chunk(b, off, n, out, true);
      n_past_ += n;
    }
  } else {
    if (b.n > params_.n_batch) fail("a verify batch of %d nodes exceeds the batch size %d", b.n, params_.n_batch);
    Impl& I = *impl_;
    if (I.node_cap < b.n) {
      for (int l = 0; l < c.n_layer; ++l)
        if (c.is_recurrent[l]) {
          I.node_conv[l].resize((size_t)b.n * I.conv[l].size());
          I.node_rec[l].resize((size_t)b.n * I.rec[l].size());
        }
      I.node_cap = b.n;
    }
    I.node_parent.assign(b.n, 0);
    for (int i = 0; i < b.n; ++i) I.node_parent[i] = b.parent ? b.parent[i] : i - 1;
    run_chunk(b, 0, b.n, out, false);
    n_verify_ = b.n;
  }
}

void Context::commit_path(const int32_t* nodes, int n) {
  Impl& I = *impl_;
  const Qwen35Config& c = model_.cfg;
  if (n <= 0) fail("commit of an empty path");
  if (n > n_verify_) fail("commit path of %d nodes but the last verify held %d", n, n_verify_);
  for (int k = 0; k < n; ++k) {
    if (nodes[k] < 0 || nodes[k] >= n_verify_) fail("commit path node %d outside the verified batch", nodes[k]);
    int want = k == 0 ? -1 : nodes[k - 1];
    if (I.node_parent[nodes[k]] != want) fail("commit path is not a root-to-node path of the verified tree");
  }
  for (int k = 0; k < n; ++k) {
    if (nodes[k] == k) continue;
    for (int l = 0; l < c.n_layer; ++l) {
      if (c.is_recurrent[l]) continue;
      std::memcpy(I.k[l].data() + (size_t)(n_past_ + k) * I.kv_row,
                  I.k[l].data() + (size_t)(n_past_ + nodes[k]) * I.kv_row, I.kv_row);
      std::memcpy(I.v[l].data() + (size_t)(n_past_ + k) * I.kv_row,
                  I.v[l].data() + (size_t)(n_past_ + nodes[k]) * I.kv_row, I.kv_row);
    }
  }
  const int last = nodes[n - 1];
  for (int l = 0; l < c.n_layer; ++l) {
    if (!c.is_recurrent[l]) continue;
    size_t cs = I.conv[l].size(), rs = I.rec[l].size();
    std::memcpy(I.conv[l].data(), I.node_conv[l].data() + (size_t)last * cs, cs * 4);
    std::memcpy(I.rec[l].data(), I.node_rec[l].data() + (size_t)last * rs, rs * 4);
  }
  n_past_ += n;
  n_verify_ = 0;
}

// ---- layers -------------------------------------------------------------

namespace {

struct ChunkView {
  const Batch& b;
  int off, n;       // batch rows [off, off + n)
  int slot0;        // KV slot of batch row `off`
  bool commit;
  int parent(int t) const { int i = off + t; return b.parent ? b.parent[i] : i - 1; }
};

void l2norm(float* x, int n, float eps) {
  double ss = 0.0;
  for (int i = 0; i < n; ++i) ss += (double)x[i] * x[i];
  float inv = 1.f / std::max((float)std::sqrt(ss), eps);
  for (int i = 0; i < n; ++i) x[i] *= inv;
}

}  // namespace

void Context::run_chunk(const Batch& b, int off, int n, const ForwardOutputs& out, bool commit) {
  Impl& I = *impl_;
  const Model& M = model_;
  const Qwen35Config& c = M.cfg;
  const int H = c.n_embd, hd = c.head_dim;
  ChunkView cv{b, off, n, n_past_ + off * (commit ? 0 : 1), commit};
  float* x = I.x.data();
  for (int t = 0; t < n; ++t) embed_row(M.tok_embd, b.tokens[off + t], x + (size_t)t * H);

  const DType kvt = params_.kv_type;
  const TypeTraits* kvtt = type_traits((uint32_t)kvt);
  const size_t head_bytes = (size_t)(hd / kvtt->block_elems) * kvtt->block_bytes;

  for (int l = 0; l < c.n_layer; ++l) {
    const LayerWeights& w = M.layers[l];
    rmsnorm_rows(x, w.attn_norm.data(), n, H, c.rms_eps, I.hn.data());
    if (!c.is_recurrent[l]) {
      // ---- gated full attention ----
      const int qd2 = 2 * c.q_dim(), kvd = c.kv_dim();
      float* qg = I.a0.data();
      float* kk = I.a1.data();
      float* vv = I.a2.data();
      matmul(I.pool, w.wq, I.hn.data(), n, qg, I.act);
      matmul(I.pool, w.wk, I.hn.data(), n, kk, I.act);
      matmul(I.pool, w.wv, I.hn.data(), n, vv, I.act);
      for (int t = 0; t < n; ++t) {
        const int32_t pos = b.pos[off + t];
        for (int j = 0; j < c.n_head; ++j) {
          float* q = qg + (size_t)t * qd2 + (size_t)j * 2 * hd;
          rmsnorm_rows(q, w.q_norm.data(), 1, hd, c.rms_eps, q);
          rope_neox(q, c.n_rot, pos, c.rope_base);
        }
        for (int m = 0; m < c.n_head_kv; ++m) {
          float* k = kk + (size_t)t * kvd + (size_t)m * hd;
          rmsnorm_rows(k, w.k_norm.data(), 1, hd, c.rms_eps, k);
          rope_neox(k, c.n_rot, pos, c.rope_base);
        }
        const size_t slot = (size_t)cv.slot0 + t;
        quantize_row(kvt, kk + (size_t)t * kvd, I.k[l].data() + slot * I.kv_row, kvd);
        quantize_row(kvt, vv + (size_t)t * kvd, I.v[l].data() + slot * I.kv_row, kvd);
      }
      float* o = I.a1.data();  // k/v no longer needed: reuse for attention output
      const int group = c.n_head / c.n_head_kv;
      const float scale = 1.f / std::sqrt((float)hd);
      const int committed = commit ? cv.slot0 : n_past_;
      I.pool.parallel_for((int64_t)n * c.n_head, 1, [&](int64_t w0, int64_t w1) {
        thread_local std::vector<float> sc, tmp;
        thread_local std::vector<int32_t> extra;
        tmp.resize(hd);
        for (int64_t wi = w0; wi < w1; ++wi) {
          const int t = (int)(wi / c.n_head), j = (int)(wi % c.n_head), m = j / group;
          // Visible KV slots, ascending: a contiguous prefix [0, n_prefix), then
          // (tree verify only) the node's ancestors and itself.
          extra.clear();
          int n_prefix;
          if (commit) {
            n_prefix = cv.slot0 + t + 1;
          } else {
            n_prefix = committed;
            for (int a = off + t; a >= 0; a = I.node_parent[a]) extra.push_back(committed + a);
            std::reverse(extra.begin(), extra.end());
          }
          const size_t n_vis = (size_t)n_prefix + extra.size();
          auto slot = [&](size_t s) -> size_t { return s < (size_t)n_prefix ? s : (size_t)extra[s - n_prefix]; };
          const float* q = qg + (size_t)t * qd2 + (size_t)j * 2 * hd;
          sc.resize(n_vis);
          float mx = -INFINITY;
          for (size_t s = 0; s < n_vis; ++s) {
            const uint8_t* kr = I.k[l].data() + slot(s) * I.kv_row + m * head_bytes;
            float d;
            if (dtype_is_quantized(kvt)) {
              dequantize_row(kvt, kr, tmp.data(), hd);
              d = dot_f(DType::F32, tmp.data(), q, hd);
            } else {
              d = dot_f(kvt, kr, q, hd);
            }
            sc[s] = d * scale;
            mx = std::max(mx, sc[s]);
          }
          float sum = 0.f;
          for (size_t s = 0; s < n_vis; ++s) {
            sc[s] = std::exp(sc[s] - mx);
            sum += sc[s];
          }
          float* ot = o + (size_t)t * c.q_dim() + (size_t)j * hd;
          for (int d = 0; d < hd; ++d) ot[d] = 0.f;
          for (size_t s = 0; s < n_vis; ++s)
            axpy_row(kvt, I.v[l].data() + slot(s) * I.kv_row + m * head_bytes, sc[s], ot, hd, tmp.data());
          const float* gate = q + hd;
          const float inv = 1.f / sum;
          for (int d = 0; d < hd; ++d) ot[d] = ot[d] * inv * sigmoid(gate[d]);
        }
      });
      matmul(I.pool, w.wo, o, n, I.out.data(), I.act);
    } else {
      // ---- gated delta-net ----
      const int Cconv = c.conv_channels(), Cv = c.ssm_inner(), K = c.conv_kernel;
      const int nk = c.ssm_nk, nv = c.ssm_nv, dk = c.ssm_dk, dv = c.ssm_dv, Ck = nk * dk;
      float* mm = I.a0.data();
      float* z = I.a1.data();
      float* y = I.a2.data();
      float* bb = I.a3.data();
      float* aa = I.a4.data();
      matmul(I.pool, w.wqkv, I.hn.data(), n, mm, I.act);
      matmul(I.pool, w.wgate, I.hn.data(), n, z, I.act);
      matmul(I.pool, w.wbeta, I.hn.data(), n, bb, I.act);
      matmul(I.pool, w.walpha, I.hn.data(), n, aa, I.act);
      const size_t cs = I.conv[l].size(), rs = I.rec[l].size();
      const float qscale = 1.f / std::sqrt((float)dk);
      for (int t = 0; t < n; ++t) {
        float* win;   // (K-1) x Cconv, oldest first
        float* S;     // nv x dk x dv
        if (commit) {
          win = I.conv[l].data();
          S = I.rec[l].data();
        } else {
          const int i = off + t, par = cv.parent(t);
          win = I.node_conv[l].data() + (size_t)i * cs;
          S = I.node_rec[l].data() + (size_t)i * rs;
          const float* pw = par < 0 ? I.conv[l].data() : I.node_conv[l].data() + (size_t)par * cs;
          const float* ps = par < 0 ? I.rec[l].data() : I.node_rec[l].data() + (size_t)par * rs;
          std::memcpy(win, pw, cs * 4);
          std::memcpy(S, ps, rs * 4);
        }
        float* mt = mm + (size_t)t * Cconv;  // becomes the conv output in place
        for (int ch = 0; ch < Cconv; ++ch) {
          const float* wc = w.conv1d.data() + (size_t)ch * K;
          float acc = 0.f;
          for (int tau = 0; tau < K - 1; ++tau) acc += wc[tau] * win[(size_t)tau * Cconv + ch];
          acc += wc[K - 1] * mt[ch];
          for (int tau = 0; tau < K - 2; ++tau) win[(size_t)tau * Cconv + ch] = win[(size_t)(tau + 1) * Cconv + ch];
          win[(size_t)(K - 2) * Cconv + ch] = mt[ch];
          mt[ch] = silu(acc);
        }
        float* q = mt;
        float* k = mt + Ck;
        float* v = mt + 2 * Ck;
        for (int h = 0; h < nk; ++h) {
          l2norm(q + h * dk, dk, c.rms_eps);
          l2norm(k + h * dk, dk, c.rms_eps);
          for (int i = 0; i < dk; ++i) q[h * dk + i] *= qscale;
        }
        const float* zt = z + (size_t)t * Cv;
        float* yt = y + (size_t)t * Cv;
        const float* bt = bb + (size_t)t * nv;
        const float* at = aa + (size_t)t * nv;
        I.pool.parallel_for(nv, 1, [&](int64_t h0, int64_t h1) {
          for (int64_t h = h0; h < h1; ++h) {
            const int kh = (int)(h % nk);  // GGUF (tiled) value-head order
            const float beta = sigmoid(bt[h]);
            const float g = w.ssm_a[h] * softplus(at[h] + w.dt_bias[h]);
            float* oh = yt + h * dv;
            delta_rule_step(S + (size_t)h * dk * dv, k + kh * dk, v + h * dv, q + kh * dk, std::exp(g), beta,
                            dk, dv, oh);
            rmsnorm_rows(oh, w.ssm_norm.data(), 1, dv, c.rms_eps, oh);
            for (int j = 0; j < dv; ++j) oh[j] *= silu(zt[h * dv + j]);
          }
        });
      }
      matmul(I.pool, w.ssm_out, y, n, I.out.data(), I.act);
    }
    for (size_t i = 0; i < (size_t)n * H; ++i) x[i] += I.out[i];

    // ---- SwiGLU MLP ----
    rmsnorm_rows(x, w.post_norm.data(), n, H, c.rms_eps, I.hn.data());
    float* g = I.a0.data();
    float* u = I.a1.data();
    matmul(I.pool, w.ffn_gate, I.hn.data(), n, g, I.act);
    matmul(I.pool, w.ffn_up, I.hn.data(), n, u, I.act);
    for (size_t i = 0; i < (size_t)n * c.n_ff; ++i) g[i] = silu(g[i]) * u[i];
    matmul(I.pool, w.ffn_down, g, n, I.out.data(), I.act);
    for (size_t i = 0; i < (size_t)n * H; ++i) x[i] += I.out[i];

    for (int ci = 0; ci < out.n_capture; ++ci)
      if (out.capture_layers[ci] == l)
        for (int t = 0; t < n; ++t)
          std::memcpy(out.hidden + ((size_t)(off + t) * out.n_capture + ci) * H, x + (size_t)t * H, (size_t)H * 4);
  }

  // ---- logits for the requested rows in this chunk ----
  for (int r = 0; r < out.n_logits; ++r) {
    int row = out.logit_rows[r];
    if (row < off || row >= off + n) continue;
    float* hrow = I.hn.data();
    rmsnorm_rows(x + (size_t)(row - off) * H, M.output_norm.data(), 1, H, c.rms_eps, hrow);
    matmul(I.pool, M.output, hrow, 1, out.logits + (size_t)r * c.n_vocab, I.act);
  }
}

}  // namespace dfl
