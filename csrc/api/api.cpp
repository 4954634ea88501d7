// api.cpp — the C ABI: handles, status codes, last-error, exception barrier.
//
// Every entry point runs its body inside `guard`, which turns dfl::Error (and
// any other exception, e.g. bad_alloc) into DFL_ERROR plus a message for
// dfl_last_error(); no C++ exception ever crosses the ABI.
#include "dflash27b_dev.h"  // the public ABI and the tool entry points

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "api/handles.h"
#include "api/last_error.h"
#include "runtime/context.h"
#include "backend/cpu/cpu_ops.h"
#include "quant/quant.h"
#include "quant/simd.h"
#include "spec/ddtree.h"
#include "spec/sampler.h"
#include "spec/generator.h"
#include "spec/tree_merge.h"

#ifndef DFLASH27B_VERSION
#define DFLASH27B_VERSION "0.0.0"
#endif
#ifndef DFLASH27B_CUDA_ARCHS
#define DFLASH27B_CUDA_ARCHS ""
#endif

namespace {
thread_local std::string g_last_error;

// Every entry point's body runs inside the one exception barrier (last_error.h).
template <class F>
int guard(F&& f) {
  return dfl::api_guard(std::forward<F>(f));
}

void need(const void* p, const char* what) {
  if (!p) dfl::fail("%s is NULL", what);
}
}  // namespace

// For entry points in other translation units (csrc/api/last_error.h).
// Messages may quote names read from a corrupt file: keep them one printable line.
void dfl::set_last_error(const char* msg) {
  g_last_error = msg ? msg : "";
  for (char& ch : g_last_error)
    if ((unsigned char)ch < 0x20 || ch == 0x7f) ch = '?';
}

#pragma GCC visibility push(default)
namespace {
// The dev API's estimate tables as the controller holds them.
dfl::AutoEstimates auto_estimates(const dfl_auto_estimates* e) {
  need(e, "estimates");
  if (e->n_verify < 0 || e->n_verify > 64 || e->n_calib < 0 || e->n_calib > 64 || e->n_draft < 0 || e->n_draft > 64)
    dfl::fail("estimate tables hold at most 64 entries");
  dfl::AutoEstimates est;
  est.ar_s = e->ar_s, est.draft_s = e->draft_s, est.tree_s = e->tree_s, est.commit_s = e->commit_s;
  for (int i = 0; i < e->n_verify; ++i) est.verify_s[e->verify_nodes[i]] = e->verify_s[i];
  for (int i = 0; i < e->n_draft; ++i) est.draft_rows_s[e->draft_rows[i]] = e->draft_rows_s[i];
  est.depth_calib.assign(e->depth_calib, e->depth_calib + e->n_calib);
  est.mask_ar_s = e->mask_ar_s, est.mask_tree_s = e->mask_tree_s, est.constrained = e->constrained != 0;
  return est;
}
}  // namespace

