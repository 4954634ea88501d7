// cpu_backend.cpp — the Backend ops on the CPU (the reference for CUDA).
//
// Memory is plain host memory and the model's weights are used in place (the
// mmapped GGUF).  Arithmetic is the cpu_ops row functions with a fixed
// reduction order; threads split tokens, heads or rows, never a sum.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <unordered_map>

#include "backend/backend.h"
#include "backend/cpu/cpu_ops.h"
#include "quant/quant.h"
#include "backend/topk.h"

namespace dfl {
namespace {

void l2norm(float* x, int n, float eps) {
  double ss = 0.0;
  for (int i = 0; i < n; ++i) ss += (double)x[i] * x[i];
  float inv = 1.f / std::max((float)std::sqrt(ss), eps);
  for (int i = 0; i < n; ++i) x[i] *= inv;
}

class CpuBackend final : public Backend {
 public:
  CpuBackend(const Model& m, ThreadPool& pool) : c_(m.cfg), pool_(pool) {}

  Device device() const override { return Device::CPU; }
  std::string name() const override { return std::string("cpu (") + simd_name() + ")"; }

  void* alloc(size_t bytes) override {
    const size_t n = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, n ? n : 64);
    if (!p) fail("out of host memory allocating %zu bytes", bytes);
    std::memset(p, 0, n);
    return p;
  }
  void release(void* p) override { std::free(p); }
  void upload(void* dst, const void* host, size_t bytes) override { std::memcpy(dst, host, bytes); }
  void download(void* host, const void* src, size_t bytes) override {
    // a verify's logits are megabytes: the pool copies them rather than one thread
    constexpr size_t kGrain = 1 << 20;
    if (bytes < 2 * kGrain) return (void)std::memcpy(host, src, bytes);
    pool_.parallel_for((int64_t)bytes, kGrain, [&](int64_t b, int64_t e) {
      std::memcpy(static_cast<uint8_t*>(host) + b, static_cast<const uint8_t*>(src) + b, (size_t)(e - b));
    });
  }
  void download_rows(void* host, size_t host_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                     size_t rows) override {
    for (size_t r = 0; r < rows; ++r)
      std::memcpy(static_cast<uint8_t*>(host) + r * host_pitch, static_cast<const uint8_t*>(src) + r * src_pitch,
                  row_bytes);
  }
  void copy(void* dst, const void* src, size_t bytes) override { std::memmove(dst, src, bytes); }
  void copy_rows(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                 size_t rows) override {
    download_rows(dst, dst_pitch, src, src_pitch, row_bytes, rows);
  }
  void fill_zero(void* dst, size_t bytes) override { std::memset(dst, 0, bytes); }
  void sync() override {}
  const void* weight(const Weight& w) override { return w.data; }
  const float* vec(const std::vector<float>& v) override { return v.data(); }
  void add_weights(const void*, const std::vector<std::pair<const void*, size_t>>&) override {}

  void begin_chunk(const ChunkPlan& plan) override { p_ = &plan; }

  void embed(const Weight& table, float* x) override {
    for (int t = 0; t < p_->n; ++t) embed_row(table, p_->tokens[t], x + (size_t)t * table.cols);
  }
  void rmsnorm(const float* x, const float* w, int n, int dim, float eps, float* y) override {
    if (n < 4) return rmsnorm_rows(x, w, n, dim, eps, y);
    pool_.parallel_for(n, 1, [&](int64_t t0, int64_t t1) {
      rmsnorm_rows(x + t0 * dim, w, (int)(t1 - t0), dim, eps, y + t0 * dim);
    });
  }
  void matmul(const Weight& W, const float* x, int n, float* y) override { dfl::matmul(pool_, W, x, n, y, act_); }
  void add(float* x, const float* y, size_t count) override {
    for (size_t i = 0; i < count; ++i) x[i] += y[i];
  }
  void scale(float* x, float s, size_t count) override {
    for (size_t i = 0; i < count; ++i) x[i] *= s;
  }
  void swiglu(float* g, const float* u, size_t count) override {
    auto part = [&](int64_t i0, int64_t i1) {
      silu_rows(g + i0, u + i0, g + i0, i1 - i0);
    };
    if (count < 16384) part(0, (int64_t)count);  // an AR step's: not worth waking the workers
    else pool_.parallel_for((int64_t)count, 4096, part);
  }

