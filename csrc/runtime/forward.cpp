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

#include "backend/backend.h"
#include "runtime/context.h"
#include "quant/quant.h"

namespace dfl {

struct Context::Impl {
  // shared by the contexts of one set of slots (Context(model, params, share)): one upload of the weights,
  // one thread pool, and forward_many runs their batches through the same backend
  std::shared_ptr<ThreadPool> pool;
  std::shared_ptr<Backend> be;
  size_t kv_row = 0;                  // bytes of one K (or V) row of kv_dim values
  size_t conv_floats = 0, rec_floats = 0;
  size_t rec_bytes = 0;               // one layer's recurrent state in the state type
  std::vector<BackendBuf> k, v;       // per layer (empty for delta-net layers)
  std::vector<BackendBuf> conv, rec;  // per layer committed state (empty for attention)
  // verify: every node's window and state (scratch, one layer at a time) and, per layer, every node's
  // update (GdnNodeLayout): all commit_path needs to rebuild the accepted node's state
  BackendBuf node_conv, node_rec;
  std::vector<BackendBuf> node_upd;
  int node_cap = 0;
  std::vector<int32_t> node_parent;   // parents of the last verified batch
  ChunkPlan plan;
  AttnShape attn;                     // the target's gated attention
  // scratch, sized for n_batch tokens
  BackendBuf x, hn, out, a0, a1, a2, a3, a4;
  BackendBuf logits;  // [kLogitGroup][n_vocab], allocated on first use
  BackendBuf top;     // top-k ids then log-probs of a logits group
  BackendBuf captured;  // [n_batch][n_capture][n_embd] when features stay on the backend
  BackendBuf mtp_k, mtp_v;  // the MTP head's KV [n_ctx] rows, allocated on first use
  ChunkPlan mtp_plan;
  ChunkPlan many_plan;  // forward_many's rows of every segment, for the row-wise ops