extern "C" {

const char* dfl_version(void) { return DFLASH27B_VERSION; }

const char* dfl_build_info(void) {
  // per thread: the CPU kernels in use can change (dfl_cpu_avx512)
  thread_local std::string s;
  s = std::string("cpu: ") + dfl::simd_name() + "; cuda: " +
      (std::strlen(DFLASH27B_CUDA_ARCHS) ? DFLASH27B_CUDA_ARCHS : "not built");
  return s.c_str();
}

int64_t dfl_cpu_q6k_panel_rows(void) { return dfl::q6_panel_rows_read(); }

int dfl_cpu_avx512(int32_t mode) {
  return guard([&] { dfl::set_cpu_avx512(mode); });
}

const char* dfl_last_error(void) { return g_last_error.c_str(); }

const char* dfl_type_name(uint32_t type) {
  const dfl::TypeTraits* t = dfl::type_traits(type);
  return t ? t->name : nullptr;
}

dfl_model* dfl_model_load(const char* path) {
  dfl_model* out = nullptr;
  guard([&] {
    need(path, "path");
    auto m = std::make_unique<dfl_model>();
    m->m = dfl::load_qwen35(path);
    out = m.release();
  });
  return out;
}

void dfl_model_free(dfl_model* m) { delete m; }

int dfl_model_get_info(const dfl_model* m, dfl_model_info* o) {
  return guard([&] {
    need(m, "model");
    need(o, "info");
    const dfl::Qwen35Config& c = m->m->cfg;
    *o = dfl_model_info{};
    o->n_layer = c.n_layer; o->n_embd = c.n_embd; o->n_ff = c.n_ff; o->n_head = c.n_head;
    o->n_head_kv = c.n_head_kv; o->head_dim = c.head_dim; o->n_rot = c.n_rot; o->n_vocab = c.n_vocab;
    o->n_ctx_train = c.n_ctx_train; o->ssm_conv_kernel = c.conv_kernel; o->ssm_dk = c.ssm_dk;
    o->ssm_nk = c.ssm_nk; o->ssm_nv = c.ssm_nv; o->ssm_dv = c.ssm_dv; o->tied_embeddings = c.tied_embeddings;
    o->rope_base = c.rope_base; o->rms_eps = c.rms_eps;
    o->weight_bytes = m->m->weight_bytes; o->file_bytes = m->m->file->file_size();
    o->n_mtp_layers = m->m->mtp.present() ? 1 : 0; o->mtp_bytes = m->m->mtp_bytes;
  });
}

int dfl_model_layer_is_recurrent(const dfl_model* m, int32_t layer) {
  if (!m || layer < 0 || layer >= m->m->cfg.n_layer) return -1;
  return m->m->cfg.is_recurrent[layer];
}

int32_t dfl_model_tensor_count(const dfl_model* m) { return m ? (int32_t)m->m->file->tensors().size() : -1; }

int dfl_model_tensor_info(const dfl_model* m, int32_t i, const char** name, uint32_t* type, int64_t ne[4]) {
  return guard([&] {
    need(m, "model");
    const auto& ts = m->m->file->tensors();
    if (i < 0 || i >= (int32_t)ts.size()) dfl::fail("tensor index %d out of range", i);
    if (name) *name = ts[i].name.c_str();
    if (type) *type = ts[i].type;
    if (ne) for (int d = 0; d < 4; ++d) ne[d] = ts[i].ne[d];
  });
}

dfl_context_params dfl_context_default_params(void) {
  dfl_context_params p;
  p.n_ctx = 4096;
  p.n_batch = 512;
  p.n_threads = 0;
  p.kv_type = DFL_TYPE_F16;
  p.device = DFL_DEVICE_CPU;
  p.state_type = DFL_TYPE_F32;
  return p;
}

static dfl::ContextParams to_context_params(const dfl_context_params& d) {
  if (d.device != DFL_DEVICE_CPU && d.device != DFL_DEVICE_CUDA)
    dfl::fail("unknown device %d (DFL_DEVICE_CPU = 0, DFL_DEVICE_CUDA = 1)", d.device);
  dfl::ContextParams cp;
  cp.n_ctx = d.n_ctx;
  cp.n_batch = d.n_batch;
  cp.n_threads = d.n_threads;
  cp.kv_type = (dfl::DType)d.kv_type;
  cp.state_type = (dfl::DType)d.state_type;
  cp.device = d.device == DFL_DEVICE_CUDA ? dfl::Device::CUDA : dfl::Device::CPU;
  return cp;
}

int dfl_context_memory_plan(const dfl_model* m, const dfl_context_params* p, int32_t max_nodes, dfl_memory_plan* out) {
  return guard([&] {
    need(m, "model");
    need(out, "out");
    if (max_nodes < 0) dfl::fail("max_nodes must be >= 0 (got %d)", max_nodes);
    const dfl::ContextParams cp = to_context_params(p ? *p : dfl_context_default_params());
    const dfl::MemoryPlan mp = dfl::memory_plan(*m->m, cp, max_nodes);
    out->weights = mp.weights;
    out->kv = mp.kv;
    out->recurrent = mp.recurrent;
    out->tree_state = mp.tree_state;
    out->workspace = mp.workspace;
    out->total = mp.total();
  });
}

dfl_context* dfl_context_new(dfl_model* m, const dfl_context_params* p) {
  dfl_context* out = nullptr;
  guard([&] {
    need(m, "model");
    const dfl::ContextParams cp = to_context_params(p ? *p : dfl_context_default_params());
    auto c = std::make_unique<dfl_context>();
    c->ctx = std::make_unique<dfl::Context>(*m->m, cp);
    c->gen = std::make_unique<dfl::Generator>(*c->ctx);
    out = c.release();
  });
  return out;
}

void dfl_context_free(dfl_context* c) { delete c; }

dfl_context* dfl_context_new_slot(dfl_context* base, const dfl_context_params* p) {
  dfl_context* out = nullptr;
  guard([&] {
    need(base, "base context");
    dfl::ContextParams cp = p ? to_context_params(*p) : base->ctx->params();
    cp.device = base->ctx->params().device;
    auto c = std::make_unique<dfl_context>();
    c->ctx = std::make_unique<dfl::Context>(base->ctx->model(), cp, base->ctx.get());
    c->gen = std::make_unique<dfl::Generator>(*c->ctx);
    c->slot_base = base;
    out = c.release();
  });
  return out;
}

const char* dfl_context_backend(const dfl_context* c) {
  if (!c) return nullptr;
  if (c->backend_name.empty()) c->backend_name = c->ctx->backend_name();
  return c->backend_name.c_str();
}

int dfl_context_reset(dfl_context* c) {
  return guard([&] {
    need(c, "context");
    c->ctx->reset();
  });
}

int32_t dfl_context_n_past(const dfl_context* c) { return c ? c->ctx->n_past() : -1; }

int64_t dfl_context_state_size(const dfl_context* c) { return c ? (int64_t)c->ctx->committed_state_size() : -1; }

int dfl_context_get_state(const dfl_context* c, void* dst, int64_t size) {
  return guard([&] {
    need(c, "context");
    need(dst, "dst");
    if (size < (int64_t)c->ctx->committed_state_size())
      dfl::fail("state buffer of %lld bytes is smaller than the state (%zu bytes)", (long long)size,
                c->ctx->committed_state_size());
    c->ctx->copy_committed_state((uint8_t*)dst);
  });
}

int64_t dfl_context_kv_bytes_per_position(const dfl_context* c) {
  return c ? (int64_t)c->ctx->kv_bytes_per_position() : -1;
}

static void need_size(int64_t have, size_t want, const char* what) {
  if (have != (int64_t)want)
    dfl::fail("%s buffer of %lld bytes, expected %zu", what, (long long)have, want);
}

int dfl_context_get_kv(const dfl_context* c, int32_t p0, int32_t p1, void* dst, int64_t size) {
  return guard([&] {
    need(c, "context");
    need(dst, "dst");
    need_size(size, (size_t)std::max(0, p1 - p0) * c->ctx->kv_bytes_per_position(), "KV");
    c->ctx->get_kv(p0, p1, (uint8_t*)dst);
  });
}

int dfl_context_set_kv(dfl_context* c, int32_t p0, int32_t p1, const void* src, int64_t size) {
  return guard([&] {
    need(c, "context");
    need(src, "src");
    need_size(size, (size_t)std::max(0, p1 - p0) * c->ctx->kv_bytes_per_position(), "KV");
    c->ctx->set_kv(p0, p1, (const uint8_t*)src);
  });
}

int64_t dfl_context_recurrent_bytes(const dfl_context* c) { return c ? (int64_t)c->ctx->recurrent_bytes() : -1; }

int dfl_context_get_recurrent(const dfl_context* c, void* dst, int64_t size) {
  return guard([&] {
    need(c, "context");
    need(dst, "dst");
    need_size(size, c->ctx->recurrent_bytes(), "recurrent state");
    c->ctx->get_recurrent((uint8_t*)dst);
  });
}

int dfl_context_set_recurrent(dfl_context* c, const void* src, int64_t size) {
  return guard([&] {
    need(c, "context");
    need(src, "src");
    need_size(size, c->ctx->recurrent_bytes(), "recurrent state");
    c->ctx->set_recurrent((const uint8_t*)src);
  });
}

int dfl_context_set_n_past(dfl_context* c, int32_t n) {
  return guard([&] {
    need(c, "context");
    c->ctx->set_n_past(n);
  });
}

int64_t dfl_context_n_forwards(const dfl_context* c) { return c ? c->ctx->n_forwards() : -1; }

int dfl_forward(dfl_context* c, int32_t n, const int32_t* tokens, const int32_t* pos, const int32_t* parent,
                int32_t n_logits, const int32_t* logit_rows, float* logits, int32_t n_capture,
                const int32_t* capture_layers, float* hidden, int32_t commit) {
  return guard([&] {
    need(c, "context");
    need(tokens, "tokens");
    need(pos, "pos");
    if (n_logits > 0) { need(logit_rows, "logit_rows"); need(logits, "logits"); }
    if (n_capture > 0) { need(capture_layers, "capture_layers"); need(hidden, "hidden"); }
    dfl::Batch b{n, tokens, pos, parent};
    dfl::ForwardOutputs o;
    o.n_logits = n_logits; o.logit_rows = logit_rows; o.logits = logits;
    o.n_capture = n_capture; o.capture_layers = capture_layers; o.hidden = hidden;
    c->ctx->forward(b, o, commit != 0);
  });
}

int dfl_commit_path(dfl_context* c, const int32_t* nodes, int32_t n) {
  return guard([&] {
    need(c, "context");
    need(nodes, "nodes");
    c->ctx->commit_path(nodes, n);
  });
}

dfl_gen_params dfl_gen_default_params(void) {
  dfl_gen_params p{};
  dfl::GenParams d;
  p.max_new_tokens = d.max_new_tokens;
  p.mode = DFL_MODE_AR;
  p.tree_budget = d.tree.budget;
  p.tree_topk = d.tree.topk;
  p.chain_seed = d.tree.chain_seed ? 1 : 0;
  p.tree_expand = d.tree.expand;
  p.temperature = d.sampler.temperature;
  p.top_k = d.sampler.top_k;
  p.top_p = d.sampler.top_p;
  p.min_p = d.sampler.min_p;
  p.seed = d.sampler.seed;
  p.n_logprobs = d.n_logprobs;
  p.repeat_penalty = d.sampler.repeat_penalty;
  p.frequency_penalty = d.sampler.frequency_penalty;
  p.presence_penalty = d.sampler.presence_penalty;
  p.repeat_last_n = d.sampler.repeat_last_n;
  p.typical_p = d.sampler.typical_p;
  p.tree_scores = (int32_t)d.tree.scores;
  return p;
}

int dfl_generate_begin(dfl_context* c, const int32_t* prompt, int32_t n_prompt, const dfl_gen_params* p) {
  return dfl_generate_begin_keep(c, prompt, n_prompt, 0, p);
}

int dfl_generate_begin_keep(dfl_context* c, const int32_t* prompt, int32_t n_prompt, int32_t n_keep,
                            const dfl_gen_params* p) {
  return guard([&] {
    need(c, "context");
    need(prompt, "prompt");
    dfl::GenParams gp;
    if (p) {
      gp.max_new_tokens = p->max_new_tokens;
      gp.ignore_eos = p->ignore_eos != 0;
      if (p->mode != DFL_MODE_AR && p->mode != DFL_MODE_CHAIN && p->mode != DFL_MODE_DDTREE && p->mode != DFL_MODE_AUTO)
        dfl::fail("unknown decode mode %d", p->mode);
      gp.mode = (dfl::DecodeMode)p->mode;
      if (p->block_size < 0) dfl::fail("block size must be >= 0 (got %d)", p->block_size);
      gp.block_size = p->block_size;
      gp.tree.budget = p->tree_budget;
      gp.tree.topk = p->tree_topk;
      gp.tree.chain_seed = p->chain_seed != 0;
      gp.tree.expand = p->tree_expand;
      gp.sampler.temperature = p->temperature;
      gp.sampler.top_k = p->top_k;
      gp.sampler.top_p = p->top_p;
      gp.sampler.min_p = p->min_p;
      gp.sampler.seed = p->seed;
      gp.n_logprobs = p->n_logprobs;
      gp.sampler.repeat_penalty = p->repeat_penalty;
      gp.sampler.frequency_penalty = p->frequency_penalty;
      gp.sampler.presence_penalty = p->presence_penalty;
      gp.sampler.repeat_last_n = p->repeat_last_n;
      gp.sampler.typical_p = p->typical_p;
      if (p->tree_scores != 0 && p->tree_scores != 1)
        dfl::fail("tree_scores must be 0 (the selector's) or 1 (the draft probabilities'), got %d", p->tree_scores);
      gp.tree.scores = (dfl::TreeParams::Scores)p->tree_scores;
      if (p->n_logit_bias < 0) dfl::fail("n_logit_bias must be >= 0 (got %d)", p->n_logit_bias);
      if (p->n_logit_bias > 0) {
        need(p->logit_bias_ids, "logit_bias_ids");
        need(p->logit_bias_values, "logit_bias_values");
        for (int32_t i = 0; i < p->n_logit_bias; ++i)
          gp.sampler.logit_bias.emplace_back(p->logit_bias_ids[i], p->logit_bias_values[i]);
        std::sort(gp.sampler.logit_bias.begin(), gp.sampler.logit_bias.end(),
                  [](const auto& a, const auto& b) { return a.first < b.first; });  // (a repeated id is refused)
      }
      if (p->n_eos > 0) {
        need(p->eos_ids, "eos_ids");
        gp.eos_ids.assign(p->eos_ids, p->eos_ids + p->n_eos);
      }
    }
    c->gen->begin(prompt, n_prompt, gp, n_keep);
  });
}

int32_t dfl_generate_next(dfl_context* c, int32_t* out_tokens, int32_t cap) {
  int32_t n = 0;
  int rc = guard([&] {
    need(c, "context");
    need(out_tokens, "out_tokens");
    if (cap <= 0) dfl::fail("output capacity must be positive");
    std::vector<int32_t> toks;
    c->gen->next(toks);
    if ((int32_t)toks.size() > cap) dfl::fail("output capacity %d too small for %zu tokens", cap, toks.size());
    std::memcpy(out_tokens, toks.data(), toks.size() * 4);
    n = (int32_t)toks.size();
  });
  return rc == DFL_OK ? n : -1;
}

int32_t dfl_generate_next_many(dfl_context* const* cs, int32_t n, int32_t* out_tokens, int32_t cap, int32_t* counts) {
  int32_t total = 0;
  int rc = guard([&] {
    need(cs, "contexts");
    need(out_tokens, "out_tokens");
    need(counts, "counts");
    if (n <= 0) dfl::fail("slot count must be positive (got %d)", n);
    if (cap <= 0) dfl::fail("output capacity must be positive");
    std::vector<dfl::Generator*> gs((size_t)n);
    for (int k = 0; k < n; ++k) {
      if (!cs[k]) dfl::fail("slot %d is NULL", k);
      gs[(size_t)k] = cs[k]->gen.get();
    }
    std::vector<std::vector<int32_t>> outs((size_t)n);
    total = dfl::Generator::next_many(gs.data(), n, outs.data());
    for (int k = 0; k < n; ++k) {
      if ((int32_t)outs[(size_t)k].size() > cap)
        dfl::fail("output capacity %d too small for slot %d's %zu tokens", cap, k, outs[(size_t)k].size());
      std::memcpy(out_tokens + (size_t)k * cap, outs[(size_t)k].data(), outs[(size_t)k].size() * 4);
      counts[k] = (int32_t)outs[(size_t)k].size();
    }
  });
  return rc == DFL_OK ? total : -1;
}

int dfl_generate_stats(const dfl_context* c, dfl_gen_stats* o) {
  return guard([&] {
    need(c, "context");
    need(o, "stats");
    const dfl::GenStats& s = c->gen->stats();
    o->prompt_tokens = s.prompt_tokens;
    o->generated_tokens = s.generated_tokens;
    o->steps = s.steps;
    o->stop_reason = (int32_t)s.stop;
    o->prefill_s = s.prefill_s;
    o->decode_s = s.decode_s;
  });
}

int32_t dfl_generate_n_steps(const dfl_context* c) { return c ? (int32_t)c->gen->steps().size() : -1; }

int32_t dfl_generate_n_logprobs(const dfl_context* c) { return c ? (int32_t)c->gen->logprobs().size() : -1; }

int dfl_generate_logprob(const dfl_context* c, int32_t i, dfl_token_logprob* o) {
  return guard([&] {
    need(c, "context");
    need(o, "out");
    const auto& lp = c->gen->logprobs();
    if (i < 0 || i >= (int32_t)lp.size()) dfl::fail("log-probability %d of %zu", i, lp.size());
    static_assert(dfl::kMaxLogprobs == 20, "dfl_token_logprob holds 20 alternatives");
    const dfl::TokenLogprob& e = lp[(size_t)i];
    o->token = e.token;
    o->logprob = e.logp;
    o->n_top = e.n_top;
    for (int k = 0; k < 20; ++k) {
      o->top_ids[k] = k < e.n_top ? e.top_ids[k] : -1;
      o->top_logprobs[k] = k < e.n_top ? e.top_logp[k] : 0.f;
    }
  });
}

int dfl_generate_step_stats(const dfl_context* c, int32_t i, dfl_step_stats* o) {
  return guard([&] {
    need(c, "context");
    need(o, "stats");
    const auto& st = c->gen->steps();
    if (i < 0 || i >= (int32_t)st.size()) dfl::fail("step %d out of range (%zu steps)", i, st.size());
    const dfl::StepRecord& r = st[(size_t)i];
    o->committed = r.committed; o->drafted = r.drafted; o->accepted = r.accepted;
    o->tree_depth = r.tree_depth; o->target_forwards = r.target_forwards;
    o->draft_s = r.draft_s; o->tree_s = r.tree_s; o->verify_s = r.verify_s; o->commit_s = r.commit_s;
    o->auto_budget = r.auto_budget; o->probe = r.probe ? 1 : 0;
    o->expected_tokens = r.expected; o->est_tok_s = r.est_tok_s; o->est_ar_tok_s = r.est_ar_tok_s;
    o->pruned = r.pruned; o->mask_s = r.mask_s;
    o->drafter = r.drafter;
    o->declined_learnt = r.declined_learnt;
    o->draft_batch = r.draft_batch;
    o->draft_depth = r.draft_depth;
    o->merged = r.merged;
  });
}

const char* dfl_context_drafter_name(const dfl_context* c, int32_t i) {
  if (!c || i < 0 || (size_t)i >= c->gen->n_drafters()) return nullptr;
  return c->gen->drafter_name((size_t)i);
}

int dfl_context_auto_estimates(const dfl_context* c, int32_t drafter, dfl_auto_estimates* out) {
  return guard([&] {
    need(c, "context");
    need(out, "estimates");
    if (drafter < 0 || (size_t)drafter >= c->gen->n_drafters())
      dfl::fail("drafter %d: the portfolio holds %zu", drafter, c->gen->n_drafters());
    const dfl::AutoEstimates& e = c->gen->auto_controller((size_t)drafter).estimates();
    *out = dfl_auto_estimates{};
    out->ar_s = e.ar_s, out->draft_s = e.draft_s, out->tree_s = e.tree_s, out->commit_s = e.commit_s;
    out->mask_ar_s = e.mask_ar_s, out->mask_tree_s = e.mask_tree_s, out->constrained = e.constrained ? 1 : 0;
    for (const auto& [n, s] : e.verify_s) {
      if (out->n_verify == 64) break;
      out->verify_nodes[out->n_verify] = n;
      out->verify_s[out->n_verify++] = s;
    }
    for (const auto& [rows, s] : e.draft_rows_s) {
      if (out->n_draft == 64) break;
      out->draft_rows[out->n_draft] = rows;
      out->draft_rows_s[out->n_draft++] = s;
    }
    out->n_calib = (int32_t)std::min<size_t>(e.depth_calib.size(), 64);
    std::copy_n(e.depth_calib.begin(), out->n_calib, out->depth_calib);
  });
}

int dfl_context_measure_verify(dfl_context* c, int32_t max_nodes) {
  return guard([&] {
    need(c, "context");
    if (max_nodes < 0) dfl::fail("max_nodes must be >= 0 (got %d)", max_nodes);
    c->gen->measure_verify(max_nodes);
  });
}

int dfl_auto_worst_loss(const dfl_auto_estimates* e, int32_t slots, double* out_s) {
  return guard([&] {
    need(out_s, "out_s");
    if (slots < 1) dfl::fail("slots must be at least 1 (got %d)", slots);
    *out_s = dfl::worst_loss_s(auto_estimates(e), slots);
  });
}

int dfl_auto_allowance(int32_t max_new_tokens, double ar_s, const dfl_auto_step* steps, int32_t n, double* bet_s,
                       double* probe_s) {
  return guard([&] {
    need(bet_s, "bet_s");
    need(probe_s, "probe_s");
    if (n < 0) dfl::fail("step count %d is negative", n);
    if (n > 0) need(steps, "steps");
    if (!(ar_s > 0)) dfl::fail("ar_s must be positive (got %g)", ar_s);
    dfl::LossAllowance a;
    a.begin(max_new_tokens);
    for (int32_t i = 0; i < n; ++i) {
      dfl::StepRecord rec;
      rec.probe = steps[i].probe != 0;
      rec.auto_budget = steps[i].budget;
      rec.committed = steps[i].committed;
      rec.draft_s = steps[i].draft_s, rec.tree_s = steps[i].tree_s;
      rec.verify_s = steps[i].verify_s, rec.commit_s = steps[i].commit_s;
      a.settle(rec, ar_s, steps[i].expected_s);
    }
    *bet_s = a.bet_s(ar_s, false);
    *probe_s = a.bet_s(ar_s, true);
  });
}

int dfl_auto_choose(const dfl_auto_estimates* e, const int32_t* depth, const float* logp, int32_t n,
                    int32_t min_budget, int32_t with_draft, double max_worst_s, dfl_auto_choice* out) {
  return guard([&] {
    need(out, "choice");
    if (n < 0 || n > 4096) dfl::fail("node count %d out of range [0, 4096]", n);
    if (n > 0) need(depth, "depth"), need(logp, "logp");
    const dfl::AutoEstimates est = auto_estimates(e);
    const dfl::AutoChoice c =
        dfl::choose_budget(est, depth, logp, n, min_budget, with_draft != 0, 1e300, 0, 1, 0, max_worst_s);
    out->budget = c.budget;
    out->expected_tokens = c.expected;
    out->tok_s = c.tok_s;
    out->ar_tok_s = c.ar_tok_s;
    out->depth = c.depth;
  });
}

int32_t dfl_sample(const float* logits, int32_t n_vocab, float temperature, int32_t top_k, float top_p, float min_p,
                   uint64_t seed, int64_t pos) {
  int32_t tok = -1;
  guard([&] {
    need(logits, "logits");
    if (n_vocab <= 0) dfl::fail("n_vocab must be positive");
    dfl::SamplerParams sp;
    sp.temperature = temperature;
    sp.top_k = top_k;
    sp.top_p = top_p;
    sp.min_p = min_p;
    sp.seed = seed;
    dfl::validate_sampler(sp);
    std::vector<std::pair<float, int32_t>> scratch;
    tok = dfl::sample_token(logits, n_vocab, sp, pos, scratch);
  });
  return tok;
}

int32_t dfl_build_ddtree(const float* logits, int32_t L, int32_t n_vocab, int32_t budget, int32_t topk,
                         int32_t chain_seed, int32_t cap, int32_t* tokens, int32_t* depth, int32_t* parents) {
  int32_t n = -1;
  guard([&] {
    need(logits, "logits");
    if (n_vocab <= 0) dfl::fail("n_vocab must be positive");
    dfl::TreeParams tp;
    tp.budget = budget;
    tp.topk = topk;
    tp.chain_seed = chain_seed != 0;
    const dfl::DraftTree t = dfl::build_ddtree(logits, L, n_vocab, tp);
    if (t.size() > cap) dfl::fail("tree of %d nodes exceeds the capacity %d", t.size(), cap);
    for (int i = 0; i < t.size(); ++i) {
      if (tokens) tokens[i] = t.tokens[(size_t)i];
      if (depth) depth[i] = t.depth[(size_t)i];
      if (parents) parents[i] = t.parent[(size_t)i];
    }
    n = t.size();
  });
  return n;
}

int32_t dfl_build_ddtree_lattice(const int32_t* cand_ids, const float* cand_logp, const float* edge, int32_t L,
                                 int32_t K, int32_t budget, int32_t chain_seed, int32_t cap, int32_t* tokens,
                                 int32_t* depth, int32_t* parents, float* logp) {
  int32_t n = -1;
  guard([&] {
    need(cand_ids, "cand_ids");
    need(cand_logp, "cand_logp");
    need(edge, "edge");
    dfl::TreeParams tp;
    tp.budget = budget;
    tp.chain_seed = chain_seed != 0;
    const dfl::DraftTree t = dfl::build_ddtree_lattice(cand_ids, cand_logp, edge, L, K, tp);
    if (t.size() > cap) dfl::fail("tree of %d nodes exceeds the capacity %d", t.size(), cap);
    for (int i = 0; i < t.size(); ++i) {
      if (tokens) tokens[i] = t.tokens[(size_t)i];
      if (depth) depth[i] = t.depth[(size_t)i];
      if (parents) parents[i] = t.parent[(size_t)i];
      if (logp) logp[i] = t.logp[(size_t)i];
    }
    n = t.size();
  });
  return n;
}

int32_t dfl_merge_trees(int32_t na, const int32_t* a_tokens, const int32_t* a_parents, const double* a_q, int32_t nb,
                        const int32_t* b_tokens, const int32_t* b_parents, const double* b_q, int32_t cap,
                        int32_t* tokens, int32_t* depth, int32_t* parents, double* q, int32_t* from_a,
                        int32_t* from_b) {
  int32_t n = -1;
  guard([&] {
    auto tree = [](const char* name, int32_t m, const int32_t* tok, const int32_t* par, const double* qs) {
      if (m < 0) dfl::fail("tree %s: %d nodes", name, m);
      if (m > 0) need(tok, "tokens"), need(par, "parents"), need(qs, "q");
      dfl::DraftTree t;
      for (int32_t i = 1; i <= m; ++i) {
        const int32_t p = par[i - 1];
        if (p < 0 || p >= i) dfl::fail("tree %s: node %d has parent %d (must be in 0..%d)", name, i, p, i - 1);
        if (!(qs[i - 1] >= 0 && qs[i - 1] <= 1)) dfl::fail("tree %s: node %d's q %g is outside [0, 1]", name, i, qs[i - 1]);
        t.tokens.push_back(tok[i - 1]), t.parent.push_back(p), t.logp.push_back(0.f);
        t.depth.push_back(p == 0 ? 1 : t.depth[(size_t)p - 1] + 1);
      }
      return t;
    };
    const dfl::DraftTree a = tree("a", na, a_tokens, a_parents, a_q), b = tree("b", nb, b_tokens, b_parents, b_q);
    const dfl::TreeUnion u = dfl::merge_trees(a, a_q, b, b_q);
    if (u.tree.size() > cap) dfl::fail("union of %d nodes exceeds the capacity %d", u.tree.size(), cap);
    for (int i = 0; i < u.tree.size(); ++i) {
      const size_t k = (size_t)i;
      if (tokens) tokens[i] = u.tree.tokens[k];
      if (depth) depth[i] = u.tree.depth[k];
      if (parents) parents[i] = u.tree.parent[k];
      if (q) q[i] = u.q[k];
      if (from_a) from_a[i] = u.from_a[k];
      if (from_b) from_b[i] = u.from_b[k];
    }
    n = u.tree.size();
  });
  return n;
}

int dfl_selftest_threadpool(int32_t n_threads, int64_t iters) {
  return guard([&] {
    dfl::ThreadPool pool(n_threads > 0 ? n_threads : 1);
    std::vector<int> hit(4096, 0);
    for (int64_t it = 0; it < iters; ++it) {
      const int64_t n = 1 + (it * 7919) % 3000, grain = 1 + it % 17;
      pool.parallel_for(n, grain, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) hit[(size_t)i]++;
      });
      for (int64_t i = 0; i < n; ++i) {
        if (hit[(size_t)i] != 1)
          dfl::fail("thread pool: loop %lld visited index %lld %d times", (long long)it, (long long)i, hit[(size_t)i]);
        hit[(size_t)i] = 0;
      }
    }
  });
}