  void grouped_conv(const float* u, const float* base, const float* delta, int side, int n, int H, int T, int G,
                    float* out) override {
    const int gs = H / G;
    for (int i = 0; i < n; ++i) {
      const float* d = delta + ((size_t)i * 2 + side) * T * G;
      for (int c = 0; c < H; ++c) {
        float acc = 0.f;
        for (int t = 0; t < T && t <= i; ++t) {
          const float coef = base[((size_t)side * T + t) * H + c] + d[(size_t)t * G + c / gs];
          const float term = coef * u[(size_t)(i - t) * H + c];
          acc = t == 0 ? term : acc + term;
        }
        out[(size_t)i * H + c] = acc;
      }
    }
  }

  void attn_store(float* qg, float* kk, const float* vv, const AttnLayer& L) override {
    const AttnShape& a = L.s;
    const int hd = a.head_dim, qs = a.q_stride(), kvd = a.n_head_kv * hd;
    const size_t kv_row = row_bytes(a.kv_type, kvd);
    for (int t = 0; t < p_->n; ++t) {
      const int32_t pos = p_->pos[t];
      for (int j = 0; j < a.n_head; ++j) {
        float* q = qg + (size_t)t * a.n_head * qs + (size_t)j * qs;
        rmsnorm_rows(q, L.q_norm, 1, hd, a.eps, q);
        rope_neox(q, a.rope, pos);
      }
      for (int m = 0; m < a.n_head_kv; ++m) {
        float* k = kk + (size_t)t * kvd + (size_t)m * hd;
        rmsnorm_rows(k, L.k_norm, 1, hd, a.eps, k);
        rope_neox(k, a.rope, pos);
      }
      const size_t slot = (size_t)p_->kv_slot0 + t;
      quantize_row(a.kv_type, kk + (size_t)t * kvd, L.k_cache + slot * kv_row, kvd);
      quantize_row(a.kv_type, vv + (size_t)t * kvd, L.v_cache + slot * kv_row, kvd);
    }
  }