  Impl() = default;
};

constexpr int kLogitGroup = 32;

static int default_threads() {
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : (int)n;
}

static size_t widest_row(const Qwen35Config& c) {
  return std::max({(size_t)2 * c.q_dim(), (size_t)c.conv_channels(), (size_t)c.n_ff, (size_t)c.n_embd,
                   (size_t)c.ssm_inner()});
}

static void check_state_type(DType t) {
  if (t != DType::F32 && t != DType::BF16 && t != DType::F16)
    fail("unsupported recurrent state type %s (f32, bf16 or f16)",
         type_traits((uint32_t)t) ? type_traits((uint32_t)t)->name : "?");
}

MemoryPlan memory_plan(const Model& m, const ContextParams& p, int max_nodes) {
  const Qwen35Config& c = m.cfg;
  check_state_type(p.state_type);
  MemoryPlan mp;
  // the matrices' bytes as stored, then the f32 vectors the loader made
  mp.weights = m.weight_bytes;
  m.for_each_tensor([](const Weight&) {}, [&](const std::vector<float>& v) { mp.weights += v.size() * 4; });
  const size_t kv_row = row_bytes(p.kv_type, c.kv_dim());
  const size_t conv = (size_t)(c.conv_kernel - 1) * c.conv_channels() * 4,
               rec = (size_t)c.ssm_nv * c.ssm_dk * c.ssm_dv * row_bytes(p.state_type, 1);  // bytes
  for (int l = 0; l < c.n_layer; ++l) {
    if (c.is_recurrent[l]) {
      mp.recurrent += conv + rec;
      mp.tree_state += (uint64_t)max_nodes * GdnNodeLayout(c).stride * 4;
    } else {
      mp.kv += 2 * (uint64_t)p.n_ctx * kv_row;
    }
  }
  if (m.mtp.present()) {  // the MTP head: its tensors (uploaded with the trunk) and its one layer's KV
    mp.weights += m.mtp_bytes;
    mp.kv += 2 * (uint64_t)p.n_ctx * kv_row;
  }
  if (c.n_layer > 0) mp.tree_state += (uint64_t)max_nodes * (conv + rec);  // one layer's node states
  const size_t nb = (size_t)p.n_batch, widest = widest_row(c);
  mp.workspace = (3 * nb * c.n_embd + 3 * nb * widest + 2 * nb * std::max(c.ssm_nv, 1)) * 4 +
                 (size_t)std::min(kLogitGroup, p.n_batch) * c.n_vocab * 4 +
                 (p.device == Device::CUDA ? ((size_t)64 << 20)  // attention split partials
                                               + exact_act_bytes((int64_t)widest, (int)nb)  // exact matmul
                                           : 0);
  return mp;
}

Context::Context(const Model& model, const ContextParams& p, Context* share) : model_(model), params_(p) {
  const Qwen35Config& c = model.cfg;
  if (p.n_ctx <= 0) fail("context length must be positive (got %d)", p.n_ctx);
  if (p.n_batch <= 0) fail("batch size must be positive (got %d)", p.n_batch);
  if (p.kv_type != DType::F32 && p.kv_type != DType::F16 && p.kv_type != DType::Q8_0 &&
      p.kv_type != DType::Q4_0 && p.kv_type != DType::BF16)
    fail("unsupported KV cache type %s", type_traits((uint32_t)p.kv_type) ? type_traits((uint32_t)p.kv_type)->name : "?");
  check_state_type(p.state_type);
  impl_ = std::make_unique<Impl>();
  Impl& I = *impl_;
  if (share) {
    if (&share->model_ != &model) fail("a context shares the backend of a context of the same model only");
    if (share->params_.device != p.device) fail("a context shares the backend of a context on the same device only");
    // (on CUDA: one stream, so each segment's plan upload lands after the kernels that read the one before)
    I.pool = share->impl_->pool;
    I.be = share->impl_->be;
  } else if (p.device == Device::CUDA) {
    I.pool = std::make_shared<ThreadPool>(p.n_threads > 0 ? p.n_threads : default_threads());
    I.be = make_cuda_backend(model, memory_plan(model, p, kPlanVerifyNodes));
  } else {
    I.pool = std::make_shared<ThreadPool>(p.n_threads > 0 ? p.n_threads : default_threads());
    I.be = make_cpu_backend(model, *I.pool);
  }
  Backend& be = *I.be;
  I.attn = AttnShape{c.n_head, c.n_head_kv, c.head_dim, c.rope(), c.rms_eps, true, p.kv_type};
  I.kv_row = row_bytes(p.kv_type, c.kv_dim());
  I.conv_floats = (size_t)(c.conv_kernel - 1) * c.conv_channels();
  I.rec_floats = (size_t)c.ssm_nv * c.ssm_dk * c.ssm_dv;
  I.rec_bytes = I.rec_floats * row_bytes(p.state_type, 1);
  I.k.resize(c.n_layer);
  I.v.resize(c.n_layer);
  I.conv.resize(c.n_layer);
  I.rec.resize(c.n_layer);
  I.node_upd.resize(c.n_layer);
  for (int l = 0; l < c.n_layer; ++l) {
    if (c.is_recurrent[l]) {
      I.conv[l] = BackendBuf(be, I.conv_floats * 4);
      I.rec[l] = BackendBuf(be, I.rec_bytes);
    } else {
      I.k[l] = BackendBuf(be, (size_t)p.n_ctx * I.kv_row);
      I.v[l] = BackendBuf(be, (size_t)p.n_ctx * I.kv_row);
    }
  }
  const size_t nb = (size_t)p.n_batch, widest = widest_row(c);
  I.x = BackendBuf(be, nb * c.n_embd * 4);
  I.hn = BackendBuf(be, nb * c.n_embd * 4);
  I.out = BackendBuf(be, nb * c.n_embd * 4);
  I.a0 = BackendBuf(be, nb * widest * 4);
  I.a1 = BackendBuf(be, nb * widest * 4);
  I.a2 = BackendBuf(be, nb * widest * 4);
  I.a3 = BackendBuf(be, nb * std::max(c.ssm_nv, 1) * 4);
  I.a4 = BackendBuf(be, nb * std::max(c.ssm_nv, 1) * 4);
}

Context::~Context() = default;

Device Context::device() const { return impl_->be->device(); }
std::string Context::backend_name() const { return impl_->be->name(); }

void Context::reset() {
  n_past_ = 0;
  n_verify_ = 0;
  for (auto& s : impl_->conv) if (s.p) impl_->be->fill_zero(s.p, s.bytes);
  for (auto& s : impl_->rec) if (s.p) impl_->be->fill_zero(s.p, s.bytes);
}

size_t Context::state_bytes() const {
  size_t b = 0;
  for (auto* v : {&impl_->k, &impl_->v, &impl_->conv, &impl_->rec})
    for (auto& s : *v) b += s.bytes;
  return b;
}

ThreadPool& Context::pool() { return *impl_->pool; }
Backend& Context::backend() { return *impl_->be; }
const Backend& Context::backend() const { return *impl_->be; }
const float* Context::captured() const { return impl_->captured.f(); }

size_t Context::committed_state_size() const {
  const Impl& I = *impl_;
  size_t b = 0;
  for (int l = 0; l < model_.cfg.n_layer; ++l)
    b += model_.cfg.is_recurrent[l] ? I.conv_floats * 4 + I.rec_bytes : 2 * (size_t)n_past_ * I.kv_row;
  return b;
}

void Context::copy_committed_state(uint8_t* dst) const {
  const Impl& I = *impl_;
  for (int l = 0; l < model_.cfg.n_layer; ++l) {
    if (model_.cfg.is_recurrent[l]) {
      I.be->download(dst, I.conv[l].p, I.conv_floats * 4);
      dst += I.conv_floats * 4;
      I.be->download(dst, I.rec[l].p, I.rec_bytes);
      dst += I.rec_bytes;
    } else {
      const size_t n = (size_t)n_past_ * I.kv_row;
      if (n) {
        I.be->download(dst, I.k[l].p, n);
        I.be->download(dst + n, I.v[l].p, n);
      }
      dst += 2 * n;
    }
  }
}

size_t Context::kv_bytes_per_position() const {
  size_t b = 0;
  for (int l = 0; l < model_.cfg.n_layer; ++l)
    if (!model_.cfg.is_recurrent[l]) b += 2 * impl_->kv_row;
  return b;
}

static void check_kv_range(int p0, int p1, int n_ctx) {
  if (p0 < 0 || p1 < p0 || p1 > n_ctx) fail("KV positions [%d, %d) outside the context [0, %d)", p0, p1, n_ctx);
}

void Context::get_kv(int p0, int p1, uint8_t* dst) const {
  check_kv_range(p0, p1, params_.n_ctx);
  const Impl& I = *impl_;
  const size_t n = (size_t)(p1 - p0) * I.kv_row;
  for (int l = 0; l < model_.cfg.n_layer; ++l) {
    if (model_.cfg.is_recurrent[l] || !n) continue;
    I.be->download(dst, I.k[l].u8() + (size_t)p0 * I.kv_row, n);
    I.be->download(dst + n, I.v[l].u8() + (size_t)p0 * I.kv_row, n);
    dst += 2 * n;
  }
}

void Context::set_kv(int p0, int p1, const uint8_t* src) {
  check_kv_range(p0, p1, params_.n_ctx);
  Impl& I = *impl_;
  const size_t n = (size_t)(p1 - p0) * I.kv_row;
  for (int l = 0; l < model_.cfg.n_layer; ++l) {
    if (model_.cfg.is_recurrent[l] || !n) continue;
    I.be->upload(I.k[l].u8() + (size_t)p0 * I.kv_row, src, n);
    I.be->upload(I.v[l].u8() + (size_t)p0 * I.kv_row, src + n, n);
    src += 2 * n;
  }
  n_verify_ = 0;
}

std::vector<std::pair<void*, size_t>> Context::gdn_state_parts() const {
  std::vector<std::pair<void*, size_t>> parts;
  for (int l = 0; l < model_.cfg.n_layer; ++l) {
    if (!model_.cfg.is_recurrent[l]) continue;
    parts.push_back({impl_->conv[l].p, impl_->conv_floats * 4});
    parts.push_back({impl_->rec[l].p, impl_->rec_bytes});
  }
  return parts;
}

size_t Context::recurrent_bytes() const {
  size_t b = 0;
  for (auto& p : gdn_state_parts()) b += p.second;
  return b;
}

void Context::get_recurrent(uint8_t* dst) const {
  for (auto& p : gdn_state_parts()) impl_->be->download(dst, p.first, p.second), dst += p.second;
}

void Context::set_recurrent(const uint8_t* src) {
  for (auto& p : gdn_state_parts()) impl_->be->upload(p.first, src, p.second), src += p.second;
  n_verify_ = 0;
}

BackendBuf Context::new_recurrent_snapshot() { return BackendBuf(*impl_->be, std::max<size_t>(recurrent_bytes(), 16)); }

void Context::save_recurrent(BackendBuf& dst) const {
  uint8_t* d = dst.u8();
  for (auto& p : gdn_state_parts()) impl_->be->copy(d, p.first, p.second), d += p.second;
}

void Context::restore_recurrent(const BackendBuf& src) {
  const uint8_t* s = src.u8();
  for (auto& p : gdn_state_parts()) impl_->be->copy(p.first, s, p.second), s += p.second;
  n_verify_ = 0;
}

void Context::set_n_past(int n) {
  if (n < 0 || n > params_.n_ctx) fail("n_past %d outside the context [0, %d]", n, params_.n_ctx);
  n_past_ = n;
  n_verify_ = 0;
}

void Context::check_forward(const Batch& b, const ForwardOutputs& out, bool commit) {
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
  if (out.topk < 0 || out.topk > c.n_vocab) fail("top-k of %d over a vocabulary of %d", out.topk, c.n_vocab);
  if (out.hidden_on_backend && out.n_capture > 0) {
    if (b.n > params_.n_batch) fail("features kept on the backend need a batch of at most %d tokens", params_.n_batch);
    const size_t need = (size_t)params_.n_batch * out.n_capture * c.n_embd * 4;
    if (impl_->captured.bytes < need) impl_->captured = BackendBuf(*impl_->be, need);
  }
  for (int i = 0; i < out.n_capture; ++i)
    if (out.capture_layers[i] < 0 || out.capture_layers[i] >= c.n_layer)
      fail("capture layer %d outside 0..%d", out.capture_layers[i], c.n_layer - 1);
  if (!commit && b.n > params_.n_batch) fail("a verify batch of %d nodes exceeds the batch size %d", b.n, params_.n_batch);
}

void Context::prepare_verify(const Batch& b) {
  const Qwen35Config& c = model_.cfg;
  Impl& I = *impl_;
  if (I.node_cap < b.n) {
    const size_t stride = GdnNodeLayout(c).stride;
    I.node_conv = BackendBuf(*I.be, (size_t)b.n * I.conv_floats * 4);
    I.node_rec = BackendBuf(*I.be, (size_t)b.n * I.rec_bytes);
    for (int l = 0; l < c.n_layer; ++l)
      if (c.is_recurrent[l]) I.node_upd[l] = BackendBuf(*I.be, (size_t)b.n * stride * 4);
    I.node_cap = b.n;
  }
  I.node_parent.assign(b.n, 0);
  for (int i = 0; i < b.n; ++i) I.node_parent[i] = b.parent ? b.parent[i] : i - 1;
}

void Context::forward(const Batch& b, const ForwardOutputs& out, bool commit) {
  check_forward(b, out, commit);
  ++n_forwards_;
  if (commit) {
    n_verify_ = 0;
    for (int off = 0; off < b.n; off += params_.n_batch) {
      int n = std::min(params_.n_batch, b.n - off);
      Segment seg{this, &b, off, n, &out, true, 0};
      run_segments(&seg, 1);
      n_past_ += n;
    }
  } else {
    prepare_verify(b);
    Segment seg{this, &b, 0, b.n, &out, false, 0};
    run_segments(&seg, 1);
    n_verify_ = b.n;
  }
}

void Context::forward_many(Context* const* cs, const Batch* bs, const ForwardOutputs* outs, const bool* commit,
                           int n) {
  if (n <= 0) return;
  Context& lead = *cs[0];
  std::vector<Segment> segs((size_t)n);
  int total = 0;
  for (int k = 0; k < n; ++k) {
    Context& c = *cs[k];
    if (c.impl_->be != lead.impl_->be) fail("forward_many: context %d does not share the first one's backend", k);
    for (int j = 0; j < k; ++j)
      if (cs[j] == cs[k]) fail("forward_many: context %d appears twice", k);
    c.check_forward(bs[k], outs[k], commit[k]);
    segs[(size_t)k] = Segment{&c, &bs[k], 0, bs[k].n, &outs[k], commit[k], total};
    total += bs[k].n;
  }
  if (total > lead.params_.n_batch)
    fail("forward_many: %d tokens in all exceed the batch size %d", total, lead.params_.n_batch);
  for (int k = 0; k < n; ++k) {
    Context& c = *cs[k];
    ++c.n_forwards_;
    if (commit[k]) c.n_verify_ = 0;
    else c.prepare_verify(bs[k]);
  }
  lead.run_segments(segs.data(), n);
  for (int k = 0; k < n; ++k) {
    if (commit[k]) cs[k]->n_past_ += bs[k].n;
    else cs[k]->n_verify_ = bs[k].n;
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
  // Attention layers: the path's K/V rows move down to consecutive slots (a path visits nodes in
  // increasing order with nodes[k] >= k).  Delta-net layers: the conv window and the recurrent state
  // rebuilt from the path's updates (bit-identical to the verify's own states for the path's last node).
  I.be->begin_commit(nodes, n, n_past_);
  for (int l = 0; l < c.n_layer; ++l) {
    if (c.is_recurrent[l])
      I.be->gdn_commit(I.conv[l].f(), I.rec[l].p, params_.state_type, I.node_upd[l].f());
    else
      I.be->kv_commit(I.k[l].u8(), I.v[l].u8(), I.kv_row);
  }
  I.be->submit();
  n_past_ += n;
  n_verify_ = 0;
}

// ---- one chunk through every layer ------------------------------------

// What the backend needs to know about rows [off, off + n) of the batch: ids,
// positions, each token's visible KV slots and each token's starting state.
static void plan_chunk(const Batch& b, int off, int n, bool commit, int n_past, const std::vector<int32_t>& node_parent,
                       ChunkPlan& P) {
  P.n = n;
  P.commit = commit;
  P.tokens.assign(b.tokens + off, b.tokens + off + n);
  P.pos.assign(b.pos + off, b.pos + off + n);
  P.n_prefix.resize(n);
  P.extra_begin.resize(n);
  P.extra_count.resize(n);
  P.parent.resize(n);
  P.extra_slots.clear();
  P.max_visible = 0;
  P.kv_slot0 = n_past + (commit ? 0 : off);  // committing chunks advance n_past as they go
  for (int t = 0; t < n; ++t) {
    P.extra_begin[t] = (int32_t)P.extra_slots.size();
    if (commit) {
      P.n_prefix[t] = n_past + t + 1;  // the chunk's slots start at n_past (chunks commit as they go)
      P.extra_count[t] = 0;
      P.parent[t] = t - 1;
    } else {
      P.n_prefix[t] = n_past;
      const size_t first = P.extra_slots.size();
      for (int a = off + t; a >= 0; a = node_parent[a]) P.extra_slots.push_back(n_past + a);
      std::reverse(P.extra_slots.begin() + first, P.extra_slots.end());  // ascending slots
      P.extra_count[t] = (int32_t)(P.extra_slots.size() - first);
      P.parent[t] = node_parent[off + t];
    }
    P.max_visible = std::max(P.max_visible, P.n_prefix[t] + P.extra_count[t]);
  }
}

void Context::run_segments(const Segment* segs, int n_segs) {
  // this context is the lead: its scratch holds every segment's rows, [row0, row0 + n) each
  Impl& I = *impl_;
  Backend& be = *I.be;
  const Model& M = model_;
  const Qwen35Config& c = M.cfg;
  const int H = c.n_embd;
  int n = 0;
  for (int k = 0; k < n_segs; ++k) {
    const Segment& g = segs[k];
    Impl& J = *g.ctx->impl_;
    plan_chunk(*g.b, g.off, g.n, g.commit, g.ctx->n_past_, J.node_parent, J.plan);
    n += g.n;
  }
  // Row-wise ops (embedding, norms, matmuls, SwiGLU) run over all segments' rows at once — each row's
  // arithmetic is the same whatever else is in the batch; attention and the delta-net run per segment, on
  // its own context's KV and state, with its own plan.
  const ChunkPlan* all = &segs[0].ctx->impl_->plan;
  if (n_segs > 1) {
    ChunkPlan& P = I.many_plan;
    P = ChunkPlan{};
    P.n = n;
    for (int k = 0; k < n_segs; ++k) {
      const ChunkPlan& q = segs[k].ctx->impl_->plan;
      P.tokens.insert(P.tokens.end(), q.tokens.begin(), q.tokens.end());
      P.pos.insert(P.pos.end(), q.pos.begin(), q.pos.end());
    }
    all = &P;
  }
  be.begin_chunk(*all);
  float* x = I.x.f();
  be.embed(M.tok_embd, x);

  std::vector<AttnRows> parts((size_t)n_segs);  // each attention layer's: the segments' rows and caches
  for (int l = 0; l < c.n_layer; ++l) {
    const LayerWeights& w = M.layers[l];
    be.rmsnorm(x, be.vec(w.attn_norm), n, H, c.rms_eps, I.hn.f());
    if (!c.is_recurrent[l]) {
      for (int k = 0; k < n_segs; ++k) {
        Impl& J = *segs[k].ctx->impl_;
        parts[(size_t)k] = AttnRows{&J.plan, J.k[l].u8(), J.v[l].u8(), segs[k].row0};
      }
      attention_sublayer(w, parts.data(), n_segs, n, *all);
    } else {
      // ---- gated delta-net ----
      float* mm = I.a0.f();
      float* z = I.a1.f();
      float* y = I.a2.f();
      float* bb = I.a3.f();
      float* aa = I.a4.f();
      be.matmul(w.wqkv, I.hn.f(), n, mm);
      be.matmul(w.wgate, I.hn.f(), n, z);
      be.matmul(w.wbeta, I.hn.f(), n, bb);
      be.matmul(w.walpha, I.hn.f(), n, aa);
      const size_t qkv = (size_t)c.conv_channels(), vd = (size_t)c.ssm_inner(), nv = (size_t)c.ssm_nv;
      for (int k = 0; k < n_segs; ++k) {
        const Segment& g = segs[k];
        Impl& J = *g.ctx->impl_;
        const size_t r0 = (size_t)g.row0;
        const GdnLayer L{be.vec(w.conv1d), be.vec(w.dt_bias), be.vec(w.ssm_a), be.vec(w.ssm_norm), J.conv[l].f(),
                         J.rec[l].p, g.commit ? nullptr : J.node_conv.f(), g.commit ? nullptr : J.node_rec.p,
                         g.commit ? nullptr : J.node_upd[l].f(), g.ctx->params_.state_type};
        if (n_segs > 1) be.begin_chunk(J.plan);
        be.gdn(mm + r0 * qkv, z + r0 * vd, bb + r0 * nv, aa + r0 * nv, L, y + r0 * vd);
      }
      if (n_segs > 1) be.begin_chunk(*all);
      be.matmul(w.ssm_out, y, n, I.out.f());
    }
    mlp_sublayer(w, x, I.out.f(), n);

    for (int k = 0; k < n_segs; ++k) {
      const Segment& g = segs[k];
      const ForwardOutputs& out = *g.out;
      for (int ci = 0; ci < out.n_capture; ++ci)
        if (out.capture_layers[ci] == l) {  // one strided transfer: row t goes to hidden[off + t][ci]
          const size_t pitch = (size_t)out.n_capture * H * 4;
          const float* src = x + (size_t)g.row0 * H;
          if (out.hidden_on_backend)
            be.copy_rows(g.ctx->impl_->captured.f() + ((size_t)g.off * out.n_capture + ci) * H, pitch, src,
                         (size_t)H * 4, (size_t)H * 4, (size_t)g.n);
          else
            be.download_rows(out.hidden + ((size_t)g.off * out.n_capture + ci) * H, pitch, src, (size_t)H * 4,
                             (size_t)H * 4, (size_t)g.n);
        }
    }
  }

  // ---- logits for the requested rows ----
  // Up to kLogitGroup rows at a time, across segments, go through one lm_head matmul (the head is the largest
  // weight: reading it once per row would dominate a verify step).
  struct Want { const Segment* g; int r; };  // output row r of segment g
  std::vector<Want> rs;
  for (int k = 0; k < n_segs; ++k) {
    const Segment& g = segs[k];
    for (int r = 0; r < g.out->n_logits; ++r)
      if (g.out->logit_rows[r] >= g.off && g.out->logit_rows[r] < g.off + g.n) rs.push_back(Want{&g, r});
  }
  const int group = std::min(kLogitGroup, params_.n_batch);
  if (!rs.empty() && !I.logits.p)
    I.logits = BackendBuf(be, (size_t)group * c.n_vocab * 4);
  for (size_t g0 = 0; g0 < rs.size(); g0 += group) {
    const int k = (int)std::min(rs.size() - g0, (size_t)group);
    float* h = I.hn.f();
    int topk = 0;
    bool want_logp = false;  // none: the ids alone (greedy without logprobs skips the log-sum-exp)
    for (int j = 0; j < k; ++j) {
      const Want& q = rs[g0 + j];
      const int row = q.g->row0 + q.g->out->logit_rows[q.r] - q.g->off;
      be.copy(h + (size_t)j * H, x + (size_t)row * H, (size_t)H * 4);
      topk = std::max(topk, q.g->out->topk);
      want_logp |= q.g->out->topk > 0 && q.g->out->top_logp;
    }
    be.rmsnorm(h, be.vec(M.output_norm), k, H, c.rms_eps, h);
    be.matmul(M.output, h, k, I.logits.f());
    if (topk > 0) {
      const size_t kk = (size_t)topk;
      if (I.top.bytes < (size_t)group * kk * 8) I.top = BackendBuf(be, (size_t)group * kk * 8);
      int32_t* ids = reinterpret_cast<int32_t*>(I.top.u8());
      float* lp = reinterpret_cast<float*>(I.top.u8() + (size_t)group * kk * 4);
      be.row_topk(I.logits.f(), k, c.n_vocab, topk, ids, want_logp ? lp : nullptr);
      // ids then log-probs of the group lie together: one transfer (the ids alone when none was asked)
      std::vector<uint8_t> both((size_t)group * kk * 8);
      be.download(both.data(), I.top.p, want_logp ? both.size() : (size_t)group * kk * 4);
      for (int j = 0; j < k; ++j) {
        const Want& q = rs[g0 + j];
        const size_t want = (size_t)q.g->out->topk;  // a row's top-k of a longer list: its first entries
        if (!want) continue;
        std::memcpy(q.g->out->top_ids + (size_t)q.r * want, both.data() + j * kk * 4, want * 4);
        if (q.g->out->top_logp)
          std::memcpy(q.g->out->top_logp + (size_t)q.r * want, both.data() + ((size_t)group + j) * kk * 4, want * 4);
      }
    }
    for (int j = 0; j < k;) {  // one download per run of consecutive output rows of one segment
      const Want& q = rs[g0 + j];
      if (!q.g->out->logits) {
        ++j;
        continue;
      }
      int e = j + 1;
      while (e < k && rs[g0 + e].g == q.g && rs[g0 + e].r == rs[g0 + e - 1].r + 1) ++e;
      be.download(q.g->out->logits + (size_t)q.r * c.n_vocab, I.logits.f() + (size_t)j * c.n_vocab,
                  (size_t)(e - j) * c.n_vocab * 4);
      j = e;
    }
  }
}

void Context::attention_sublayer(const LayerWeights& w, const AttnRows* parts, int n_parts, int n,
                                 const ChunkPlan& all) {
  Impl& I = *impl_;
  Backend& be = *I.be;
  const Qwen35Config& c = model_.cfg;
  float* qg = I.a0.f();
  float* kk = I.a1.f();
  float* vv = I.a2.f();
  be.matmul(w.wq, I.hn.f(), n, qg);
  be.matmul(w.wk, I.hn.f(), n, kk);
  be.matmul(w.wv, I.hn.f(), n, vv);
  const size_t qs = (size_t)I.attn.q_stride() * I.attn.n_head, kvd = (size_t)c.kv_dim(),
               od = (size_t)I.attn.n_head * I.attn.head_dim;
  // every part's K/V into its cache first: the attention output below reuses kk's scratch
  for (int p = 0; p < n_parts; ++p) {
    const AttnRows& a = parts[p];
    const AttnLayer L{I.attn, a.k, a.v, be.vec(w.q_norm), be.vec(w.k_norm)};
    if (n_parts > 1) be.begin_chunk(*a.plan);
    be.attn_store(qg + (size_t)a.row0 * qs, kk + (size_t)a.row0 * kvd, vv + (size_t)a.row0 * kvd, L);
  }
  float* o = I.a1.f();  // k/v are in the caches now: reuse for the attention output
  for (int p = 0; p < n_parts; ++p) {
    const AttnRows& a = parts[p];
    const AttnLayer L{I.attn, a.k, a.v, be.vec(w.q_norm), be.vec(w.k_norm)};
    if (n_parts > 1) be.begin_chunk(*a.plan);
    be.attention(qg + (size_t)a.row0 * qs, L, o + (size_t)a.row0 * od);
  }
  if (n_parts > 1) be.begin_chunk(all);
  be.matmul(w.wo, o, n, I.out.f());
}

void Context::mlp_sublayer(const LayerWeights& w, float* x, const float* residual, int n) {
  Impl& I = *impl_;
  Backend& be = *I.be;
  const Qwen35Config& c = model_.cfg;
  be.add_rmsnorm(x, residual, be.vec(w.post_norm), n, c.n_embd, c.rms_eps, I.hn.f());
  float* g = I.a0.f();
  float* u = I.a1.f();
  be.matmul(w.ffn_gate, I.hn.f(), n, g);
  be.matmul(w.ffn_up, I.hn.f(), n, u);
  be.swiglu(g, u, (size_t)n * c.n_ff);
  be.matmul(w.ffn_down, g, n, I.out.f());
  be.add(x, I.out.f(), (size_t)n * c.n_embd);
}

void Context::mtp_forward(const int32_t* tokens, int n, int32_t pos0, const float* hidden, bool post_norm, int k,
                          int32_t* ids, float* logp, float* head_out, float* logits) {
  Context* self = this;
  const MtpRows rows{tokens, n, pos0, hidden, ids, logp, head_out, logits};
  mtp_forward_many(&self, &rows, 1, post_norm, k);
}

void Context::mtp_forward_many(Context* const* cs, const MtpRows* rs, int n_parts, bool post_norm, int k) {
  if (n_parts <= 0) return;
  Context& lead = *cs[0];
  Impl& I = *lead.impl_;
  Backend& be = *I.be;
  const Model& M = lead.model_;
  const Qwen35Config& c = M.cfg;
  const MtpWeights& W = M.mtp;
  const int H = c.n_embd;
  if (!W.present()) fail("the model has no MTP head (qwen35.nextn_predict_layers is 0 or its tensors are missing)");
  if (widest_row(c) < (size_t)2 * H) fail("MTP head: scratch rows narrower than 2 x n_embd");
  int n = 0;
  for (int p = 0; p < n_parts; ++p) {
    Context& x = *cs[p];
    const MtpRows& r = rs[p];
    if (x.impl_->be != I.be) fail("MTP forward: context %d does not share the first one's backend", p);
    if (&x.model_ != &M) fail("MTP forward: context %d decodes another model", p);
    for (int q = 0; q < p; ++q)
      if (cs[q] == cs[p]) fail("MTP forward: context %d appears twice", p);
    if (r.n <= 0 || r.n > x.params_.n_batch) fail("MTP batch of %d rows (1..%d)", r.n, x.params_.n_batch);
    if (r.pos0 < 0 || r.pos0 + r.n > x.params_.n_ctx)
      fail("MTP rows at %d..%d outside the context (%d)", r.pos0, r.pos0 + r.n - 1, x.params_.n_ctx);
    if (k > 0 && (!r.ids || !r.logp)) fail("MTP forward: top-%d asked without ids / logp", k);
    n += r.n;
  }
  if (n > lead.params_.n_batch) fail("MTP forward: %d rows in all exceed the batch size %d", n, lead.params_.n_batch);
  // each part a chain from its own slot pos0 on its context's head KV; the row-wise work over every part's rows
  std::vector<AttnRows> parts((size_t)n_parts);
  ChunkPlan* all = nullptr;
  for (int p = 0, row0 = 0; p < n_parts; row0 += rs[p].n, ++p) {
    Impl& J = *cs[p]->impl_;
    if (!J.mtp_k.p) {
      J.mtp_k = BackendBuf(be, (size_t)cs[p]->params_.n_ctx * J.kv_row);
      J.mtp_v = BackendBuf(be, (size_t)cs[p]->params_.n_ctx * J.kv_row);
    }
    std::vector<int32_t> pos((size_t)rs[p].n);
    for (int t = 0; t < rs[p].n; ++t) pos[(size_t)t] = rs[p].pos0 + t;
    const Batch b{rs[p].n, rs[p].tokens, pos.data(), nullptr};
    plan_chunk(b, 0, rs[p].n, /*commit=*/true, rs[p].pos0, J.node_parent, J.mtp_plan);
    parts[(size_t)p] = AttnRows{&J.mtp_plan, J.mtp_k.u8(), J.mtp_v.u8(), row0};
  }
  if (n_parts == 1) {
    all = &I.mtp_plan;
  } else {
    all = &I.many_plan;
    *all = ChunkPlan{};
    all->n = n;
    for (int p = 0; p < n_parts; ++p) {
      const ChunkPlan& q = cs[p]->impl_->mtp_plan;
      all->tokens.insert(all->tokens.end(), q.tokens.begin(), q.tokens.end());
      all->pos.insert(all->pos.end(), q.pos.begin(), q.pos.end());
    }
  }
  be.begin_chunk(*all);
  // x = eh_proj . [enorm(embed(token)) | hnorm(h)]
  float* x = I.x.f();
  float* cat = I.a2.f();
  const size_t row = (size_t)H * 4;
  be.embed(M.tok_embd, x);
  be.rmsnorm(x, be.vec(W.enorm), n, H, c.rms_eps, I.hn.f());
  be.copy_rows(cat, 2 * row, I.hn.f(), row, row, (size_t)n);
  float* h = I.out.f();  // every part's hidden rows, one after another
  for (int p = 0; p < n_parts; ++p) be.copy(h + (size_t)parts[(size_t)p].row0 * H, rs[p].hidden, rs[p].n * row);
  if (!post_norm)  // the trunk's hidden as its head sees it: after output_norm
    be.rmsnorm(h, be.vec(M.output_norm), n, H, c.rms_eps, h);
  be.rmsnorm(h, be.vec(W.hnorm), n, H, c.rms_eps, I.hn.f());
  be.copy_rows(cat + H, 2 * row, I.hn.f(), row, row, (size_t)n);
  be.matmul(W.eh_proj, cat, n, x);
  // one full-attention decoder layer, the trunk's arithmetic, each part on its own head KV
  const LayerWeights& w = W.layer;
  be.rmsnorm(x, be.vec(w.attn_norm), n, H, c.rms_eps, I.hn.f());
  bool wanted = k > 0;
  for (int p = 0; p < n_parts; ++p) wanted = wanted || rs[p].head_out || rs[p].logits;
  if (!wanted) {
    // a catch-up: its rows' slots are all a later draft reads, and a slot's K/V come from the layer's input
    // alone: no Q, attention or MLP (on the bundled pair a probe after ~30 AR steps, which catches those rows
    // up, drafted 4.2 ms through the whole layer, 0.5-0.8 ms through K/V alone)
    float* kk = I.a1.f();
    float* vv = I.a2.f();
    be.matmul(w.wk, I.hn.f(), n, kk);
    be.matmul(w.wv, I.hn.f(), n, vv);
    const size_t kvd = (size_t)c.kv_dim();
    AttnShape kv_only = I.attn;
    kv_only.n_head = 0;  // (attn_store: K/V only)
    for (int p = 0; p < n_parts; ++p) {
      const AttnRows& a = parts[(size_t)p];
      if (n_parts > 1) be.begin_chunk(*a.plan);
      be.attn_store(nullptr, kk + (size_t)a.row0 * kvd, vv + (size_t)a.row0 * kvd,
                    AttnLayer{kv_only, a.k, a.v, be.vec(w.q_norm), be.vec(w.k_norm)});
    }
    if (n_parts > 1) be.begin_chunk(*all);
    return;
  }
  lead.attention_sublayer(w, parts.data(), n_parts, n, *all);
  lead.mlp_sublayer(w, x, I.out.f(), n);
  // the head: shared_head_norm, then the trunk's output matrix
  float* hs = I.hn.f();
  be.rmsnorm(x, be.vec(W.head_norm), n, H, c.rms_eps, hs);
  bool any_logits = false;
  for (int p = 0; p < n_parts; ++p) {
    if (rs[p].head_out) be.copy(rs[p].head_out, hs + (size_t)parts[(size_t)p].row0 * H, rs[p].n * row);
    any_logits = any_logits || rs[p].logits;
  }
  if (k <= 0 && !any_logits) return;
  const int group = std::min(kLogitGroup, lead.params_.n_batch);
  if (!I.logits.p) I.logits = BackendBuf(be, (size_t)group * c.n_vocab * 4);
  const size_t kk8 = (size_t)std::max(k, 0);
  if (I.top.bytes < (size_t)group * kk8 * 8) I.top = BackendBuf(be, (size_t)group * kk8 * 8);
  std::vector<uint8_t> both((size_t)group * kk8 * 8);
  // rows g0 .. g0 + m - 1 of all: part p's row t is row parts[p].row0 + t
  for (int g0 = 0; g0 < n; g0 += group) {
    const int m = std::min(group, n - g0);
    be.matmul(M.output, hs + (size_t)g0 * H, m, I.logits.f());
    for (int p = 0; p < n_parts; ++p) {
      const int a = std::max(g0, parts[(size_t)p].row0), z = std::min(g0 + m, parts[(size_t)p].row0 + rs[p].n);
      if (rs[p].logits && a < z)
        be.download(rs[p].logits + (size_t)(a - parts[(size_t)p].row0) * c.n_vocab,
                    I.logits.f() + (size_t)(a - g0) * c.n_vocab, (size_t)(z - a) * c.n_vocab * 4);
    }
    if (k <= 0) continue;
    int32_t* tid = reinterpret_cast<int32_t*>(I.top.u8());
    float* tlp = reinterpret_cast<float*>(I.top.u8() + (size_t)group * kk8 * 4);
    be.row_topk(I.logits.f(), m, c.n_vocab, k, tid, tlp);
    be.download(both.data(), I.top.p, both.size());
    for (int p = 0; p < n_parts; ++p) {
      const int r0 = parts[(size_t)p].row0;
      for (int j = std::max(g0, r0); j < std::min(g0 + m, r0 + rs[p].n); ++j) {
        std::memcpy(rs[p].ids + (size_t)(j - r0) * kk8, both.data() + (size_t)(j - g0) * kk8 * 4, kk8 * 4);
        std::memcpy(rs[p].logp + (size_t)(j - r0) * kk8, both.data() + ((size_t)group + (j - g0)) * kk8 * 4, kk8 * 4);
      }
    }
  }
}

}  // namespace dfl