double dfl_measure_read_bandwidth(int64_t bytes, int32_t n_threads) {
  double best = 0.0;
  guard([&] {
    if (bytes < (1 << 20)) dfl::fail("bandwidth test needs at least 1 MiB");
    const int64_t n = bytes / 8;
    std::vector<uint64_t> buf((size_t)n, 1);
    dfl::ThreadPool pool(n_threads > 0 ? n_threads : 1);
    std::vector<uint64_t> sums(64, 0);
    for (int rep = 0; rep < 4; ++rep) {
      auto t0 = std::chrono::steady_clock::now();
      pool.parallel_for(n, n / pool.size() + 1, [&](int64_t b, int64_t e) {
        uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
        int64_t i = b;
        for (; i + 4 <= e; i += 4) { s0 += buf[i]; s1 += buf[i + 1]; s2 += buf[i + 2]; s3 += buf[i + 3]; }
        for (; i < e; ++i) s0 += buf[i];
        sums[(b * 8 / (n + 1)) % 64] += s0 + s1 + s2 + s3;
      });
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (rep > 0) best = std::max(best, (double)n * 8 / s / 1e9);  // first pass warms the pages
    }
    if (sums[0] == 12345) best += 0;  // keep the reads alive
  });
  return best;
}

int dfl_dequantize(uint32_t type, const void* src, int64_t n, float* dst) {
  return guard([&] {
    need(src, "src");
    need(dst, "dst");
    const dfl::TypeTraits* t = dfl::type_traits(type);
    if (!t) dfl::fail("unsupported tensor type %u", type);
    if (n % t->block_elems) dfl::fail("%lld elements is not a multiple of the %s block size", (long long)n, t->name);
    dfl::dequantize_row((dfl::DType)type, src, dst, n);
  });
}

