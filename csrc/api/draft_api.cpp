// draft_api.cpp — C entry points for the DFlash drafter: load/info/free, the
// drafter runtime attached to a context (or standalone), and the draft hook.
// Bodies run inside dfl::api_guard, like every entry point in api.cpp.
#include <cstdio>
#include <memory>

#include "api/handles.h"
#include "api/last_error.h"
#include "dflash27b_dev.h"  // the public ABI and the tool entry points
#include "model/dflash_draft.h"

namespace {
constexpr int kMaxInfoLayerIds = 16;  // dfl_draft_info.target_layer_ids

void check_info_fits(const char* path, const dfl::DraftConfig& c) {
  if ((int)c.target_layer_ids.size() > kMaxInfoLayerIds)
    dfl::fail("%s: %zu target_layer_ids; this build supports at most %d", path, c.target_layer_ids.size(),
              kMaxInfoLayerIds);
}

void fill_info(const char* path, const dfl::DraftConfig& c, dfl_draft_info* o) {
  check_info_fits(path, c);
  *o = dfl_draft_info{};
  o->n_layer = c.n_layer; o->hidden = c.hidden; o->n_head = c.n_head; o->n_head_kv = c.n_head_kv;
  o->head_dim = c.head_dim; o->n_ff = c.n_ff; o->n_vocab = c.n_vocab;
  o->block_size = c.block_size; o->mask_token_id = c.mask_token_id;
  o->n_target_layers = (int32_t)c.target_layer_ids.size();
  for (int i = 0; i < o->n_target_layers; ++i) o->target_layer_ids[i] = c.target_layer_ids[(size_t)i];
  for (uint8_t s : c.is_sliding) o->n_sliding_layers += s;
  o->sliding_window = c.sliding_window;
  o->num_target_layers = c.num_target_layers;
  o->rms_eps = c.rms_eps; o->rope_theta = c.rope.base;
  std::snprintf(o->rope_type, sizeof o->rope_type, "%s", c.rope_type.c_str());
  o->rope_factor = c.rope.factor;
  o->rope_attention_factor = c.rope.attn_factor;
  o->generation = c.dflash2 ? 2 : 1;
  o->conv_kernel_size = c.conv_kernel;
  o->conv_group_size = c.conv_group;
  o->selector_top_k = c.selector_top_k;
  o->selector_rank = c.selector_rank;
}
}  // namespace