  void attention(const float* qg, const AttnLayer& L, float* o) override {
    const AttnShape& a = L.s;
    const DType kvt = a.kv_type;
    const int hd = a.head_dim, qs = a.q_stride(), n_head = a.n_head;
    const int group = n_head / a.n_head_kv;
    const size_t kv_row = row_bytes(kvt, (int64_t)a.n_head_kv * hd);
    const TypeTraits* tt = type_traits((uint32_t)kvt);
    const size_t head_bytes = (size_t)(hd / tt->block_elems) * tt->block_bytes;
    const float scale = 1.f / std::sqrt((float)hd);
    const ChunkPlan& P = *p_;
    // One work item per (KV head, block of tokens).  A K or V row of the committed
    // prefix is widened to f32 once per item, in blocks of kKeyBlock rows, and used by
    // every query head of the group for every token of the block that sees it; a
    // token's extra slots (its tree ancestors) are widened for it alone.  Per query
    // head the operations are dot_f and axpy_rows on the widened rows (widening is
    // exact), over the token's visible slots in order, so the result does not depend
    // on the grouping or on the other tokens.
    constexpr int kKeyBlock = 32;
    const int n_kv = a.n_head_kv, n = P.n;
    // tokens per item: enough items for every thread to get about four
    const int tb = std::clamp((n * n_kv + 4 * pool_.size() - 1) / (4 * pool_.size()), 1, 16);
    const int n_blocks = (n + tb - 1) / tb;
    pool_.parallel_for((int64_t)n_blocks * n_kv, 1, [&](int64_t w0, int64_t w1) {
      thread_local std::vector<float> sc, rows, row, inv, dots;
      row.resize(hd);
      dots.resize(group);
      inv.resize((size_t)tb * group);
      rows.resize((size_t)kKeyBlock * hd);
      for (int64_t wi = w0; wi < w1; ++wi) {
        const int m = (int)(wi % n_kv), t0 = (int)(wi / n_kv) * tb, t1 = std::min(n, t0 + tb);
        size_t max_prefix = 0, max_vis = 0;
        for (int t = t0; t < t1; ++t) {
          max_prefix = std::max(max_prefix, (size_t)P.n_prefix[t]);
          max_vis = std::max(max_vis, (size_t)P.n_prefix[t] + (size_t)P.extra_count[t]);
        }
        sc.resize((size_t)(t1 - t0) * group * max_vis);
        // row `slot` of the cache (K or V) for this KV head, as f32 in dst (F32: in place)
        auto widened = [&](const uint8_t* cache, size_t slot, float* dst) -> const float* {
          const uint8_t* r = cache + slot * kv_row + m * head_bytes;
          if (kvt == DType::F32) return reinterpret_cast<const float*>(r);
          widen_row(kvt, r, dst, hd);
          return dst;
        };
        // fn(t, s, ns, rows) for each token of the block and runs of its visible slots s .. s+ns-1
        // (rows[k]: slot s+k), in slot order per token: the prefix a block of rows at a time, then
        // each token's extra slots one at a time
        auto each_visible_run = [&](const uint8_t* cache, auto&& fn) {
          for (size_t s0 = 0; s0 < max_prefix; s0 += kKeyBlock) {
            const size_t s1 = std::min(max_prefix, s0 + kKeyBlock);
            const float* blk[kKeyBlock];
            for (size_t s = s0; s < s1; ++s) blk[s - s0] = widened(cache, s, rows.data() + (s - s0) * hd);
            for (int t = t0; t < t1; ++t) {
              const size_t e = std::min(s1, (size_t)P.n_prefix[t]);
              if (e > s0) fn(t, s0, (int)(e - s0), blk);
            }
          }
          for (int t = t0; t < t1; ++t) {
            const size_t n_prefix = (size_t)P.n_prefix[t];
            const int32_t* extra = P.extra_slots.data() + P.extra_begin[t];
            for (int e = 0; e < P.extra_count[t]; ++e) {
              const float* r = widened(cache, (size_t)extra[e], row.data());
              fn(t, n_prefix + e, 1, &r);
            }
          }
        };
        auto each_visible = [&](const uint8_t* cache, auto&& fn) {  // fn(t, s, row) per slot
          each_visible_run(cache, [&](int t, size_t s, int ns, const float* const* r) {
            for (int k = 0; k < ns; ++k) fn(t, s + k, r[k]);
          });
        };
        auto q_of = [&](int t) { return qg + (size_t)t * n_head * qs + (size_t)m * group * qs; };
        auto o_of = [&](int t) { return o + ((size_t)t * n_head + (size_t)m * group) * hd; };
        auto sc_of = [&](int t, int g) { return sc.data() + ((size_t)(t - t0) * group + g) * max_vis; };
        each_visible(L.k_cache, [&](int t, size_t s, const float* k) {
          dot_f_multi(DType::F32, k, q_of(t), qs, group, hd, dots.data());
          for (int g = 0; g < group; ++g) sc_of(t, g)[s] = dots[g] * scale;
        });
        for (int t = t0; t < t1; ++t) {
          const size_t n_vis = (size_t)P.n_prefix[t] + (size_t)P.extra_count[t];
          for (int g = 0; g < group; ++g) {
            float* e = sc_of(t, g);
            float mx = -INFINITY;
            for (size_t s = 0; s < n_vis; ++s) mx = std::max(mx, e[s]);
            float sum = 0.f;
            for (size_t s = 0; s < n_vis; ++s) {
              e[s] = std::exp(e[s] - mx);
              sum += e[s];
            }
            inv[(size_t)(t - t0) * group + g] = 1.f / sum;
          }
          std::fill(o_of(t), o_of(t) + (size_t)group * hd, 0.f);
        }
        each_visible_run(L.v_cache, [&](int t, size_t s, int ns, const float* const* v) {
          float* o0 = o_of(t);
          for (int g = 0; g < group; ++g) axpy_rows(v, sc_of(t, g) + s, ns, o0 + (size_t)g * hd, hd);
        });
        for (int t = t0; t < t1; ++t)
          for (int g = 0; g < group; ++g) {
            float* ot = o_of(t) + (size_t)g * hd;
            const float iv = inv[(size_t)(t - t0) * group + g];
            if (a.gated) {
              gate_rows(ot, iv, q_of(t) + (size_t)g * qs + hd, ot, hd);
            } else {
              for (int d = 0; d < hd; ++d) ot[d] *= iv;
            }
          }
      }
    });
  }