int dfl_quantize(uint32_t type, const float* src, int64_t n, void* dst) {
  return guard([&] {
    need(src, "src");
    need(dst, "dst");
    dfl::DType t = (dfl::DType)type;
    if (t != dfl::DType::F32 && t != dfl::DType::F16 && t != dfl::DType::BF16 && t != dfl::DType::Q8_0 &&
        t != dfl::DType::Q4_0)
      dfl::fail("quantization to type %u is not implemented", type);
    if (n % dfl::type_traits(type)->block_elems) dfl::fail("length not a multiple of the block size");
    dfl::quantize_row(t, src, dst, n);
  });
}

}  // extern "C"

namespace {
// A caller's rows x cols matrix of `type` blocks as a Weight.
dfl::Weight weight_view(uint32_t type, const void* w, int64_t rows, int64_t cols) {
  dfl::Weight W;
  W.type = (dfl::DType)type;
  W.data = (const uint8_t*)w;
  W.rows = rows;
  W.cols = cols;
  W.row_bytes = dfl::row_bytes(W.type, cols);
  return dfl::with_cpu_layout(W);
}
}  // namespace

extern "C" {

int dfl_matmul(uint32_t type, const void* w, int64_t rows, int64_t cols, const float* x, int32_t n, float* y,
               int32_t n_threads) {
  return guard([&] {
    need(w, "w");
    need(x, "x");
    need(y, "y");
    const dfl::TypeTraits* t = dfl::type_traits(type);
    if (!t) dfl::fail("unsupported tensor type %u", type);
    if (cols % 32 || cols % t->block_elems) dfl::fail("cols must be a multiple of 32 and of the block size");
    const dfl::Weight W = weight_view(type, w, rows, cols);
    dfl::ThreadPool pool(n_threads > 0 ? n_threads : 1);
    dfl::ActScratch act;
    dfl::matmul(pool, W, x, n, y, act);
  });
}

int dfl_matmul_reference(uint32_t type, const void* w, int64_t rows, int64_t cols, const float* x, int32_t n,
                         float* y) {
  return guard([&] {
    need(w, "w");
    need(x, "x");
    need(y, "y");
    const auto t = (dfl::DType)type;
    const bool block32 = t == dfl::DType::Q8_0 || t == dfl::DType::Q4_0;
    if (!dfl::gemm_kquant_supported(t) && !block32)
      dfl::fail("dfl_matmul_reference: type %u is not a K-quant, Q8_0 or Q4_0", type);
    const int64_t block = dfl::act_block(t);
    if (cols % block) dfl::fail("cols must be a multiple of %lld", (long long)block);
    const dfl::Weight W = weight_view(type, w, rows, cols);
    dfl::ThreadPool pool(1);
    dfl::ActScratch act;
    const std::vector<dfl::ActRow> xr = dfl::quantize_activations(pool, x, n, cols, (int)block, act);
    if (!block32) return dfl::gemm_kquant_reference(W, 0, rows, xr.data(), n, y);
    for (int32_t k = 0; k < n; ++k)
      for (int64_t r = 0; r < rows; ++r) y[(int64_t)k * rows + r] = dfl::dot_row_q_reference(t, W.row(r), xr[k], cols);
  });
}

}  // extern "C"
#pragma GCC visibility pop
