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

#include "model/backend.h"
#include "ops/cpu_ops.h"
#include "quant/quant.h"
#include "spec/ddtree.h"

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
      const size_t slot = (size_t)L.slot0 + t;
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
    // One work item per (token, KV head): each K and V row is widened to f32 once
    // and used by every query head of its group.  Per query head the operations are
    // dot_f and axpy_row on the widened row (widening is exact), in slot order, so
    // the result does not depend on the grouping.
    const int n_kv = a.n_head_kv;
    pool_.parallel_for((int64_t)P.n * n_kv, 1, [&](int64_t w0, int64_t w1) {
      thread_local std::vector<float> sc, row, inv;
      row.resize(hd);
      inv.resize(group);
      for (int64_t wi = w0; wi < w1; ++wi) {
        const int t = (int)(wi / n_kv), m = (int)(wi % n_kv);
        const size_t n_prefix = (size_t)P.n_prefix[t];
        const size_t n_vis = n_prefix + (size_t)P.extra_count[t];
        const int32_t* extra = P.extra_slots.data() + P.extra_begin[t];
        auto slot = [&](size_t s) -> size_t { return s < n_prefix ? s : (size_t)extra[s - n_prefix]; };
        // row s of the cache (K or V) for this KV head, as f32
        auto widened = [&](const uint8_t* cache, size_t s) -> const float* {
          const uint8_t* r = cache + slot(s) * kv_row + m * head_bytes;
          if (kvt == DType::F32) return reinterpret_cast<const float*>(r);
          widen_row(kvt, r, row.data(), hd);
          return row.data();
        };
        const float* q0 = qg + (size_t)t * n_head * qs + (size_t)m * group * qs;
        sc.resize((size_t)group * n_vis);
        for (size_t s = 0; s < n_vis; ++s) {
          const float* k = widened(L.k_cache, s);
          for (int g = 0; g < group; ++g) sc[(size_t)g * n_vis + s] = dot_f(DType::F32, k, q0 + (size_t)g * qs, hd) * scale;
        }
        float* o0 = o + ((size_t)t * n_head + (size_t)m * group) * hd;
        for (int g = 0; g < group; ++g) {
          float* e = sc.data() + (size_t)g * n_vis;
          float mx = -INFINITY;
          for (size_t s = 0; s < n_vis; ++s) mx = std::max(mx, e[s]);
          float sum = 0.f;
          for (size_t s = 0; s < n_vis; ++s) {
            e[s] = std::exp(e[s] - mx);
            sum += e[s];
          }
          inv[g] = 1.f / sum;
          for (int d = 0; d < hd; ++d) o0[(size_t)g * hd + d] = 0.f;
        }
        for (size_t s = 0; s < n_vis; ++s) {
          const float* v = widened(L.v_cache, s);
          for (int g = 0; g < group; ++g) axpy_row(v, sc[(size_t)g * n_vis + s], o0 + (size_t)g * hd, hd);
        }
        for (int g = 0; g < group; ++g) {
          float* ot = o0 + (size_t)g * hd;
          if (a.gated) {
            const float* gate = q0 + (size_t)g * qs + hd;
            for (int d = 0; d < hd; ++d) ot[d] = ot[d] * inv[g] * sigmoid(gate[d]);
          } else {
            for (int d = 0; d < hd; ++d) ot[d] *= inv[g];
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
    // which node states node_rec must hold (GdnLayer::node_rec)
    const std::vector<uint8_t> keep = P.commit ? std::vector<uint8_t>() : node_rec_kept(P.parent.data(), n);
    // the delta rule, per value head through all tokens
    pool_.parallel_for(nv, 1, [&](int64_t h0, int64_t h1) {
      // a reduced state is computed in f32 in `tmp`; f32 tree nodes step in a cached working state
      // (`work`): a node whose parent is the one just stepped reads it instead of memory, and only the
      // states node_rec must hold are streamed out to it (written without being read first).  Both are
      // per-thread buffers kept across calls (allocating them per part cost a verify ~1 ms).
      const bool reduced = L.state_type != DType::F32, use_work = !reduced && !P.commit;
      thread_local std::vector<float> tmp, work;
      if (reduced && tmp.size() < hs) tmp.resize(hs);
      if (use_work && work.size() < hs) work.resize(hs);
      for (int64_t h = h0; h < h1; ++h) {
        const int kh = (int)(h % nk);  // GGUF (tiled) value-head order
        for (int t = 0; t < n; ++t) {
          // this token's head state (of state_type) before and after the step: in commit mode the
          // layer's own, in place; in tree mode the parent's (or the committed one) into the node's
          const size_t hoff = (size_t)h * hs * es;
          uint8_t* dst = P.commit ? static_cast<uint8_t*>(L.rec) + hoff
                                  : static_cast<uint8_t*>(L.node_rec) + (size_t)t * rs * es + hoff;
          const int par = P.commit ? -1 : P.parent[t];
          const uint8_t* src = P.commit || par < 0 ? static_cast<const uint8_t*>(L.rec) + hoff
                                                   : static_cast<const uint8_t*>(L.node_rec) + (size_t)par * rs * es + hoff;
          const float* q = mm + (size_t)t * Cconv;
          const float* k = q + Ck;
          const float* v = q + 2 * Ck;
          float* upd = upd_of(t);
          const float* Sin = reinterpret_cast<const float*>(src);
          float* Sout = reinterpret_cast<float*>(dst);
          if (reduced) {  // a reduced state: computed in f32, rounded back after the token
            dequantize_row(L.state_type, src, tmp.data(), (int64_t)hs);
            Sin = Sout = tmp.data();
          } else if (use_work) {
            if (t > 0 && par == t - 1) Sin = work.data();
            Sout = work.data();
          }
          const float beta = sigmoid(bb[(size_t)t * nv + h]);
          const float g = L.ssm_a[h] * softplus(aa[(size_t)t * nv + h] + L.dt_bias[h]);
          float* oh = y + (size_t)t * Cv + h * dv;
          const float decay = std::exp(g);
          delta_rule_step(Sin, Sout, k + kh * dk, v + h * dv, q + kh * dk, decay, beta, dk, dv, oh,
                          upd ? upd + U.delta + (size_t)h * dv : nullptr);
          if (reduced) quantize_row(L.state_type, tmp.data(), dst, (int64_t)hs);
          else if (use_work && keep[t]) stream_copy(reinterpret_cast<float*>(dst), work.data(), hs);
          if (upd) upd[U.decay + h] = decay;
          rmsnorm_rows(oh, L.ssm_norm, 1, dv, c_.rms_eps, oh);
          const float* zt = z + (size_t)t * Cv + h * dv;
          silu_rows(zt, oh, oh, dv);  // oh[j] * silu(z[j])
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

  void gdn_commit(float* conv, void* rec, DType state_type, const float* node_upd, const int32_t* path,
                  int m) override {
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

  void row_topk(const float* rows, int n_rows, int n_cols, int k, int32_t* ids, float* logp) override {
    for (int r = 0; r < n_rows; ++r)
      topk_logprobs(rows + (size_t)r * n_cols, n_cols, k, ids + (size_t)r * k, logp + (size_t)r * k);
  }

 private:
  const Qwen35Config& c_;
  ThreadPool& pool_;
  const ChunkPlan* p_ = nullptr;
  ActScratch act_;
  std::unordered_map<const float*, std::vector<float>> conv_taps_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(const Model& m, ThreadPool& pool) {
  return std::make_unique<CpuBackend>(m, pool);
}

}  // namespace dfl