  void gdn(float* mm, const float* z, const float* bb, const float* aa, const GdnLayer& L, float* y) override {
    const int Cconv = c_.conv_channels(), Cv = c_.ssm_inner();
    const int nk = c_.ssm_nk, nv = c_.ssm_nv, dk = c_.ssm_dk, dv = c_.ssm_dv, Ck = nk * dk;
    const size_t rs = (size_t)nv * dk * dv;
    const float qscale = 1.f / std::sqrt((float)dk);
    const ChunkPlan& P = *p_;
    const GdnNodeLayout U(c_);
    const size_t es = row_bytes(L.state_type, 1), hs = (size_t)dk * dv;  // state element bytes, head size
    const int n = P.n;
    // Each stage runs over all tokens with the pool split over channels, tokens or
    // heads; a token's arithmetic is the same as when it runs alone.  In commit
    // mode every token advances the layer's own window and state; in tree mode
    // node t starts from its parent's (parents come before children).
    auto upd_of = [&](int t) { return P.commit ? nullptr : L.node_upd + (size_t)t * U.stride; };
    if (!P.commit)
      for (int t = 0; t < n; ++t) std::memcpy(upd_of(t) + U.xin, mm + (size_t)t * Cconv, (size_t)Cconv * 4);
    causal_conv(mm, L);
    // q and k l2-normalised per key head, q scaled
    pool_.parallel_for(n, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        float* q = mm + (size_t)t * Cconv;
        float* k = q + Ck;
        for (int h = 0; h < nk; ++h) {
          l2norm(q + h * dk, dk, c_.rms_eps);
          l2norm(k + h * dk, dk, c_.rms_eps);
          for (int i = 0; i < dk; ++i) q[h * dk + i] *= qscale;
        }
        if (float* upd = upd_of((int)t)) std::memcpy(upd + U.k, k, (size_t)Ck * 4);
      }
    });
    // the walk's order (a tree's preorder) and which node states node_rec must hold (GdnLayer::node_rec)
    std::vector<int32_t> walk;
    if (P.commit) {
      walk.resize((size_t)n);
      for (int t = 0; t < n; ++t) walk[(size_t)t] = t;
    } else {
      walk = gdn_walk_order(P.parent.data(), n);
    }
    const std::vector<uint8_t> keep = P.commit ? std::vector<uint8_t>() : node_rec_kept(P.parent.data(), walk);
    // the delta rule, per value head through all tokens
    pool_.parallel_for(nv, 1, [&](int64_t h0, int64_t h1) {
      // Per-thread buffers kept across calls (allocating them per part cost a verify ~1 ms):
      // `tmp` a reduced state in f32, `work` one column block of the f32 state being stepped,
      // `gate` each token's beta and decay.
      const bool reduced = L.state_type != DType::F32;
      thread_local std::vector<float> tmp, work, gate;
      if (reduced && tmp.size() < hs) tmp.resize(hs);
      if (work.size() < (size_t)dk * kDeltaCols) work.resize((size_t)dk * kDeltaCols);
      if (gate.size() < 2 * (size_t)n) gate.resize(2 * (size_t)n);
      for (int64_t h = h0; h < h1; ++h) {
        const int kh = (int)(h % nk);  // GGUF (tiled) value-head order
        const size_t hoff = (size_t)h * hs;  // the head's first element in a state
        float* beta = gate.data();
        float* decay = beta + n;
        for (int t = 0; t < n; ++t) {
          beta[t] = sigmoid(bb[(size_t)t * nv + h]);
          decay[t] = std::exp(L.ssm_a[h] * softplus(aa[(size_t)t * nv + h] + L.dt_bias[h]));
        }
        // token t's q, k, v, its output row and its update (verify) of this head
        auto step_args = [&](int t, const float*& q, const float*& k, const float*& v, float*& o, float*& delta) {
          q = mm + (size_t)t * Cconv + kh * dk;
          k = q + Ck;
          v = mm + (size_t)t * Cconv + 2 * Ck + h * dv;
          o = y + (size_t)t * Cv + h * dv;
          float* upd = upd_of(t);
          delta = upd ? upd + U.delta + (size_t)h * dv : nullptr;
        };
        if (reduced) {
          // a reduced state: each token's step computed in f32 from the state of state_type and
          // rounded back after it (commit: the layer's own, in place; verify: parent -> node)
          for (int t = 0; t < n; ++t) {
            const int par = P.commit ? -1 : P.parent[t];
            const uint8_t* src = P.commit || par < 0 ? static_cast<const uint8_t*>(L.rec) + hoff * es
                                                     : static_cast<const uint8_t*>(L.node_rec) + ((size_t)par * rs + hoff) * es;
            uint8_t* dst = P.commit ? static_cast<uint8_t*>(L.rec) + hoff * es
                                    : static_cast<uint8_t*>(L.node_rec) + ((size_t)t * rs + hoff) * es;
            const float *q, *k, *v;
            float *o, *delta;
            step_args(t, q, k, v, o, delta);
            dequantize_row(L.state_type, src, tmp.data(), (int64_t)hs);
            delta_rule_step(tmp.data(), tmp.data(), k, v, q, decay[t], beta[t], dk, dv, o, delta);
            quantize_row(L.state_type, tmp.data(), dst, (int64_t)hs);
          }
        } else {
          // f32: the tokens step one block of columns at a time (columns are independent), the
          // block in `work` (dk x nb, contiguous: it stays in L1 through all tokens), in the walk's
          // order.  A token whose parent is the token before it in the walk reads `work`; one that
          // starts from the committed state or an earlier node reads that state's block.  In commit
          // mode the layer's state is the start and receives the block after the last token (a
          // single token steps it in place); in verify mode only the node states node_rec must hold
          // are written
          // (streamed: they are read again much later, by a branch or the next chunk).
          float* rec = static_cast<float*>(L.rec) + hoff;
          float* node_rec = static_cast<float*>(L.node_rec);
          const std::vector<uint8_t>& kept = keep;
          const int bw = delta_block_cols();
          for (int j0 = 0; j0 < dv; j0 += bw) {
            const int nb = std::min(bw, dv - j0);
            for (int w = 0; w < n; ++w) {
              const int t = walk[(size_t)w];
              const float *Sin = work.data(), *q, *k, *v;
              int64_t in_stride = nb;
              float *Sout = work.data(), *o, *delta;
              int64_t out_stride = nb;
              if (P.commit) {
                if (n == 1) Sout = rec + j0, out_stride = dv;
                if (t == 0) Sin = rec + j0, in_stride = dv;
              } else {
                const int par = P.parent[t];
                if (par < 0) Sin = rec + j0, in_stride = dv;
                else if (w == 0 || par != walk[(size_t)w - 1])
                  Sin = node_rec + (size_t)par * rs + hoff + j0, in_stride = dv;
              }
              step_args(t, q, k, v, o, delta);
              delta_rule_cols(Sin, in_stride, Sout, out_stride, k, v + j0, q, decay[t], beta[t], dk, nb, o + j0,
                              delta ? delta + j0 : nullptr);
              if (!P.commit && kept[t]) {
                float* dst = node_rec + (size_t)t * rs + hoff + j0;
                for (int i = 0; i < dk; ++i) stream_copy(dst + (size_t)i * dv, work.data() + (size_t)i * nb, nb);
              }
            }
            if (P.commit && n > 1)
              for (int i = 0; i < dk; ++i)
                std::memcpy(rec + (size_t)i * dv + j0, work.data() + (size_t)i * nb, (size_t)nb * 4);
          }
        }
        for (int t = 0; t < n; ++t) {
          if (float* upd = upd_of(t)) upd[U.decay + h] = decay[t];
          float* oh = y + (size_t)t * Cv + h * dv;
          rmsnorm_rows(oh, L.ssm_norm, 1, dv, c_.rms_eps, oh);
          silu_rows(z + (size_t)t * Cv + h * dv, oh, oh, dv);  // oh[j] * silu(z[j])
        }
      }
      stream_fence();
    });
  }

  // The conv taps of a layer tap-major, [K][Cconv], so a block of channels reads
  // each tap contiguously (made once per layer; the model's vectors outlive us).
  const float* conv_taps(const float* conv1d) {
    const int C = c_.conv_channels(), K = c_.conv_kernel;
    std::vector<float>& v = conv_taps_[conv1d];
    if (v.empty()) {
      v.resize((size_t)K * C);
      for (int ch = 0; ch < C; ++ch)
        for (int tau = 0; tau < K; ++tau) v[(size_t)tau * C + ch] = conv1d[(size_t)ch * K + tau];
    }
    return v.data();
  }

  // Causal conv + silu over the chunk, in place: mm becomes the conv output.  A
  // token's window is the inputs of its K-1 nearest ancestors (its parent, the
  // parent's parent, ...; in commit mode the previous tokens), oldest first,
  // continued by the committed window where the path runs out.  Per channel:
  // acc = 0, then acc += w[tau] * window[tau] for each tap in order, then the
  // token's own input.  Tokens run last to first, so each reads its ancestors'
  // inputs before they are overwritten (ancestors come first); a verify's
  // inputs are kept in node_upd for commit, a commit's last K-1 become the window.
  void causal_conv(float* mm, const GdnLayer& L) {
    const ChunkPlan& P = *p_;
    const int C = c_.conv_channels(), K = c_.conv_kernel, W = K - 1, n = P.n;
    const float* taps = conv_taps(L.conv1d);
    // src[t * W + tau]: row tau of token t's window; token n's is the committed window after the chunk
    std::vector<const float*> src((size_t)(n + 1) * W);
    for (int t = 0; t < n + (P.commit ? 1 : 0); ++t) {
      int a = t, m = 0;
      for (; m < W; ++m) {  // m = 0: the nearest ancestor, window row W - 1
        a = P.commit ? a - 1 : P.parent[a];
        if (a < 0) break;
        src[(size_t)t * W + (W - 1 - m)] = mm + (size_t)a * C;
      }
      for (int k = m; k < W; ++k) src[(size_t)t * W + (W - 1 - k)] = L.conv + (size_t)(W - 1 - (k - m)) * C;
    }
    pool_.parallel_for(C, 256, [&](int64_t c0, int64_t c1) {
      constexpr int kBlock = 64;
      thread_local std::vector<float> next;  // the commit's new window for these channels
      const int64_t w = c1 - c0;
      if (P.commit) {
        next.resize((size_t)W * w);
        for (int r = 0; r < W; ++r) std::memcpy(next.data() + (size_t)r * w, src[(size_t)n * W + r] + c0, (size_t)w * 4);
      }
      for (int t = n - 1; t >= 0; --t) {
        const float* const* win = src.data() + (size_t)t * W;
        float* x = mm + (size_t)t * C;
        for (int64_t b0 = c0; b0 < c1; b0 += kBlock) {
          const int bn = (int)std::min<int64_t>(kBlock, c1 - b0);
          float acc[kBlock];
          for (int i = 0; i < bn; ++i) acc[i] = 0.f;
          for (int tau = 0; tau < W; ++tau) {
            const float* wt = taps + (size_t)tau * C + b0;
            const float* xs = win[tau] + b0;
            for (int i = 0; i < bn; ++i) acc[i] += wt[i] * xs[i];
          }
          const float* wl = taps + (size_t)W * C + b0;
          for (int i = 0; i < bn; ++i) acc[i] += wl[i] * x[b0 + i];
          silu_rows(acc, nullptr, x + b0, bn);
        }
      }
      if (P.commit)
        for (int r = 0; r < W; ++r) std::memcpy(L.conv + (size_t)r * C + c0, next.data() + (size_t)r * w, (size_t)w * 4);
    });
  }

  void begin_commit(const int32_t* path, int m, int32_t base) override {
    if (m < 1) fail("commit of an empty path");
    commit_path_.assign(path, path + m);
    commit_base_ = base;
  }

  void kv_commit(uint8_t* k_cache, uint8_t* v_cache, size_t kv_row) override {
    if (commit_path_.empty()) fail("kv_commit without begin_commit");
    for (uint8_t* cache : {k_cache, v_cache})
      for (size_t k = 0; k < commit_path_.size(); ++k)
        if (commit_path_[k] != (int32_t)k)
          std::memcpy(cache + (commit_base_ + k) * kv_row, cache + (commit_base_ + (size_t)commit_path_[k]) * kv_row,
                      kv_row);
  }

  void gdn_commit(float* conv, void* rec, DType state_type, const float* node_upd) override {
    if (commit_path_.empty()) fail("gdn_commit without begin_commit");
    const int32_t* path = commit_path_.data();
    const int m = (int)commit_path_.size();
    const int nk = c_.ssm_nk, dk = c_.ssm_dk, dv = c_.ssm_dv, W = c_.conv_kernel - 1, C = c_.conv_channels();
    const size_t hs = (size_t)dk * dv, es = row_bytes(state_type, 1);
    const GdnNodeLayout U(c_);
    // conv window: row r <- entry r + m of (committed rows 0..W-1, then the path's inputs); ascending r
    // reads a kept row (r + m > r) before it is overwritten
    for (int r = 0; r < W; ++r) {
      const int src = r + m;
      const float* from = src < W ? conv + (size_t)src * C : node_upd + (size_t)path[src - W] * U.stride + U.xin;
      std::memmove(conv + (size_t)r * C, from, (size_t)C * 4);
    }
    pool_.parallel_for(c_.ssm_nv, 1, [&](int64_t h0, int64_t h1) {
      std::vector<float> tmp(state_type == DType::F32 ? 0 : hs);
      for (int64_t h = h0; h < h1; ++h) {
        uint8_t* Sh = static_cast<uint8_t*>(rec) + (size_t)h * hs * es;
        float* Sf = reinterpret_cast<float*>(Sh);
        if (!tmp.empty()) {
          dequantize_row(state_type, Sh, tmp.data(), (int64_t)hs);
          Sf = tmp.data();
        }
        for (int p = 0; p < m; ++p) {
          const float* upd = node_upd + (size_t)path[p] * U.stride;
          delta_rule_apply(Sf, upd + U.k + (size_t)(h % nk) * dk, upd + U.delta + (size_t)h * dv, upd[U.decay + h],
                           dk, dv);
          if (!tmp.empty()) {  // rounded after each node, as gdn rounds after each token
            quantize_row(state_type, tmp.data(), Sh, (int64_t)hs);
            dequantize_row(state_type, Sh, tmp.data(), (int64_t)hs);
          }
        }
      }
    });
  }

  // Rows on the pool's threads (each row alone, so the same result): left to the calling thread, several rows
  // after a matmul ran beside workers still spinning on the job ticket, and on a 2-vCPU guest a row cost up
  // to 18x its time alone (4 slots' MTP ranks: 1.5 ms instead of 0.1).
  void row_topk(const float* rows, int n_rows, int n_cols, int k, int32_t* ids, float* logp) override {
    auto part = [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        topk_logprobs(rows + (size_t)r * n_cols, n_cols, k, ids + (size_t)r * k, logp ? logp + (size_t)r * k : nullptr);
    };
    if (n_rows < 2) return part(0, n_rows);
    pool_.parallel_for(n_rows, 1, part);
  }

 private:
  const Qwen35Config& c_;
  ThreadPool& pool_;
  const ChunkPlan* p_ = nullptr;
  std::vector<int32_t> commit_path_;  // begin_commit's
  size_t commit_base_ = 0;
  ActScratch act_;
  std::unordered_map<const float*, std::vector<float>> conv_taps_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(const Model& m, ThreadPool& pool) {
  return std::make_unique<CpuBackend>(m, pool);
}

}  // namespace dfl