#pragma GCC visibility push(default)
extern "C" {

dfl_draft* dfl_draft_load(const char* path, const dfl_model* target) {
  return dfl_draft_load_as(path, target, DFL_DRAFT_AS_STORED);
}

dfl_draft* dfl_draft_load_as(const char* path, const dfl_model* target, uint32_t weight_type) {
  dfl_draft* out = nullptr;
  dfl::api_guard([&] {
    if (!path) dfl::fail("path is NULL");
    auto d = std::make_unique<dfl_draft>();
    std::optional<dfl::DType> wt;
    if (weight_type != DFL_DRAFT_AS_STORED) wt = (dfl::DType)weight_type;
    d->d = dfl::load_draft(path, wt);
    check_info_fits(path, d->d->cfg);
    if (target) dfl::validate_pair(d->d->cfg, target->m->cfg);
    out = d.release();
  });
  return out;
}

void dfl_draft_free(dfl_draft* d) { delete d; }

int dfl_draft_get_info(const dfl_draft* d, dfl_draft_info* o) {
  return dfl::api_guard([&] {
    if (!d) dfl::fail("draft is NULL");
    if (!o) dfl::fail("info is NULL");
    fill_info(d->d->config_path.c_str(), d->d->cfg, o);
    o->weight_bytes = d->d->weight_bytes;
  });
}

int dfl_draft_config_info(const char* path, dfl_draft_info* o) {
  return dfl::api_guard([&] {
    if (!path) dfl::fail("path is NULL");
    if (!o) dfl::fail("info is NULL");
    fill_info(path, dfl::parse_draft_config(dfl::draft_files(path, false).config), o);
  });
}

dfl_drafter_params dfl_drafter_default_params(void) {
  dfl_drafter_params p;
  p.ring_capacity = dfl::DrafterParams{}.ring_capacity;
  p.n_threads = 0;
  return p;
}

static dfl::DrafterParams drafter_params(const dfl_drafter_params* p) {
  dfl_drafter_params d = p ? *p : dfl_drafter_default_params();
  dfl::DrafterParams dp;
  dp.ring_capacity = d.ring_capacity;
  dp.n_threads = d.n_threads;
  return dp;
}

int dfl_context_attach_draft(dfl_context* c, const dfl_draft* d, const dfl_drafter_params* p) {
  return dfl::api_guard([&] {
    if (!c) dfl::fail("context is NULL");
    c->dflash.reset();
    c->drafter.reset();
    c->refresh_proposers();
    if (!d) return;
    // on the context's backend: it takes the captured target features there
    c->drafter = std::make_unique<dfl::Drafter>(*d->d, c->ctx->model(), drafter_params(p), &c->ctx->backend());
    c->dflash = std::make_unique<dfl::DFlashProposer>(*c->drafter);
    c->attached(c->dflash.get());
    c->refresh_proposers();
  });
}

int dfl_context_attach_draft_model(dfl_context* c, const dfl_model* m) {
  return dfl::api_guard([&] {
    if (!c) dfl::fail("context is NULL");
    c->draft_model.reset();
    c->refresh_proposers();
    if (!m) return;
    // a slot's draft context shares its base's (same draft model): the slots' drafts then run as one forward
    dfl::DraftModelProposer* share = c->slot_base && c->slot_base->draft_model &&
                                             &c->slot_base->draft_model->draft_model() == m->m.get()
                                         ? c->slot_base->draft_model.get()
                                         : nullptr;
    c->draft_model = std::make_unique<dfl::DraftModelProposer>(*m->m, c->ctx->model(), c->ctx->params(), share);
    c->attached(c->draft_model.get());
    c->refresh_proposers();
  });
}

int dfl_context_attach_lookup(dfl_context* c, int32_t ngram_min, int32_t ngram_max, int32_t block) {
  return dfl::api_guard([&] {
    if (!c) dfl::fail("context is NULL");
    c->lookup.reset();
    c->refresh_proposers();
    if (block <= 0) return;
    dfl::LookupParams p;
    p.ngram_min = ngram_min, p.ngram_max = ngram_max, p.block = block;
    c->lookup = std::make_unique<dfl::LookupProposer>(p);
    c->attached(c->lookup.get());
    c->refresh_proposers();
  });
}

int dfl_context_attach_mtp(dfl_context* c, int32_t block) {
  return dfl::api_guard([&] {
    if (!c) dfl::fail("context is NULL");
    c->mtp.reset();
    c->refresh_proposers();
    if (block <= 0) return;
    c->mtp = std::make_unique<dfl::MtpProposer>(*c->ctx, block);
    c->attached(c->mtp.get());
    c->refresh_proposers();
  });
}

int64_t dfl_context_draft_state_bytes(const dfl_context* c) {
  if (!c) return -1;
  int64_t n = 0;  // every attached drafter's
  for (const dfl::Proposer* p : {(const dfl::Proposer*)c->draft_model.get(), (const dfl::Proposer*)c->dflash.get(),
                                 (const dfl::Proposer*)c->mtp.get(), (const dfl::Proposer*)c->lookup.get()})
    if (p) n += (int64_t)p->state_bytes();
  return n;
}

int dfl_context_set_draft_hook(dfl_context* c, dfl_draft_hook fn, void* user) {
  return dfl::api_guard([&] {
    if (!c) dfl::fail("context is NULL");
    c->chain_hook.reset();
    if (fn)
      c->chain_hook = std::make_unique<dfl::ChainHookProposer>([fn, user](int32_t root_pos, int32_t root, int n,
                                                                          int32_t* toks) {
        if (fn(user, root_pos, root, n, toks) != 0) dfl::fail("draft hook failed at position %d", root_pos);
      });
    c->refresh_proposers();
  });
}

int dfl_context_set_tree_hook(dfl_context* c, dfl_tree_hook fn, void* user) {
  return dfl::api_guard([&] {
    if (!c) dfl::fail("context is NULL");
    c->tree_hook.reset();
    if (fn)
      c->tree_hook = std::make_unique<dfl::TreeHookProposer>([fn, user](int32_t root_pos, int32_t root, int cap,
                                                                        int32_t* toks, int32_t* parents) {
        const int32_t n = fn(user, root_pos, root, cap, toks, parents);
        if (n < 0) dfl::fail("tree hook failed at position %d", root_pos);
        return (int)n;
      });
    c->refresh_proposers();
  });
}

int dfl_context_set_topk_hook(dfl_context* c, dfl_topk_hook fn, void* user) {
  return dfl::api_guard([&] {
    if (!c) dfl::fail("context is NULL");
    c->topk_hook.reset();
    if (fn)
      c->topk_hook = std::make_unique<dfl::TopkHookProposer>([fn, user](int32_t root_pos, int32_t root, int L, int K,
                                                                        int32_t* ids, float* logp) {
        if (fn(user, root_pos, root, L, K, ids, logp) != 0) dfl::fail("top-k hook failed at position %d", root_pos);
      });
    c->refresh_proposers();
  });
}

int dfl_context_set_prefill_progress(dfl_context* c, dfl_progress_fn fn, void* user) {
  return dfl::api_guard([&] {
    if (!c) dfl::fail("context is NULL");
    if (!fn) {
      c->gen->set_prefill_progress(nullptr);
      return;
    }
    c->gen->set_prefill_progress([fn, user](int done, int total) { return fn(user, done, total) == 0; });
  });
}

int dfl_context_set_constraint(dfl_context* c, dfl_constraint_masks_fn masks, dfl_constraint_commit_fn commit,
                               dfl_constraint_forced_fn forced, void* user, int32_t prune) {
  return dfl::api_guard([&] {
    if (!c) dfl::fail("context is NULL");
    if (!masks) {
      c->gen->set_constraint(nullptr);
      c->constraint.reset();
      return;
    }
    if (!commit) dfl::fail("a constraint needs its commit callback");
    c->constraint = std::make_unique<dfl::CallbackConstraint>(
        [masks, user](int n, const int32_t* tokens, const int32_t* parents, int keep, uint32_t* out) {
          if (masks(user, n, tokens, parents, keep, out) != 0) dfl::fail("the constraint's mask callback failed");
        },
        [commit, user](const int32_t* tokens, int n) {
          if (commit(user, n, tokens) != 0) dfl::fail("the constraint's commit callback failed");
        },
        [forced, user](int32_t* out, int cap) {
          if (!forced) return 0;
          const int32_t n = forced(user, cap, out);
          if (n < 0 || n > cap) dfl::fail("the constraint's forced-token callback failed");
          return (int)n;
        });
    c->gen->set_constraint(c->constraint.get(), prune != 0);
  });
}

dfl_drafter* dfl_drafter_new(const dfl_draft* d, const dfl_model* target, const dfl_drafter_params* p) {
  dfl_drafter* out = nullptr;
  dfl::api_guard([&] {
    if (!d) dfl::fail("draft is NULL");
    if (!target) dfl::fail("target model is NULL");
    auto r = std::make_unique<dfl_drafter>();
    r->r = std::make_unique<dfl::Drafter>(*d->d, *target->m, drafter_params(p));
    out = r.release();
  });
  return out;
}

void dfl_drafter_free(dfl_drafter* r) { delete r; }

int dfl_drafter_reset(dfl_drafter* r) {
  return dfl::api_guard([&] {
    if (!r) dfl::fail("drafter is NULL");
    r->r->reset();
  });
}

int32_t dfl_drafter_n_pos(const dfl_drafter* r) { return r ? r->r->n_pos() : -1; }

int dfl_drafter_push_features(dfl_drafter* r, int32_t pos0, int32_t n, const float* features) {
  return dfl::api_guard([&] {
    if (!r) dfl::fail("drafter is NULL");
    if (n > 0 && !features) dfl::fail("features is NULL");
    r->r->push_features(pos0, n, features);
  });
}

int dfl_drafter_propose(dfl_drafter* r, int32_t n_block, const int32_t* block_tokens, float* logits) {
  return dfl::api_guard([&] {
    if (!r) dfl::fail("drafter is NULL");
    if (!block_tokens) dfl::fail("block_tokens is NULL");
    if (!logits) dfl::fail("logits is NULL");
    r->r->propose(block_tokens, n_block, logits);
  });
}

int dfl_drafter_propose_path(dfl_drafter* r, int32_t n_block, const int32_t* block_tokens, int32_t* path,
                             int32_t* cand_ids, float* cand_logp) {
  return dfl::api_guard([&] {
    if (!r) dfl::fail("drafter is NULL");
    if (!block_tokens) dfl::fail("block_tokens is NULL");
    if (!path) dfl::fail("path is NULL");
    r->r->propose_path(block_tokens, n_block, path, cand_ids, cand_logp);
  });
}

int dfl_drafter_propose_lattice(dfl_drafter* r, int32_t n_block, const int32_t* block_tokens, int32_t* cand_ids,
                                float* cand_logp, float* edge) {
  return dfl::api_guard([&] {
    if (!r) dfl::fail("drafter is NULL");
    if (!block_tokens || !cand_ids || !cand_logp || !edge) dfl::fail("a lattice argument is NULL");
    r->r->propose_lattice(block_tokens, n_block, cand_ids, cand_logp, edge);
  });
}

int dfl_dev_mtp_logits(dfl_context* c, const int32_t* tokens, int32_t n, float* logits) {
  return dfl::api_guard([&] {
    if (!c || !tokens || !logits) dfl::fail("null argument");
    dfl::Context& ctx = *c->ctx;
    const dfl::Model& m = ctx.model();
    if (!m.mtp.present()) dfl::fail("the model has no MTP head");
    if (n <= 0 || n > ctx.params().n_batch) dfl::fail("sequence of %d tokens (1..%d)", n, ctx.params().n_batch);
    const int H = m.cfg.n_embd;
    ctx.reset();
    std::vector<int32_t> pos((size_t)n);
    for (int i = 0; i < n; ++i) pos[(size_t)i] = i;
    std::vector<float> hidden((size_t)(n + 1) * H, 0.f);  // row 0 zeros, row p + 1 = position p
    const int32_t last = m.cfg.n_layer - 1;
    dfl::Batch b{n, tokens, pos.data(), nullptr};
    dfl::ForwardOutputs o;
    o.n_capture = 1;
    o.capture_layers = &last;
    o.hidden = hidden.data() + H;
    ctx.forward(b, o, true);
    dfl::Backend& be = ctx.backend();
    dfl::BackendBuf rows(be, (size_t)n * H * 4);
    be.upload(rows.p, hidden.data(), (size_t)n * H * 4);
    ctx.mtp_forward(tokens, n, 0, rows.f(), false, 0, nullptr, nullptr, nullptr, logits);
    ctx.reset();
  });
}

}  // extern "C"
#pragma GCC visibility pop

